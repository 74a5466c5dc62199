"""Compile every kernels/cuda kernel to PTX for sm_90 with numba.cuda's real target, without a GPU (NVVM and
NVRTC are enough): the check the simulator cannot make, that numba types and lowers each kernel for a
device. Run by test_ptx_compile.py in a process of its own (NUMBA_ENABLE_CUDASIM=0); exits 1 on a failure."""
from __future__ import annotations

import sys

import numba
import numba.cuda.dispatcher as _dispatcher
import numpy as np
from numba import cuda, typeof


class _Sm90:  # a device function compiles for the current device's capability: there is none here
    compute_capability = (9, 0)


_dispatcher.get_current_device = lambda: _Sm90()

from ember.kernels.cuda import dense, device_array, experts, quant_matmul as qm, sampling  # noqa: E402
from ember.kernels.cuda import paged_attention as pa  # noqa: E402

def a(dtype, ndim):  # type: ignore[no-untyped-def]
    """The numba type of a C-contiguous array of `ndim` dimensions (what the wrappers pass)."""
    return typeof(np.zeros((1,) * ndim, dtype))

f32, f64, i64, i32, u8, i8, u16, u32, b1 = (np.float32, np.float64, np.int64, np.int32, np.uint8, np.int8, np.uint16,
                                           np.uint32, np.bool_)
# signatures as the wrappers launch them (StepBatch: tables and token_seq int32, the rest int64)
I = numba.int64
F = numba.float32
B = numba.boolean
KV = (a(f32, 4), a(u16, 4), a(i8, 4), a(u16, 4))
CASES = {
    "device_array._fill_zero": (device_array._fill_zero, (a(f32, 1),)),
    "device_array._copy1": (device_array._copy1, (typeof(np.zeros(4, f32)[::2]), a(f32, 1))),
    "device_array._copy2": (device_array._copy2, (typeof(np.zeros((4, 4), f32)[:, ::2]), a(f32, 2))),
    "device_array._copy3": (device_array._copy3, (typeof(np.zeros((2, 2, 2), f32)[:, :, ::2]), a(f32, 3))),
    "device_array._copy4": (device_array._copy4, (typeof(np.zeros((2, 2, 2, 2), f32)[:, :, :, ::2]), a(f32, 4))),
    "device_array._binary": (device_array._binary, (a(f32, 1), a(f32, 1), I, *(I,) * 12, a(f32, 1))),
    "device_array._gather": (device_array._gather, (a(f32, 2), a(i64, 1), a(f32, 2))),
    "device_array._gather(bool)": (device_array._gather, (a(b1, 2), a(i64, 1), a(b1, 2))),
    "qm._matmul": (qm._matmul, (a(f32, 2), I, a(u8, 2), a(i8, 2), a(u16, 2), a(f32, 2), I, I, I, a(f32, 1), a(f32, 1),
                                a(f32, 2))),
    "qm._embedding": (qm._embedding, (a(i64, 1), I, a(u8, 2), a(i8, 2), a(u16, 2), a(f32, 2), I, I, I, a(f32, 1),
                                      a(f32, 1), a(f32, 2))),
    "dense._rmsnorm": (dense._rmsnorm, (a(f32, 2), a(f32, 1), F, a(f32, 2))),
    "dense._rope": (dense._rope, (a(f32, 3), a(i64, 1), a(f32, 1), B)),
    "dense._swiglu": (dense._swiglu, (a(f32, 1), a(f32, 1), a(f32, 1))),
    "dense._sigmoid_mul": (dense._sigmoid_mul, (a(f32, 1), a(f32, 1), a(f32, 1))),
    "dense._softmax": (dense._softmax, (a(f32, 2), a(f32, 2))),
    "dense._argmax_rows": (dense._argmax_rows, (a(f32, 2), a(i64, 1), a(i64, 1))),
    "pa._kv_write": (pa._kv_write, (a(f32, 3), a(u32, 3), a(i64, 1), a(i64, 1), I, *KV)),
    "pa._attention": (pa._attention, (a(f32, 3), *KV, *KV, I, a(f32, 1), a(f32, 1), a(i32, 2), a(i32, 1), a(i64, 1),
                                      F, a(f32, 3))),
    "experts._scatter_add": (experts._scatter_add, (a(f32, 2), a(f32, 2), a(i64, 1), a(f32, 1))),
    "sampling._adjust": (sampling._adjust, (a(f32, 2), a(i64, 1), a(i64, 1), a(f32, 1), a(b1, 1), a(f32, 1), a(f64, 1))),
    "sampling._sample": (sampling._sample, (a(f32, 2), a(b1, 1), a(f64, 1), a(i64, 1), a(f64, 1), a(f64, 1), a(f64, 1),
                                            a(f64, 2), a(f64, 2), a(i64, 2), a(i64, 1), a(f32, 1), a(f32, 1), a(f64, 1))),
    "sampling._top_n": (sampling._top_n, (a(f32, 2), I, a(i64, 2), a(f32, 2))),
}
failed = 0
for name, (kernel, sig) in CASES.items():
    try:
        cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
        print("ok  ", name)
    except Exception as e:  # noqa: BLE001 - every failure is reported, with its kernel
        failed += 1
        print("FAIL", name, type(e).__name__, " ".join(str(e).split())[:2000])
sys.exit(1 if failed else 0)
