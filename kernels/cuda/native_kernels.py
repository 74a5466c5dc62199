"""The catalog of ember's CUDA C++ kernels (kernels/cuda/native/*.cuh): every instantiation by name,
and the source text that defines it.

The headers hold templates; a kernel is one `extern "C"` instantiation of them, named for its
parameters (`ember_gemv_q4_k_b1_store`). CuPy compiles each kernel's source with NVRTC the first time
it is launched (kernels/cuda/native_launch.py) and caches the result, so a process compiles only what
it runs; the tests compile the whole catalog with nvcc for each target architecture. Nothing here
imports CuPy or needs a GPU.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ember.kernels.convert import KV_DTYPES
from ember.kernels.cuda.repack import NATIVE_TYPES
from ember.kernels.tensor_types import TensorType

SOURCE_DIR = Path(__file__).with_name("native")
NVRTC_OPTIONS = ("-std=c++17",)  # no fast math: the q8 scales divide exactly, as ggml's

# which kernels run a model on a cuda device (engine.cuda_kernels, ember.load): the numba.cuda kernels behind
# the ops API (every architecture, the simulator too), or these (dense models, decode replayed as graphs)
CUDA_KERNELS = ("numba", "native")
MAX_BATCH = 8  # rows a GEMV launch takes (template instantiations); more go 8 a launch, or prefill's GEMMs
EPILOGUES = ("store", "add", "swiglu")
HEAD_DIMS = (64, 128, 256, 512)  # head_dim = 32 * P: each lane of a warp holds P values of a head
HEADS_PER_BLOCK = (1, 2, 4, 8)  # query heads one attention block scores per K/V row

# the weight types of the repacked layout, by their name in kernels/cuda/native/common.cuh's WType
WEIGHT_TYPES: dict[TensorType, str] = {t: f"W_{t.name}" for t in NATIVE_TYPES}
KV_TYPES = {name: f"KV_{name.upper()}" for name in KV_DTYPES}  # f32, f16, bf16, q8_0


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its name and kind (`ptr`, `int` for int32, `i64`, `float` for float32)."""
    name: str
    kind: str


@dataclass(frozen=True)
class Kernel:
    """One instantiation: its name, the header that defines its template, and the macro line."""
    name: str
    header: str
    instance: str

    @property
    def params(self) -> tuple[Param, ...]:
        """The parameters, read from the macro's definition in its header: the launch layer passes
        arguments by name in this order, so no call site can mistake the C signature's order."""
        return _macro_params(self.header, self.instance.split("(", 1)[0])

    def source(self) -> str:
        """The whole source, headers inlined: CuPy's compile cache keys on this text, so an edited
        header compiles afresh (an `#include` would hide the edit from the cache)."""
        return inline_headers(f'#include "{self.header}"\n{self.instance}\n')


_MACRO = re.compile(r"#define (EMBER_\w+)\([^)]*\)((?:.*\\\n)*.*)")
_SCALARS = {"int": "int", "float": "float", "long long": "i64", "i64": "i64"}


@cache
def _macro_params(header: str, macro: str) -> tuple[Param, ...]:
    for match in _MACRO.finditer((SOURCE_DIR / header).read_text()):
        if match.group(1) == macro:
            signature = re.search(r"NAME\(([^)]*)\)", match.group(2).replace("\\\n", " "))
            assert signature, f"{macro}: no NAME(...) signature"
            return tuple(_param(p) for p in signature.group(1).split(","))
    raise KeyError(f"{header} defines no macro {macro}")


def _param(text: str) -> Param:
    words = " ".join(text.split())
    name = re.split(r"[\s*]+", words)[-1]
    ctype = words[:-len(name)].replace("const ", "").strip()
    return Param(name, "ptr" if ctype.endswith("*") else _SCALARS[ctype])


_INCLUDE = re.compile(r'^#include "([\w.]+)"\s*$', re.MULTILINE)


def inline_headers(text: str, seen: set[str] | None = None) -> str:
    """text with each `#include "x.cuh"` of SOURCE_DIR replaced by the header, once (`#pragma once`)."""
    seen = set() if seen is None else seen

    def expand(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        body = (SOURCE_DIR / name).read_text().replace("#pragma once\n", "")
        return inline_headers(body, seen)

    return _INCLUDE.sub(expand, text)


def _weight(ttype: TensorType, what: str) -> str:
    if ttype not in WEIGHT_TYPES:
        raise ValueError(f"no native {what} for {ttype.name}")
    return WEIGHT_TYPES[ttype]


def gemv(ttype: TensorType, batch: int, epilogue: str = "store") -> Kernel:
    code = _weight(ttype, "GEMV")
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"native GEMV batch {batch} outside 1..{MAX_BATCH}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown GEMV epilogue {epilogue!r} (choose from {', '.join(EPILOGUES)})")
    name = f"ember_gemv_{ttype.name.lower()}_b{batch}_{epilogue}"
    return Kernel(name, "gemv.cuh", f"EMBER_GEMV({name}, {code}, {batch}, EPI_{epilogue.upper()})")


