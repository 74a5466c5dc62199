"""Laguna (poolside): tiny random configurations against transformers (HF directories), the same
models converted and quantized by llama.cpp against llama.cpp, and the hot/cold expert machinery on
them (cold workers, placement, statistics), in process and through the daemon."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ember
from ember.daemon.loader.model_file import open_model_file
from ember.kernels import get_ops
from ember.kernels.reference import moe as ref_moe
from cold_experts import cold_equals_all_hot
from references import hf_greedy, hf_logits
from tiny_models import YARN

LAYERS = 5  # tiny_models.TINY_MOE["laguna"]: layer 0 dense, 1-4 sparse; 0 and 4 full attention, 1-3 sliding
CASES = {
    "xs2": {},  # per-head output gate, sliding layers with more heads, soft-capped router
    # M.1's layout: every layer full, a per-element output gate, three dense lead layers, no soft cap
    "m1": dict(layer_types=["full_attention"] * LAYERS, num_attention_heads_per_layer=None, gating="per-element",
               mlp_layer_types=["dense"] * 3 + ["sparse"] * 2, moe_router_logit_softcapping=0.0),
    "bias": dict(attention_bias=True),  # q, k, v and output projections with biases
    # XS.2's rope as llama.cpp describes it: yarn on the full layers (partial rotary), plain on the sliding ones
    "yarn": dict(rope_parameters={"full_attention": YARN | {"rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))  # routing statistics of this test only


def dense_layers(ref) -> list[int]:
    return [i for i, t in enumerate(ref.config.mlp_layer_types) if t == "dense"]


@pytest.mark.parametrize("case", CASES)
def test_laguna_matches_transformers(hf_model, case: str) -> None:
    """Logits within 1e-4 of their range at 1, 7 and 40 tokens (past the window of 8), and 64 greedy
    tokens, as transformers' LagunaForCausalLM gives them; routing only on the sparse layers."""
    path, ref = hf_model("laguna", **CASES[case])
    model = ember.load(path, kv_dtype="f32")
    c = model.config
    assert (c.arch, c.expert_gating, c.expert_scale) == ("laguna", "sigmoid", 2.5)
    if case == "xs2":
        assert c.layer_heads == (4, 6, 6, 6, 4) and c.sliding_layers == (False, True, True, True, False)
        assert (c.sliding_window, c.rope_dim, c.rope_dim_swa, c.router_softcap) == (8, 16, 32, 4.0)
    elif case == "m1":
        assert c.layer_heads == () and c.sliding_window == 0
    elif case == "yarn":
        assert c.rope_scaling.kind == "yarn" and c.rope_attn_factor == pytest.approx(1 + 0.1 * np.log(4))
    rng = np.random.default_rng(3)
    for n in (1, 7, 40):
        ids = rng.integers(1, c.vocab, n).tolist()
        expected = hf_logits(ref, ids)
        assert np.abs(model.logits(ids) - expected).max() <= 1e-4 * (expected.max() - expected.min()), f"{n} tokens"
    dense = dense_layers(ref)
    stats = model.routing_stats()
    assert stats.shape == (LAYERS, 8) and not stats[dense].any()
    assert all(stats[i].sum() > 0 for i in range(LAYERS) if i not in dense)
    assert [i for i, hot in enumerate(model.placement()) if not hot] == dense
    prompt = rng.integers(1, c.vocab, 6).tolist()
    model32 = ember.load(path, decode_act="f32", prompt_act="f32", kv_dtype="f32")
    assert list(model32.generate(prompt, max_tokens=64, ignore_eos=True)) == hf_greedy(ref, prompt, 64)


