"""Tiny random Hugging Face models (the transformers oracle), built with from_config and saved with
save_pretrained, plus the model configurations the tests share."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
DEMO_TOKENIZER = FIXTURES / "ember-demo-dense"

# small but not degenerate: GQA (4 query heads on 2 kv heads), head_dim 32, vocab of the demo tokenizer
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=8192, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)

# a hybrid (Qwen3.5): layers 0-2 Gated DeltaNet, layer 3 gated attention with partial rotary (16 of 64
# dimensions); two value heads per key head, so the head order (grouped or tiled) matters
QWEN35 = dict(num_hidden_layers=4, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4)
HF_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig",
              "mixtral": "MixtralConfig", "qwen35": "Qwen3_5TextConfig", "qwen35moe": "Qwen3_5MoeTextConfig",
              "laguna": "LagunaConfig", "gemma4": "Gemma4TextConfig"}
# MoE: 8 experts of width 64, top-2; the router is randomised too (HF inits it to zeros)
TINY_MOE = {"qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
            "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
            # Laguna XS.2's layout at a small scale: a dense lead layer, then sparse ones with a shared
            # expert; full attention on every 4th layer from 0 (as llama.cpp assumes), a window of 8
            # keys on the rest, with more query heads there (6, on 2 KV heads); soft-capped router
            # logits and scaled routed weights
            "laguna": dict(num_hidden_layers=5, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                           shared_expert_intermediate_size=96, sliding_window=8,
                           layer_types=["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
                           num_attention_heads_per_layer=[4, 6, 6, 6, 4], moe_router_logit_softcapping=4.0,
                           moe_routed_scaling_factor=2.5)}
# Gemma 4's features at a small scale: sliding layers (window 8, head_dim 32) around two full layers
# of their own shape (head_dim 64, one KV head, values from the keys' projection), the last two
# layers sharing K/V (with a double-wide FFN), per-layer embeddings and a soft-capped head
GEMMA4 = dict(num_hidden_layers=6, sliding_window=8, global_head_dim=64, num_global_key_value_heads=1,
              attention_k_eq_v=True, layer_types=["sliding_attention"] * 2 + ["full_attention"]
              + ["sliding_attention"] * 2 + ["full_attention"], hidden_size_per_layer_input=16,
              vocab_size_per_layer_input=8192, num_kv_shared_layers=2, use_double_wide_mlp=True,
              final_logit_softcapping=30.0, tie_word_embeddings=True, pad_token_id=0, bos_token_id=2,
              eos_token_id=1)
TINY_ARCH = TINY_MOE | {"gemma4": GEMMA4}


def build_hf_model(arch: str, out: Path, seed: int = 0, **overrides: Any) -> tuple[Path, Any]:
    """Build a random tiny model with transformers' from_config, save it with save_pretrained, and
    give it the demo tokenizer. Returns (directory, the torch model in eval mode)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, HF_CLASSES[arch])(**(TINY | TINY_ARCH.get(arch, {}) | overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomise them so they are tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
            elif name.endswith("self_attn.g_proj.weight"):  # laguna's output gate: softplus of O(1), not of ~0
                p.copy_(torch.randn_like(p) * 0.1)
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):  # MoE routers
                # laguna's sigmoid scores saturate at logits of O(10): O(1) there, as trained routers have
                p.copy_(torch.randn_like(p) * (0.1 if arch == "laguna" else 1.0))
            elif name.endswith(("router.scale", "router.per_expert_scale")):  # gemma4's, 1 at init
                p.copy_(1.0 + torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # gemma4's per-layer output scale (a buffer, saved)
                b.copy_(torch.rand_like(b) + 0.5)
    model.eval()
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TOKENIZER / f, out / f)
    return out, model

# yarn with a short original context, so that its ramp and attention factor act within a test's prompts
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
LLAMA3 = {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 32, "rope_theta": 500000.0}}


def write_gemma_tokenizer(out: Path) -> int:
    """A small tokenizer of Gemma's kind into `out` (tokenizer.json, tokenizer_config.json): BPE over
    characters with "▁" for spaces and <0xXX> byte fallback, lines cut apart, Gemma's special tokens
    first (pad, eos, bos, unk at 0-3), trained on the tokenizer tests' text. It is what llama.cpp's
    converter takes for a gemma4 vocabulary (gguf-py's LlamaHfVocab). Returns its size."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as CoreTokenizer

    from tokenizer_fixtures import FIXED, TRAIN_TEXT

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]
    tok = CoreTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[^\\n]+|\\n+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=2000, show_progress=False,
                                  special_tokens=specials + [f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator(TRAIN_TEXT * 3 + FIXED, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", '
        '"unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": true}')
    return tok.get_vocab_size()