def norm_quantize(norm: bool) -> Kernel:
    name = "ember_rmsnorm_quantize_q8_1" if norm else "ember_quantize_q8_1"
    return Kernel(name, "activations.cuh", f"EMBER_NORM_QUANTIZE({name}, {'true' if norm else 'false'})")


def _lane_values(head_dim: int) -> int:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"no native attention for head_dim {head_dim} (have {', '.join(map(str, HEAD_DIMS))})")
    return head_dim // 32


def _kv(kv_dtype: str) -> str:
    if kv_dtype not in KV_TYPES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r} (choose from {', '.join(KV_TYPES)})")
    return KV_TYPES[kv_dtype]


def heads_per_block(head_dim: int, group: int) -> int:
    """Query heads per attention block: the whole GQA group where registers allow (a lane keeps
    heads * head_dim / 32 accumulators; at most 32), so each K/V row is read once per group."""
    most = max(h for h in HEADS_PER_BLOCK if h * _lane_values(head_dim) <= 32)
    return next((h for h in HEADS_PER_BLOCK if h >= group and h <= most), most)


def attention(kv_dtype: str, head_dim: int, heads: int) -> Kernel:
    p = _lane_values(head_dim)
    if heads not in HEADS_PER_BLOCK or heads * p > 32:
        raise ValueError(f"attention: {heads} heads per block of head_dim {head_dim} exceed the registers")
    name = f"ember_attention_{kv_dtype}_d{head_dim}_h{heads}"
    return Kernel(name, "attention.cuh", f"EMBER_ATTENTION({name}, {_kv(kv_dtype)}, {p}, {heads})")


def attention_combine() -> Kernel:
    return Kernel("ember_attention_combine", "attention.cuh", "EMBER_ATTENTION_COMBINE(ember_attention_combine)")


def qk_rope_kv(kv_dtype: str, head_dim: int) -> Kernel:
    name = f"ember_qk_rope_kv_{kv_dtype}_d{head_dim}"
    return Kernel(name, "qk_rope_kv.cuh", f"EMBER_QK_ROPE_KV({name}, {_kv(kv_dtype)}, {_lane_values(head_dim)})")


def dequantize_f16(ttype: TensorType) -> Kernel:
    name = f"ember_dequantize_f16_{ttype.name.lower()}"
    return Kernel(name, "dequantize.cuh", f"EMBER_DEQUANTIZE_F16({name}, {_weight(ttype, 'dequantization')})")


def sample() -> Kernel:
    return Kernel("ember_sample", "sample.cuh", "EMBER_SAMPLE(ember_sample)")


def mask() -> Kernel:
    return Kernel("ember_mask", "sample.cuh", "EMBER_MASK(ember_mask)")


def adjust() -> Kernel:
    return Kernel("ember_adjust", "sample.cuh", "EMBER_ADJUST(ember_adjust)")


def embed(ttype: TensorType) -> Kernel:
    name = f"ember_embed_{ttype.name.lower()}"
    return Kernel(name, "dequantize.cuh", f"EMBER_EMBED({name}, {_weight(ttype, 'embedding')})")


def catalog() -> list[Kernel]:
    """Every kernel the launch layer may ask for."""
    out = [gemv(t, b, e) for t in WEIGHT_TYPES for b in range(1, MAX_BATCH + 1) for e in EPILOGUES]
    out += [norm_quantize(False), norm_quantize(True), attention_combine(), mask(), adjust(), sample()]
    out += [attention(kv, d, h) for kv in KV_TYPES for d in HEAD_DIMS for h in HEADS_PER_BLOCK if h * d // 32 <= 32]
    out += [qk_rope_kv(kv, d) for kv in KV_TYPES for d in HEAD_DIMS]
    out += [dequantize_f16(t) for t in WEIGHT_TYPES] + [embed(t) for t in WEIGHT_TYPES]
    return out


def translation_unit(kernels: list[Kernel]) -> str:
    """One source defining all of `kernels` (for nvcc)."""
    headers = sorted({k.header for k in kernels})
    return "".join(f'#include "{h}"\n' for h in headers) + "".join(k.instance + "\n" for k in kernels)
