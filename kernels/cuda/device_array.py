"""DeviceArray: a numba device array with the few numpy operations model code uses on activations.

Model code (daemon/models) is written once against the ops API plus `a + b` (residuals, biases),
`reshape`, `x.shape` and row selection `x[rows]` (the logits rows). numba's device arrays have the
views but not the arithmetic, so this wrapper adds the two kernels behind them; everything else is
the ops' business. `raw` is the numba array (it speaks __cuda_array_interface__ on a GPU, so CuPy
can take it without a copy).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

from ember.kernels.cuda.device import flat_grid


class DeviceArray:
    __slots__ = ("raw",)

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.raw.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.raw.dtype)

    @property
    def ndim(self) -> int:
        return len(self.raw.shape)

    @property
    def size(self) -> int:
        return int(self.raw.size)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype})"

    def reshape(self, *shape: Any) -> DeviceArray:
        dims = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        if -1 in dims:
            known = int(np.prod([d for d in dims if d != -1]))
            dims = tuple(self.size // max(known, 1) if d == -1 else d for d in dims)
        return DeviceArray(self.raw.reshape(*dims))

    def __getitem__(self, index: Any) -> DeviceArray:
        if isinstance(index, DeviceArray):  # row selection by an index array on the device
            return gather_rows(self, index)
        if isinstance(index, np.ndarray):
            return gather_rows(self, DeviceArray(cuda.to_device(np.ascontiguousarray(index, np.int64))))
        return DeviceArray(self.raw[index])  # basic indexing: a view

    def __add__(self, other: DeviceArray) -> DeviceArray:
        return add(self, other)

    def view(self, dtype: Any) -> DeviceArray:
        return DeviceArray(self.raw.view(np.dtype(dtype)))

    def to_host(self) -> np.ndarray:
        return self.raw.copy_to_host()


def empty(shape: tuple[int, ...], dtype: Any = np.float32) -> DeviceArray:
    return DeviceArray(cuda.device_array(shape, np.dtype(dtype)))


@cuda.jit
def _fill_zero(a):  # type: ignore[no-untyped-def]
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[i] = 0


def zeros(shape: tuple[int, ...], dtype: Any = np.float32) -> DeviceArray:
    """Zeros allocated and cleared on the device (no host array of the size)."""
    out = empty(shape, dtype)
    if out.size:
        _fill_zero[flat_grid(out.size)](out.raw.reshape(out.size))
    return out


@cuda.jit
def _add(a, b, out):  # type: ignore[no-untyped-def]
    # b broadcasts over a's leading axes: b's shape is a's trailing shape (a bias) or a's own
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        out[i] = a[i] + b[i % b.size]


def add(a: DeviceArray, b: DeviceArray) -> DeviceArray:
    if not isinstance(b, DeviceArray):
        return NotImplemented
    if a.shape[a.ndim - b.ndim:] != b.shape:
        raise ValueError(f"cannot add {b.shape} to {a.shape}: only same shapes or a trailing vector broadcast")
    out = empty(a.shape, np.result_type(a.dtype, b.dtype))
    if a.size:
        _add[flat_grid(a.size)](a.raw.reshape(a.size), b.raw.reshape(b.size), out.raw.reshape(a.size))
    return out


@cuda.jit
def _gather(x, rows, out):  # type: ignore[no-untyped-def]
    width = x.shape[1]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        r, c = i // width, i % width
        out[r, c] = x[rows[r], c]


def gather_rows(x: DeviceArray, rows: DeviceArray) -> DeviceArray:
    """x[rows] for a 1-D index array: rows along the first axis, every trailing axis kept."""
    tail = x.shape[1:]
    width = int(np.prod(tail, dtype=np.int64))
    out = empty((len(rows),) + tail, x.dtype)
    if out.size:
        _gather[flat_grid(out.size)](x.raw.reshape(x.shape[0], width), rows.raw, out.raw.reshape(len(rows), width))
    return out
