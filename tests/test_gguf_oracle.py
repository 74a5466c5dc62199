"""GGUF files written like llama.cpp's converter: ember against transformers (same weights, both
formats; dequantized weights) and against llama.cpp itself on the same quantized file."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

import ember
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.kernels.reference.quant import quantize
from ember.kernels.tensor_types import TensorType
from gguf_writer import MIXED, NEWER, Q4_K_M, write_gguf
from references import hf_logits, llama_cpp_logits, state_dict
from tiny_models import LLAMA3

# K-quants need rows of whole 256-value super-blocks
KQ = dict(hidden_size=256, intermediate_size=512, head_dim=64)
CASES = {"llama": ("llama", {}), "llama3-rope": ("llama", LLAMA3), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {})}
F32_ONLY = {"*": TensorType.F32}


def prompts(vocab: int, lengths=(1, 5, 40)) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


@pytest.mark.parametrize("case", CASES)
def test_same_weights_as_safetensors_and_gguf_give_same_logits(hf_model, tmp_path: Path, case: str) -> None:
    arch, extra = CASES[case]
    hf_dir, ref = hf_model(arch, **extra)
    gguf_path = write_gguf(tmp_path / f"{case}.gguf", ref.config, state_dict(ref), F32_ONLY)
    from_hf, from_gguf = ember.load(hf_dir), ember.load(gguf_path)
    assert from_gguf.config.arch == arch
    for ids in prompts(from_hf.config.vocab):
        a, b = from_hf.logits(ids), from_gguf.logits(ids)
        assert np.abs(a - b).max() <= 1e-5 * (a.max() - a.min())


def dequantized_copy(model, types) -> None:
    """Replace the model's matrices by what the GGUF file stores (quantize, then gguf-py dequantize)."""
    from gguf_writer import _type_for
    from ember.daemon.loader.hf_dir import gguf_name

    torch = pytest.importorskip("torch")
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = gguf_name(name, model.config.model_type, model.config.num_hidden_layers)
            if g is None or p.ndim == 1:
                continue
            t = _type_for(g, types)
            w = p.numpy().astype(np.float32)
            if t == TensorType.F16:
                p.copy_(torch.from_numpy(w.astype(np.float16).astype(np.float32)))
            elif t != TensorType.F32:
                raw = quantize(t, w).view(np.uint8).reshape(w.shape[0], -1)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(t)))))


@pytest.mark.parametrize("arch,types", [("llama", MIXED), ("qwen3", MIXED), ("qwen3", NEWER)],
                         ids=["llama", "qwen3", "qwen3-newer-types"])
def test_quantized_gguf_equals_transformers_on_dequantized_weights(hf_model, tmp_path: Path, arch: str,
                                                                   types: dict[str, TensorType]) -> None:
    """Every tensor type (Q4_K, Q5_K, Q6_K, Q8_0, F16, BF16, F32; then Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL,
    Q2_K, Q3_K, IQ4_XS) read exactly: ember on the quantized file equals transformers running the same
    weights dequantized by gguf-py (an independent oracle)."""
    _, ref = hf_model(arch, **KQ)
    path = write_gguf(tmp_path / "mixed.gguf", ref.config, state_dict(ref), types)
    dequantized_copy(ref, types)
    model = ember.load(path, kv_dtype="f32", prompt_act="f32")  # exact activations: the weights' reading alone
    for ids in prompts(model.config.vocab):
        expected = hf_logits(ref, ids)
        assert np.abs(model.logits(ids) - expected).max() <= 1e-4 * (expected.max() - expected.min())


# llama.cpp multiplies quantized weights with activations it has itself quantized (to Q8_0 or Q8_K,
# 8 bits per value), each dot product carrying ~0.4% relative error that ember, with f32 activations,
# does not have. Through the layers this reaches, measured over 9 files (3 architectures x Q8_0 / Q4_K_M
# / mixed, 64 tokens): max |diff| 0.4-1.05% of the logit range, RMS 0.08-0.21%. Tolerance: 2% of the
# range. Random tiny models have near-ties, so top-1 may differ where llama.cpp's own top-1/top-2
# margin is inside that noise (measured: every disagreement had a margin < 0.55% of the range; rate
# 90.6-100%); it must agree wherever the margin exceeds the tolerance. The trained demo model below
# gives the meaningful top-1 rate.
LLAMA_CPP_TOLERANCE = 0.02