def test_sigmoid_routing_matches_the_reference() -> None:
    """ops.route's sigmoid gating (soft cap, selection bias, renormalised and scaled weights) against
    the float64 reference, where the bias changes which experts win."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((33, 16)).astype(np.float32) * 3
    bias = (rng.standard_normal(16) * 0.3).astype(np.float32)
    ops = get_ops("cpu")
    ids, w = ops.route(logits, 4, True, "sigmoid", bias, 2.0, 2.5)
    want_ids, want_w = ref_moe.route(logits, 4, True, "sigmoid", bias, 2.0, 2.5)
    assert (ids == want_ids).all()
    np.testing.assert_allclose(w, want_w, rtol=1e-6)
    np.testing.assert_allclose(w.sum(1), 2.5, rtol=1e-6)
    unbiased, _ = ops.route(logits, 4, True, "sigmoid", None, 2.0, 2.5)
    assert (unbiased != ids).any(), "the selection bias should change some choices"


def test_sliding_window_attention_sees_only_its_window() -> None:
    """ops.paged_attention with a window: each token attends to its last `window` keys exactly as a
    dense softmax over them, whatever the dtype of the cache; window 0 sees them all."""
    ops = get_ops("cpu")
    rng = np.random.default_rng(2)
    n, hq, kvh, hd, bs = 37, 4, 2, 32, 8
    q = rng.standard_normal((n, hq, hd)).astype(np.float32)
    k = rng.standard_normal((n, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((n, kvh, hd)).astype(np.float32)
    blocks = rng.permutation(8)[: (n + bs - 1) // bs]
    pos = np.arange(n)
    for window in (0, 1, 5, 16):
        for dtype in ("f32", "f16"):
            ks, vs = ops.kv_store(dtype, 8, bs, kvh, hd, keys=True), ops.kv_store(dtype, 8, bs, kvh, hd, keys=False)
            ops.kv_write(ks, blocks[pos // bs], pos % bs, k)
            ops.kv_write(vs, blocks[pos // bs], pos % bs, v)
            got = ops.paged_attention(q, ks, vs, blocks[None, :], np.zeros(n, np.int64), pos, hd**-0.5, window)
            for i in (0, 3, 20, n - 1):
                first = max(0, i + 1 - window) if window else 0
                for h in range(hq):
                    s = k[first: i + 1, h // 2] @ q[i, h] * hd**-0.5
                    p = np.exp(s - s.max())
                    want = p @ v[first: i + 1, h // 2] / p.sum()
                    np.testing.assert_allclose(got[i, h], want, atol=3e-3 if dtype == "f16" else 2e-5)


def test_config_and_names_from_a_directory(hf_model) -> None:
    """Every tensor of the directory gets the name llama.cpp's converter gives it: the output gate
    attn_gate, the selection bias exp_probs_b, the shared expert's, the dense lead layer's FFN."""
    path, ref = hf_model("laguna")
    mf = open_model_file(path)
    names = set(mf.tensors)
    assert {"blk.0.ffn_gate.weight", "blk.0.attn_gate.weight", "blk.1.exp_probs_b.bias", "blk.1.ffn_gate_inp.weight",
            "blk.1.ffn_gate_shexp.weight", "blk.1.ffn_down_exps.7.weight"} <= names
    assert "blk.0.ffn_gate_inp.weight" not in names and not any("ffn_gate_inp_shexp" in n for n in names)
    assert mf.tensors["blk.1.attn_gate.weight"].shape == (6, ref.config.hidden_size)
    assert mf.tensors["blk.1.attn_q.weight"].shape == (6 * 32, ref.config.hidden_size)


# --- GGUF files made by llama.cpp -------------------------------------------------------------------
# quantizable shapes (rows of 256 values), the XS.2 layout, and no router soft cap: llama.cpp neither
# converts nor applies one (docs/models.md)
GGUF_SHAPE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                  head_dim=64, num_attention_heads_per_layer=[4, 8, 8, 8, 4], moe_router_logit_softcapping=0.0)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """(the float32 file llama.cpp's converter makes of a tiny Laguna, the transformers model)."""
    from llama_cpp_tools import convert
    from tiny_models import build_hf_model

    tmp = tmp_path_factory.mktemp("laguna-gguf")
    path, ref = build_hf_model("laguna", tmp / "hf", **GGUF_SHAPE)
    return convert(path, tmp / "f32.gguf", "f32"), ref


@pytest.mark.oracle
@pytest.mark.parametrize("ftype", ["F32", "Q8_0", "Q4_K_M"])
def test_laguna_gguf_matches_llama_cpp(converted, tmp_path: Path, ftype: str) -> None:
    """The converted file, and llama.cpp's quantizations of it. ember's logits are llama.cpp's on the
    same weights at float32 (a dequantized copy) to 1e-5 of the range, and the float32 file's are
    transformers' to 1e-4 and in 24 greedy tokens. llama.cpp on a quantized file quantizes its
    activations too (~2% of the range here, routing flips included): ember differs from it by no
    more than llama.cpp differs from itself at float32 (docs/models.md)."""
    from gguf_copy import copy_gguf
    from llama_cpp_tools import quantize
    from references import llama_cpp_logits

    f32, ref = converted
    path = f32 if ftype == "F32" else quantize(f32, tmp_path / f"{ftype}.gguf", ftype)
    model = ember.load(path, kv_dtype="f32", prompt_act="f32")  # the file read exactly
    c = model.config
    assert (c.sliding_layers, c.sliding_window, c.layer_heads) == ((False, True, True, True, False), 8, (4, 8, 8, 8, 4))
    ids = np.random.default_rng(5).integers(1, c.vocab, 40).tolist()
    ours = model.logits(ids)
    same_weights = path if ftype == "F32" else copy_gguf(path, tmp_path / "dequantized.gguf", dequantize=True)
    exact = llama_cpp_logits(same_weights, ids)
    span = exact.max() - exact.min()
    assert np.abs(ours - exact).max() <= 1e-5 * span
    if ftype == "F32":
        expected = hf_logits(ref, ids)
        assert np.abs(ours - expected).max() <= 1e-4 * (expected.max() - expected.min())
        model32 = ember.load(path, decode_act="f32", prompt_act="f32", kv_dtype="f32")  # decode steps, past the window
        assert list(model32.generate(ids[:6], max_tokens=24, ignore_eos=True)) == hf_greedy(ref, ids[:6], 24)
    else:
        theirs = llama_cpp_logits(path, ids)
        noise = np.abs(theirs - exact).max(axis=1)
        assert (np.abs(ours - theirs).max(axis=1) <= noise + 1e-5 * span).all()


@pytest.mark.oracle
def test_which_layers_slide_is_read_from_the_file_as_llama_cpp_reads_it(converted, tmp_path: Path) -> None:
    """llama.cpp's converter writes the window but not which layers slide, and llama.cpp then takes
    XS.2's layout (every 4th layer full from layer 0). A model whose layers are all full attention
    with a window in its config is misread that way by both; written as the converter should write
    it (no window where nothing slides), both read it as transformers runs it (docs/models.md)."""
    import gguf

    from gguf_copy import copy_gguf
    from llama_cpp_tools import convert
    from references import llama_cpp_logits
    from tiny_models import build_hf_model

    path, ref = build_hf_model("laguna", tmp_path / "hf", **(GGUF_SHAPE | dict(
        layer_types=["full_attention"] * LAYERS, num_attention_heads_per_layer=None)))
    as_converted = convert(path, tmp_path / "f32.gguf", "f32")
    fixed = copy_gguf(as_converted, tmp_path / "fixed.gguf", drop=["laguna.attention.sliding_window"])
    assert ember.load(as_converted).config.sliding_layers == (False, True, True, True, False)
    ids = np.random.default_rng(5).integers(1, 8192, 24).tolist()
    expected = hf_logits(ref, ids)
    span = expected.max() - expected.min()
    for f in (as_converted, fixed):
        ours, theirs = ember.load(f, kv_dtype="f32").logits(ids), llama_cpp_logits(f, ids)
        assert np.abs(ours - theirs).max() <= 1e-5 * span, f.name
    assert np.abs(ember.load(fixed, kv_dtype="f32").logits(ids) - expected).max() <= 1e-4 * span
    pattern = copy_gguf(as_converted, tmp_path / "pattern.gguf", element=gguf.GGUFValueType.BOOL,
                        add={"laguna.attention.sliding_window_pattern": ([False, True] * 2 + [False],
                                                                         gguf.GGUFValueType.ARRAY)})
    assert ember.load(pattern).config.sliding_layers == (False, True, False, True, False)


# --- hot and cold experts -----------------------------------------------------------------------------
@pytest.mark.slow
def test_cold_experts_on_laguna_equal_all_hot(hf_model) -> None:
    """60% of the sparse layers' experts hot, the rest computed by two cold workers: the logits of a
    40-token prompt (past the window) and 24 decoded tokens are the all-hot model's; placement and
    statistics leave the dense lead layer out; the lossy `mask` policy runs and differs."""
    path, _ = hf_model("laguna")
    hot, s = cold_equals_all_hot(path, "60%")
    assert hot[0] == 0 and all(0 < h < 8 for h in hot[1:]) and sum(hot) == int(0.6 * 32)
    assert (s.hot_experts, s.total_experts) == (sum(hot), 32) and s.cold_slots > 0 and s.worker_restarts == 0


@pytest.mark.oracle
def test_yarn_gguf_matches_llama_cpp_and_transformers(tmp_path: Path) -> None:
    """Yarn on the full layers, converted by llama.cpp: ember reads the scaling from the file as llama.cpp
    applies it (ggml's ramp, llama_context's attention factor): llama.cpp's and transformers' logits."""
    from llama_cpp_tools import convert
    from references import llama_cpp_logits
    from tiny_models import build_hf_model

    path, ref = build_hf_model("laguna", tmp_path / "hf", **(GGUF_SHAPE | CASES["yarn"]))
    f32 = convert(path, tmp_path / "f32.gguf", "f32")
    model = ember.load(f32, kv_dtype="f32")
    assert model.config.rope_scaling == ember.load(path).config.rope_scaling
    ids = np.random.default_rng(5).integers(1, 8192, 40).tolist()
    ours = model.logits(ids)
    for theirs in (llama_cpp_logits(f32, ids), hf_logits(ref, ids)):
        assert np.abs(ours - theirs).max() <= 1e-5 * (theirs.max() - theirs.min())
