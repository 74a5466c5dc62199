"""The DFlash draft's training path (daemon/speculative/dflash_*.py): the block's attention sees exactly
what the runtime gives it, the acceptance walk counts as the runtime does, and a trained draft comes out
of llama.cpp's own converter as a `dflash` GGUF that llama.cpp loads, holding the weights trained."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from ember.daemon.speculative.dflash_acceptance import block_inputs, walk  # noqa: E402
from ember.daemon.speculative.dflash_torch import DFlashConfig, DFlashDraft  # noqa: E402
from tiny_models import TINY, build_hf_model  # noqa: E402

CFG = DFlashConfig(hidden_size=128, vocab_size=8192, rope_theta=10000.0, rms_norm_eps=1e-6, num_target_layers=2,
                   target_layer_ids=(0, 1), mask_token_id=5, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, intermediate_size=256, block_size=4)


def _run_blocks(draft: DFlashDraft, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                embed: torch.nn.Embedding) -> torch.Tensor:
    ids, pos, mask = block_inputs(tokens.shape[1], anchors, CFG.block_size, CFG.mask_token_id, tokens)
    return draft(embed(ids), features, pos, torch.arange(tokens.shape[1])[None], mask)


def test_a_block_sees_the_context_before_its_anchor_and_its_whole_block() -> None:
    torch.manual_seed(0)
    draft, embed = DFlashDraft(CFG).eval(), torch.nn.Embedding(CFG.vocab_size, CFG.hidden_size)
    tokens = torch.randint(0, CFG.vocab_size, (1, 12))
    features = torch.randn(1, 12, CFG.feature_width)
    anchors = torch.tensor([[3, 7]])
    with torch.no_grad():
        base = _run_blocks(draft, features, tokens, anchors, embed).view(2, CFG.block_size, -1)
        later = features.clone()
        later[:, 7:] += 1.0  # rows at and after the second anchor: the target has not verified them yet
        moved = _run_blocks(draft, later, tokens, anchors, embed).view(2, CFG.block_size, -1)
        torch.testing.assert_close(moved, base)
        earlier = features.clone()
        earlier[:, 6] += 1.0  # the row just before the second anchor: only that block reads it
        moved = _run_blocks(draft, earlier, tokens, anchors, embed).view(2, CFG.block_size, -1)
        torch.testing.assert_close(moved[0], base[0])
        assert (moved[1] - base[1]).abs().max() > 1e-3
        other = tokens.clone()
        other[0, 7] = (tokens[0, 7] + 1) % CFG.vocab_size  # the anchor token: every row of its block reads it
        moved = _run_blocks(draft, features, other, anchors, embed).view(2, CFG.block_size, -1)
        torch.testing.assert_close(moved[0], base[0])
        assert ((moved[1] - base[1]).abs().amax(-1) > 1e-3).all()


def test_walk_counts_as_greedy_speculation_does() -> None:
    tokens = [9, 10, 11, 12, 13, 14, 15]
    # one row of 3 proposals (block_size 4) per anchor 1..6. At 1: 11, 12 right, then wrong -> 2
    # accepted, the target adds 13, next anchor 4. At 4: two tokens left, the first wrong -> 0, next
    # anchor 5. At 5: one token left (15), right -> 1.
    proposals = torch.tensor([[11, 12, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [15, 0, 0], [0, 0, 0]])
    stats = walk(proposals, tokens, 1)
    assert (stats.proposed, stats.accepted, stats.steps) == (3 + 2 + 1, 2 + 0 + 1, 3)
    assert stats.mean_accepted_length == pytest.approx((3 + 3) / 3)


@pytest.mark.oracle
@pytest.mark.slow
def test_a_trained_draft_converts_with_llama_cpp_and_keeps_its_weights(tmp_path: Path) -> None:
    """Train a few steps against a tiny random target, then read the GGUF llama.cpp's converter wrote.
    2 MB of this machine's sources: the first 1 MB of a fresh machine's held 357 validation tokens
    (2026-11-30), under the 1000 the training asks for."""
    from llama_cpp_tools import converter_script

    converter = converter_script()
    gguf = pytest.importorskip("gguf")
    from ember.daemon.speculative import dflash_training

    target_dir, _ = build_hf_model("qwen3", tmp_path / "target")
    out = tmp_path / "draft"
    dflash_training.main(["--target", str(target_dir), "--out", str(out), "--converter", str(converter),
                          "--outtype", "f32", "--corpus-mb", "2", "--minutes", "0.05", "--target-layers", "0,1",
                          "--block-size", "4", "--seq-len", "64", "--batch", "2", "--anchors", "8",
                          "--eval-every", "1000", "--eval-prompts", "1", "--eval-tokens", "8"])
    record = json.loads((out / "training.json").read_text())
    assert record["steps"] > 0 and set(record["eval"]["acceptance"]) == {"f32", "f16", "bf16", "q8_0"}
    reader = gguf.GGUFReader(out / "ember-demo-dflash-f32.gguf")
    fields = {f.name: f.contents() for f in reader.fields.values() if not f.name.startswith("tokenizer.ggml.t")}
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.target_layers"] == [1, 2]  # llama.cpp counts hidden states: layer i's output is i + 1
    assert fields["dflash.block_size"] == 4
    assert fields["dflash.embedding_length"] == TINY["hidden_size"]
    assert fields["tokenizer.ggml.mask_token_id"] == record["config"]["dflash_config"]["mask_token_id"]
    from safetensors.numpy import load_file

    trained = load_file(str(out / "hf" / "model.safetensors"))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    np.testing.assert_array_equal(tensors["fc.weight"], trained["fc.weight"])
    np.testing.assert_array_equal(tensors["enc.output_norm.weight"], trained["hidden_norm.weight"])
    np.testing.assert_array_equal(tensors["blk.0.attn_k.weight"], trained["layers.0.self_attn.k_proj.weight"])
    assert "token_embd.weight" not in tensors  # the target's embeddings and lm_head are shared
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.llama_model_load_from_file(str(out / "ember-demo-dflash-f32.gguf").encode(),
                                                 llama_cpp.llama_model_default_params())
    assert model, "llama.cpp did not load the converted draft"
    llama_cpp.llama_model_free(model)


# --- the torch draft against llama.cpp, and the trained demo draft in ember --------------------------
@pytest.mark.oracle
@pytest.mark.slow
def test_the_torch_draft_computes_what_llama_cpp_runs(tmp_path: Path) -> None:
    """The network trained here, saved and converted by llama.cpp's converter, run by llama.cpp beside
    the demo target on the same context rows: the torch module's block logits are llama.cpp's (to the
    target's q8_0 lm_head and llama.cpp's q8_0 activations)."""
    from dflash_files import reference_draft
    from llama_cpp_dflash import run_draft
    from llama_cpp_tools import converter_script

    from ember.daemon.loader.demo_model import DEMO_MODEL
    from ember.daemon.loader.llama_cpp_converter import convert_hf

    converter = converter_script()
    # the demo target's shape; layers 0 and 2 (llama.cpp taps no output of the last layer of a qwen3)
    cfg = DFlashConfig(hidden_size=384, vocab_size=8192, rope_theta=100000.0, rms_norm_eps=1e-6, num_target_layers=5,
                       target_layer_ids=(0, 2), mask_token_id=5, block_size=8)
    torch.manual_seed(0)
    draft = DFlashDraft(cfg).eval()
    with torch.no_grad():  # weights large enough that the logits depend on them, norms not all 1
        for name, p in draft.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    draft.save(tmp_path / "hf")
    fixture = Path(__file__).parent / "fixtures" / "ember-demo-dense"  # config and tokenizer: all the converter reads
    path = convert_hf(converter, tmp_path / "hf", tmp_path / "draft.gguf", "f32", "--target-model-dir", str(fixture))
    ids = [int(t) for t in np.random.default_rng(0).integers(10, 8000, 23)]
    context, last, k = ids[:-1], ids[-1], 6
    oracle = run_draft(DEMO_MODEL, path, (1, 3), context, last, cfg.mask_token_id, k)
    embed = torch.from_numpy(reference_draft(path, DEMO_MODEL).embed)  # the target's (tied), dequantized
    n = len(context)
    block = torch.tensor([[last] + [cfg.mask_token_id] * k])
    mask = torch.ones(1, k + 1, n + k + 1, dtype=torch.bool)
    with torch.no_grad():
        hidden = draft(embed[block], torch.from_numpy(oracle.features)[None], torch.arange(n, n + k + 1)[None],
                       torch.arange(n)[None], mask)
        logits = (hidden[0, 1:] @ embed.T).numpy()
    tolerance = 0.02 * np.abs(oracle.logits).max()
    np.testing.assert_allclose(logits, oracle.logits, atol=tolerance)
    assert np.abs(logits).max() > 1.0  # not a comparison of near-zero rows


@pytest.mark.slow
def test_the_trained_demo_draft_keeps_greedy_tokens_and_is_accepted() -> None:
    """daemon/assets' trained DFlash draft on the demo model: the tokens of decoding without it, and
    (being trained, not random) a real share of its proposals accepted."""
    import ember
    from ember.daemon.loader.demo_model import DEMO_DFLASH, DEMO_MODEL

    target = ember.load(DEMO_MODEL)
    spec = ember.load(DEMO_MODEL, draft=DEMO_DFLASH, draft_tokens=7)
    for prompt in ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):"]:
        alone = list(target.generate(prompt, max_tokens=64, ignore_eos=True))
        assert list(spec.generate(prompt, max_tokens=64, ignore_eos=True)) == alone, prompt
    stats = spec.spec_stats()
    assert stats.steps > 0 and stats.proposed <= 7 * stats.steps
    assert stats.acceptance_rate > 0.04, stats  # random weights: about 0 (tests/test_dflash.py)
