"""ember's logits and greedy tokens against Hugging Face transformers on tiny random models."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES

import ember
from ember.daemon.loader.hf_dir import gguf_name
from ember.daemon.loader.model_file import open_model_file
from references import hf_greedy, hf_logits
from tiny_models import LLAMA3, YARN


ARCH_CASES = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", LLAMA3),
    # yarn's attention factor: on the scores' scale (llama: no head norms), in the head norms (qwen3)
    "llama-yarn": ("llama", {"rope_parameters": YARN | {"rope_theta": 10000.0}}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3-yarn": ("qwen3", {"rope_parameters": YARN | {"rope_theta": 10000.0}}),
}


@pytest.mark.parametrize("case", ARCH_CASES)
def test_logits_and_greedy_match_transformers(hf_model, case: str) -> None:
    arch, extra = ARCH_CASES[case]
    path, ref = hf_model(arch, **extra)
    model = ember.load(path, kv_dtype="f32")
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 33, 64):
        ids = rng.integers(1, model.config.vocab, n).tolist()
        expected = hf_logits(ref, ids)
        got = model.logits(ids)
        assert got.shape == expected.shape and got.dtype == np.float32
        span = expected.max() - expected.min()
        assert np.abs(got - expected).max() <= 1e-4 * span, f"{case}: {n} tokens"
    prompt = rng.integers(1, model.config.vocab, 9).tolist()
    assert list(model.generate(prompt, max_tokens=32, ignore_eos=True)) == hf_greedy(ref, prompt, 32)


def test_text_prompt_generation_matches_transformers(hf_model) -> None:
    path, ref = hf_model("qwen3")
    model = ember.load(path, kv_dtype="f32")
    ids = model.tokenize("def fibonacci(n):")
    assert list(model.generate("def fibonacci(n):", max_tokens=8, ignore_eos=True)) == hf_greedy(ref, ids, 8)


# The expected GGUF names, derived apart from the loader: transformers' module path (in the model, or in
# a decoder layer) -> the tensor as llama.cpp's converter calls it, formatted with gguf's TENSOR_NAMES
HF_MODULES = {
    "model.embed_tokens": MODEL_TENSOR.TOKEN_EMBD, "model.norm": MODEL_TENSOR.OUTPUT_NORM, "lm_head": MODEL_TENSOR.OUTPUT,
    "input_layernorm": MODEL_TENSOR.ATTN_NORM, "post_attention_layernorm": MODEL_TENSOR.FFN_NORM,
    "self_attn.q_proj": MODEL_TENSOR.ATTN_Q, "self_attn.k_proj": MODEL_TENSOR.ATTN_K,
    "self_attn.v_proj": MODEL_TENSOR.ATTN_V, "self_attn.o_proj": MODEL_TENSOR.ATTN_OUT,
    "self_attn.q_norm": MODEL_TENSOR.ATTN_Q_NORM, "self_attn.k_norm": MODEL_TENSOR.ATTN_K_NORM,
    "mlp.gate_proj": MODEL_TENSOR.FFN_GATE, "mlp.up_proj": MODEL_TENSOR.FFN_UP, "mlp.down_proj": MODEL_TENSOR.FFN_DOWN,
}
NAME_CASES = {
    "llama": ("llama", {}),
    "llama-qkv-bias-tied": ("llama", {"attention_bias": True, "tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
}


def expected_gguf_name(hf_name: str, arch: str) -> str:
    module, suffix = hf_name.rsplit(".", 1)
    layer = None
    if module.startswith("model.layers."):
        _, _, index, module = module.split(".", 3)
        layer = int(index)
    kind = HF_MODULES[module]
    assert kind in MODEL_TENSORS[next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)], f"{arch} has no {kind}"
    return f"{TENSOR_NAMES[kind].format(bid=layer)}.{suffix}"


@pytest.mark.parametrize("case", NAME_CASES)
def test_every_tensor_gets_the_converters_name_and_keeps_its_hf_layout(hf_model, case: str) -> None:
    arch, extra = NAME_CASES[case]
    path, ref = hf_model(arch, **extra)
    mf = open_model_file(path)
    state = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    if ref.config.tie_word_embeddings:  # save_pretrained writes no lm_head; output falls back to token_embd
        del state["lm_head.weight"]
    expected = {hf: expected_gguf_name(hf, arch) for hf in state}
    assert {hf: gguf_name(hf, arch, ref.config.num_hidden_layers) for hf in state} == expected
    assert set(mf.tensors) == set(expected.values())
    # no q/k permutation on this path: rows stay in HF's half-split rotary order, which the rotary
    # kernel is told to expect (a GGUF llama file is the one with adjacent pairs)
    assert not mf.rope_interleaved
    for hf, g in expected.items():
        assert np.array_equal(mf.tensors[g].data, state[hf]), g


def test_buffers_have_no_name_and_per_expert_tensors_their_stacks_name() -> None:
    """What TensorNameMap does with buffers and expert tensors, as llama.cpp's converter sees them."""
    def exps(kind: MODEL_TENSOR, layer: int) -> str:
        return TENSOR_NAMES[kind].format(bid=layer) + ".weight"

    # a buffer the converter skips, which the llama table would otherwise name blk.0.attn_rot_embd
    assert gguf_name("model.layers.0.self_attn.rotary_emb.inv_freq", "llama", 2) is None
    # the converter stacks a layer's experts under a merged name; each expert keeps its index in it
    assert gguf_name("model.layers.1.mlp.experts.3.gate_proj.weight", "qwen3moe", 2) == \
        exps(MODEL_TENSOR.FFN_GATE_EXP, 1).replace(".weight", ".3.weight")
    assert gguf_name("model.layers.1.mlp.experts.gate_proj.weight", "qwen3moe", 2) == exps(MODEL_TENSOR.FFN_GATE_EXP, 1)
    assert gguf_name("model.layers.1.mlp.experts.down_proj.weight", "qwen3moe", 2) == exps(MODEL_TENSOR.FFN_DOWN_EXP, 1)
    assert gguf_name("model.layers.1.mlp.gate.weight", "qwen3moe", 2) == exps(MODEL_TENSOR.FFN_GATE_INP, 1)
    # Mixtral is converted as llama; its stacked experts are named like Mistral's consolidated files
    assert gguf_name("model.layers.0.block_sparse_moe.experts.3.w1.weight", "mixtral", 1) == \
        exps(MODEL_TENSOR.FFN_GATE_EXP, 0).replace(".weight", ".3.weight")
    assert gguf_name("layers.0.feed_forward.experts.w1.weight", "mixtral", 1) == exps(MODEL_TENSOR.FFN_GATE_EXP, 0)
    assert gguf_name("model.layers.0.block_sparse_moe.gate.weight", "mixtral", 1) == exps(MODEL_TENSOR.FFN_GATE_INP, 0)
    # a dense architecture's table has no expert tensors at all
    assert gguf_name("model.layers.0.mlp.experts.gate_proj.weight", "qwen3", 1) is None
    assert gguf_name("model.layers.0.mlp.experts.2.gate_proj.weight", "qwen3", 1) is None
