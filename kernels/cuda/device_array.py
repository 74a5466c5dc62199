"""DeviceArray: a numba device array with the few numpy operations model code uses on activations.

Model code (daemon/models) is written once against the ops API plus plain array arithmetic: `a + b`
and `a * b` with numpy's broadcasting (residuals, biases, scalars), `reshape`, `x.shape`, basic slicing (views), row selection `x[rows]`
(the logits rows) and whole-array assignment `a[...] = b`. numba's device arrays have the views but
not the arithmetic, and refuse to reshape a strided view; this wrapper adds the kernels behind those,
copying a strided view into contiguous memory where a reshape needs it (numpy's rule). `raw` is the
numba array (it speaks __cuda_array_interface__ on a GPU, so CuPy can take it without a copy).
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

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype})"

    def contiguous(self) -> DeviceArray:
        """This array in C order: itself, or a copy of a strided view."""
        if self.raw.is_c_contiguous():
            return self
        if not 1 <= self.ndim <= 4:
            raise ValueError(f"cannot copy a strided view of {self.ndim} dimensions (1 to 4)")
        out = empty(self.shape, self.dtype)
        if self.size:
            _COPY[self.ndim][flat_grid(self.size)](self.raw, out.raw)
        return out

    def reshape(self, *shape: Any) -> DeviceArray:
        dims = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        if -1 in dims:
            known = int(np.prod([d for d in dims if d != -1]))
            dims = tuple(self.size // max(known, 1) if d == -1 else d for d in dims)
        return DeviceArray(self.contiguous().raw.reshape(*dims))

    def flat(self) -> Any:
        """The raw 1-D array over every element (contiguous), for elementwise kernels."""
        return self.reshape(self.size).raw

    def __getitem__(self, index: Any) -> DeviceArray:
        if isinstance(index, DeviceArray):  # row selection by an index array on the device
            return gather_rows(self, index)
        if isinstance(index, np.ndarray):
            return gather_rows(self, DeviceArray(cuda.to_device(np.ascontiguousarray(index, np.int64))))
        return DeviceArray(self.raw[index])  # basic indexing: a view

    def __setitem__(self, index: Any, value: DeviceArray) -> None:
        if index is not Ellipsis or not isinstance(value, DeviceArray) or value.shape != self.shape:
            raise TypeError("a DeviceArray takes whole-array assignment only: a[...] = b, b of a's shape")
        if not self.raw.is_c_contiguous():
            raise TypeError("cannot assign into a strided view of device memory")
        self.raw.copy_to_device(value.contiguous().raw)

    def __add__(self, other: Any) -> DeviceArray:
        return self._binary(other, _ADD)

    def __mul__(self, other: Any) -> DeviceArray:
        return self._binary(other, _MUL)

    __radd__ = __add__
    __rmul__ = __mul__

    def _binary(self, other: Any, op: int) -> DeviceArray:
        if isinstance(other, DeviceArray):
            return binary(self, other, op)
        if isinstance(other, int | float):
            return binary(self, float(other), op)
        return NotImplemented

    def copy(self) -> DeviceArray:
        """A contiguous copy on the device (a kept logits row outlives the step's buffer)."""
        out = empty(self.shape, self.dtype)
        out[...] = self
        return out

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self.raw.__cuda_array_interface__  # strides included: CuPy takes it in place (a device logits ring)

    def view(self, dtype: Any) -> DeviceArray:
        return DeviceArray(self.contiguous().raw.view(np.dtype(dtype)))

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
        _fill_zero[flat_grid(out.size)](out.flat())
    return out


# strided -> contiguous copies, one kernel per rank (numba has no rank-generic indexing)
@cuda.jit
def _copy1(a, out):  # type: ignore[no-untyped-def]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = a[i]


@cuda.jit
def _copy2(a, out):  # type: ignore[no-untyped-def]
    n1 = out.shape[1]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i // n1, i % n1] = a[i // n1, i % n1]


@cuda.jit
def _copy3(a, out):  # type: ignore[no-untyped-def]
    n1, n2 = out.shape[1], out.shape[2]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        x, y, z = i // (n1 * n2), (i // n2) % n1, i % n2
        out[x, y, z] = a[x, y, z]


@cuda.jit
def _copy4(a, out):  # type: ignore[no-untyped-def]
    n1, n2, n3 = out.shape[1], out.shape[2], out.shape[3]
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        w, x, y, z = i // (n1 * n2 * n3), (i // (n2 * n3)) % n1, (i // n3) % n2, i % n3
        out[w, x, y, z] = a[w, x, y, z]


_COPY = {1: _copy1, 2: _copy2, 3: _copy3, 4: _copy4}


@cuda.jit
def _binary(a, b, op, n0, n1, n2, n3, a0, a1, a2, a3, b0, b1, b2, b3, out):  # type: ignore[no-untyped-def]
    # out [n0, n1, n2, n3] (C order) = a op b, each operand read through its element strides (0 on a
    # broadcast axis)
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        i0, i1, i2, i3 = i // (n1 * n2 * n3), (i // (n2 * n3)) % n1, (i // n3) % n2, i % n3
        x = a[i0 * a0 + i1 * a1 + i2 * a2 + i3 * a3]
        y = b[i0 * b0 + i1 * b1 + i2 * b2 + i3 * b3]
        out[i] = x + y if op == _ADD else x * y


_ADD, _MUL = 0, 1
_RANK = 4  # operands of up to 4 dimensions: the widest model code has is [n, heads, 2, head_dim]


def _strides(shape: tuple[int, ...], out: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of `shape` read as `out` (both padded to _RANK dims)."""
    padded = (1,) * (_RANK - len(shape)) + shape
    step, strides = 1, []
    for n, want in zip(reversed(padded), reversed(out), strict=True):
        strides.append(0 if n == 1 and want != 1 else step)
        step *= n
    return tuple(reversed(strides))


def binary(a: DeviceArray, b: DeviceArray | float, op: int) -> DeviceArray:
    """a + b or a * b with numpy's broadcasting; a Python scalar b keeps a's dtype (numpy's rule)."""
    other = b if isinstance(b, DeviceArray) else DeviceArray(cuda.to_device(np.full(1, b, a.dtype)))
    try:
        shape = np.broadcast_shapes(a.shape, () if not isinstance(b, DeviceArray) else b.shape)
    except ValueError:
        raise ValueError(f"cannot broadcast {other.shape} with {a.shape}") from None
    if len(shape) > _RANK:
        raise ValueError(f"elementwise operands of {len(shape)} dimensions: at most {_RANK}")
    out = empty(shape, np.result_type(a.dtype, other.dtype))
    if out.size:
        full = (1,) * (_RANK - len(shape)) + tuple(shape)
        b_shape = other.shape if isinstance(b, DeviceArray) else ()
        _binary[flat_grid(out.size)](a.flat(), other.flat(), op, *full, *_strides(a.shape, full),
                                     *_strides(b_shape, full), out.flat())
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
        _gather[flat_grid(out.size)](x.reshape(x.shape[0], width).raw, rows.raw, out.reshape(len(rows), width).raw)
    return out