def assert_close_to_llama_cpp(ours: np.ndarray, theirs: np.ndarray) -> float:
    """Checks the tolerance rules above and returns the top-1 agreement rate."""
    span = theirs.max() - theirs.min()
    assert np.abs(ours - theirs).max() <= LLAMA_CPP_TOLERANCE * span
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > LLAMA_CPP_TOLERANCE * span
    agree = ours.argmax(-1) == theirs.argmax(-1)
    assert agree[clear].all(), "top-1 differs where llama.cpp's margin is above the noise"
    return float(agree.mean())


@pytest.mark.oracle
@pytest.mark.parametrize("types_name", ["Q8_0", "Q4_K_M", "MIXED"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_logits_match_llama_cpp_on_same_file(hf_model, tmp_path: Path, arch: str, types_name: str) -> None:
    types = {"Q8_0": {"*": TensorType.Q8_0}, "Q4_K_M": Q4_K_M, "MIXED": MIXED}[types_name]
    extra = LLAMA3 if arch == "llama" else {}
    _, ref = hf_model(arch, **KQ, **extra)
    path = write_gguf(tmp_path / f"{arch}.gguf", ref.config, state_dict(ref), types)
    model = ember.load(path)
    ids = prompts(model.config.vocab, (64,))[0]
    assert assert_close_to_llama_cpp(model.logits(ids), llama_cpp_logits(path, ids)) >= 0.85
    short = ids[:3]  # a prompt shorter than one block of work, on the same file
    assert_close_to_llama_cpp(model.logits(short), llama_cpp_logits(path, short))


@pytest.mark.oracle
def test_trained_demo_model_matches_llama_cpp() -> None:
    """The trained demo model (converted by llama.cpp's own converter) on real Python text, its prompt
    rows exact (prompt_act f32): top-1 must agree on nearly every position. 98% of 200: llama.cpp's
    own kernels differ by CPU (it quantizes its activations, and repacks rows on AVX2), and near-ties
    flip with them: 198 or more of 200 agreed against its AVX-512 build (Zen 5, where this asked 99%),
    197 against its AVX2 build (Zen 3, 2026-11-30)."""
    model = ember.load(DEMO_MODEL, prompt_act="f32")
    text = (DEMO_MODEL.parents[1] / "loader" / "gguf_file.py").read_text()
    ids = model.tokenize(text)[:200]
    rate = assert_close_to_llama_cpp(model.logits(ids), llama_cpp_logits(DEMO_MODEL, ids))
    assert rate >= 0.98, f"top-1 agreement {rate:.3f}"


# real text for the demo model: 200 tokens of each of these files
DEMO_TEXTS = ("loader/gguf_file.py", "runtime.py", "engine/engine_core.py", "runner/model_runner.py", "text/tokenizer.py")


@pytest.mark.oracle
def test_int8_prompt_rows_stay_as_close_to_the_exact_model_as_llama_cpp() -> None:
    """prompt_act q8_0 (the default with AVX-512 VNNI: prompt rows quantized as decode rows are), on
    the trained demo model's real text: ember's logits stay as close to the exact model's (f32 prompt rows and KV) as
    llama.cpp's, which quantizes its activations too: over 1000 positions, top-1 agreement with the
    exact model no lower than llama.cpp's by more than 0.5% (near-ties flip either way with any
    rounding: each text's count moves by 1-3 of 200 between builds), and in each text the largest
    difference within 1.5x llama.cpp's (measured 0.90-1.03% of the range against llama.cpp's
    0.85-1.13%: docs/runtime.md)."""
    exact_model = ember.load(DEMO_MODEL, prompt_act="f32", kv_dtype="f32")
    model = ember.load(DEMO_MODEL, kv_dtype="f32", prompt_act="q8_0")  # llama.cpp's cache here is f32 too
    agree = np.zeros(2, np.int64)
    positions = 0
    for name in DEMO_TEXTS:
        ids = model.tokenize((DEMO_MODEL.parents[1] / name).read_text())[:200]
        exact, ours, theirs = exact_model.logits(ids), model.logits(ids), llama_cpp_logits(DEMO_MODEL, ids)
        span = exact.max(axis=1) - exact.min(axis=1)
        ours_off, theirs_off = ((np.abs(x - exact).max(axis=1) / span).max() for x in (ours, theirs))
        assert 0 < ours_off <= 1.5 * theirs_off, (name, ours_off, theirs_off)
        agree += [int((x.argmax(1) == exact.argmax(1)).sum()) for x in (ours, theirs)]
        positions += len(ids)
    assert agree[0] >= agree[1] - 0.005 * positions, agree


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_yarn_files_from_llama_cpps_converter_match_it_and_transformers(hf_model, tmp_path: Path, arch: str) -> None:
    """Yarn (its ramp and attention factor: on the scores' scale for llama and qwen2, in the head norms
    for qwen3) from the keys llama.cpp's own converter writes: llama.cpp's logits and transformers'."""
    from llama_cpp_tools import convert
    from tiny_models import YARN

    path, ref = hf_model(arch, rope_parameters=YARN | {"rope_theta": 10000.0})
    f32 = convert(path, tmp_path / "f32.gguf", "f32")
    model = ember.load(f32, kv_dtype="f32")
    assert model.config.rope_scaling.kind == "yarn" and model.config.rope_attn_factor == pytest.approx(1 + 0.1 * np.log(4))
    ids = prompts(model.config.vocab, (40,))[0]
    ours = model.logits(ids)
    for theirs in (llama_cpp_logits(f32, ids), hf_logits(ref, ids)):
        assert np.abs(ours - theirs).max() <= 1e-5 * (theirs.max() - theirs.min())


# llama.cpp's quantization types whose files bring ember's newer block types (each file also holds the
# types llama.cpp mixes in: Q4_K, Q5_K or Q6_K for some tensors, Q8_0 or F32 where rows are short).
LLAMA_CPP_FTYPES = {"Q4_0": TensorType.Q4_0, "Q4_1": TensorType.Q4_1, "Q5_0": TensorType.Q5_0,
                    "Q5_1": TensorType.Q5_1, "IQ4_NL": TensorType.IQ4_NL, "IQ4_XS": TensorType.IQ4_XS,
                    "Q2_K": TensorType.Q2_K, "Q3_K_S": TensorType.Q3_K}


@pytest.mark.oracle
@pytest.mark.parametrize("ftype", LLAMA_CPP_FTYPES)
def test_files_llama_cpp_quantized_match_it(hf_model, tmp_path: Path, ftype: str) -> None:
    """A file llama.cpp quantized itself: its prompt logits (ember: float32 activations) and the logits
    of greedily generated tokens (ember's integer decode dots, q8_0 / q8_K activations as llama.cpp's)
    within the tolerance above of llama.cpp's on the same tokens."""
    from llama_cpp_tools import quantize as llama_cpp_quantize
    from test_hybrid import decode_logits

    _, ref = hf_model("qwen3", **KQ)
    f32 = write_gguf(tmp_path / "f32.gguf", ref.config, state_dict(ref), F32_ONLY)
    path = llama_cpp_quantize(f32, tmp_path / f"{ftype}.gguf", ftype)
    stored = {int(t.tensor_type) for t in gguf.GGUFReader(path).tensors}
    assert int(LLAMA_CPP_FTYPES[ftype]) in stored, sorted(stored)
    model = ember.load(path)
    ids = prompts(model.config.vocab, (48,))[0]
    assert assert_close_to_llama_cpp(model.logits(ids), llama_cpp_logits(path, ids)) >= 0.85
    rows, tokens = decode_logits(model, ids[:16], 24)
    theirs = llama_cpp_logits(path, ids[:16] + tokens[:-1])[15:]
    assert assert_close_to_llama_cpp(rows, theirs) >= 0.85
