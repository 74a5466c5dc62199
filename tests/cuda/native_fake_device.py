"""A stand-in GPU for kernels/cuda/native_launch.py on the CPU: a Launcher that runs each launch in the
host harness, over numpy arrays, after checking that its grid and block cover the work the way the
kernel expects. It records every launch (kernel, grid, block, arguments) so tests can compare the
launch sequences of two steps, which a captured graph replays."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.kernels.cuda import native_kernels as nk
from ember.kernels.cuda.native_launch import address
from ember.kernels.tensor_types import TensorType
from tests.cuda.native_harness import KV_CODES, WEIGHT_CODES

EPILOGUE_CODES = {"store": 0, "add": 1, "swiglu": 2}


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[Any, ...]  # pointers as addresses, scalars as numbers


def _c(param: nk.Param, value: Any) -> Any:
    if param.kind == "ptr":
        return None if isinstance(value, np.uint64) else ctypes.c_void_p(address(value))
    return {"int": ctypes.c_int, "i64": ctypes.c_longlong, "float": ctypes.c_float}[param.kind](value.item())


class HarnessLauncher:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.launches: list[Launch] = []

    def __call__(self, kernel: nk.Kernel, grid: tuple[int, int, int], block: tuple[int, int, int],
                 args: tuple[Any, ...]) -> None:
        assert len(args) == len(kernel.params)
        named = dict(zip((p.name for p in kernel.params), args))
        self.launches.append(Launch(kernel.name, grid, block, tuple(
            0 if isinstance(a, np.uint64) else address(a) if p.kind == "ptr" else a.item()
            for p, a in zip(kernel.params, args))))
        c_args = [_c(p, a) for p, a in zip(kernel.params, args)]
        parts = kernel.name.split("_")
        if kernel.name.startswith("ember_gemv_"):  # ember_gemv_<type>_b<B>_<epilogue>
            ttype, batch, epilogue = TensorType["_".join(parts[2:-2]).upper()], int(parts[-2][1:]), parts[-1]
            assert block == (128, 1, 1) and grid[0] * 4 >= named["N"].item(), "every row needs its warp"
            code = self.lib.harness_gemv(WEIGHT_CODES[ttype], batch, EPILOGUE_CODES[epilogue], *c_args)
        elif kernel.name in ("ember_quantize_q8_1", "ember_rmsnorm_quantize_q8_1"):
            assert block[0] % 32 == 0, "a warp per unit"
            self.lib.harness_norm_quantize(int(kernel.name.startswith("ember_rmsnorm")), grid[0], *c_args)
            code = 0
        elif kernel.name == "ember_attention_combine":
            assert block[0] >= named["head_dim"].item(), "a thread per value of a head"
            self.lib.harness_attention_combine(grid[1], *c_args)
            code = 0
        elif kernel.name.startswith("ember_attention_"):  # ember_attention_<kv>_d<D>_h<H>
            head_dim, heads = int(parts[-2][1:]), int(parts[-1][1:])
            group = named["q_heads"].item() // named["kv_heads"].item()
            assert block == (128, 1, 1) and grid[0] == named["kv_heads"].item() * -(-group // heads)
            code = self.lib.harness_attention(KV_CODES["_".join(parts[2:-2])], head_dim // 32, heads, grid[1], grid[2],
                                              *c_args)
        elif kernel.name.startswith("ember_qk_rope_kv_"):  # ember_qk_rope_kv_<kv>_d<D>
            heads = named["q_heads"].item() + 2 * named["kv_heads"].item()
            assert block == (128, 1, 1) and grid[0] * 4 >= heads, "every head needs its warp"
            code = self.lib.harness_qk_rope_kv(KV_CODES["_".join(parts[4:-1])], int(parts[-1][1:]) // 32, grid[1],
                                               *c_args)
        elif kernel.name == "ember_mask":
            self.lib.harness_mask(*c_args)
            code = 0
        elif kernel.name == "ember_adjust":
            self.lib.harness_adjust(*c_args)
            code = 0
        elif kernel.name == "ember_sample":
            assert block == (1024, 1, 1), "one block of 1024 threads per row"
            self.lib.harness_sample(grid[0], *c_args)
            code = 0
        elif kernel.name.startswith("ember_embed_"):
            code = self.lib.harness_embed(WEIGHT_CODES[TensorType["_".join(parts[2:]).upper()]], *c_args)
        elif kernel.name.startswith("ember_dequantize_f16_"):
            ttype = TensorType["_".join(parts[3:]).upper()]
            code = self.lib.harness_dequantize_f16(WEIGHT_CODES[ttype], *c_args)
        else:
            raise AssertionError(f"no harness for {kernel.name}")
        assert code == 0, f"the harness has no {kernel.name}"
