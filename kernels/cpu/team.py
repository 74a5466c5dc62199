"""A thread team in one parallel region: work in phases, each phase's items claimed by whoever is free.

A decode step of a small model is many small kernels, and each parallel kernel is a parallel region
of its own: waking numba's OpenMP threads and joining them cost ~1.5-4 us a region on the 2-core VM,
about the time a 640 x 384 Q8_0 matvec takes on one thread. llama.cpp instead keeps its threads in
one graph and separates the ops by spin barriers. A team does the same inside one `prange` region:
every member runs the same program of phases; a phase is a count of items (row groups of a matmul,
tokens to normalize, attention tasks) that members claim one at a time with atomic counters (each
its own contiguous share first, then what is left of the others'), and a member that runs out of
items waits until every claimed item of the phase is finished before it starts the next phase.

Members wait for claimed work only, never for each other to arrive: a member that starts late (or
never, where the threading layer runs two prange chunks one after the other on one thread) finds the
items claimed and done, so the team cannot deadlock, whatever the threading layer and the number of
threads. Which member computes an item never changes its result: items are computed by the same
compiled code either way.
"""
from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["claim", "counters_for", "fail", "failed", "finish", "join", "wait"]

# The spin-wait hint (x86's pause, as an LLVM intrinsic: numba's JIT takes no inline assembly): it
# keeps a waiting member from starving a sibling hardware thread and from the memory-order flush on
# leaving the loop. Other machines spin without one.
_PAUSE = platform.machine() in ("x86_64", "AMD64")
# Each counter on a cache line of its own: members claiming items do not evict the line another
# member is polling.
_STRIDE = 8
# Pauses a waiting member spins (~0.1-0.3 ms) before it yields its core at every check instead: a
# phase's last items take microseconds, unless their owner was preempted (more threads than free
# cores), and then spinning would only keep the owner off the core for a whole scheduler tick.
_SPINS = 1 << 12


def _counter_pointer(context, builder, array_type, array, index_type, index):  # type: ignore[no-untyped-def]
    ary = context.make_array(array_type)(context, builder, array)
    i = context.cast(builder, index, index_type, types.intp)
    return cgutils.get_item_pointer(context, builder, array_type, ary, [i], wraparound=False)


def _int64_vector(counters) -> bool:  # type: ignore[no-untyped-def]
    return isinstance(counters, types.Array) and counters.dtype == types.int64 and counters.ndim == 1


@intrinsic
def _fetch_add(typingctx, counters, index):  # type: ignore[no-untyped-def]
    """counters[index] += 1 atomically (sequentially consistent) -> the value before."""
    if not _int64_vector(counters) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _counter_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        return builder.atomic_rmw("add", ptr, ir.Constant(ir.IntType(64), 1), "seq_cst")

    return types.int64(counters, index), codegen


@intrinsic
def _load_acquire(typingctx, counters, index):  # type: ignore[no-untyped-def]
    """counters[index], read with acquire order: what its writer wrote before its release is seen."""
    if not _int64_vector(counters) or not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _counter_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(counters, index), codegen


@intrinsic
def _pause(typingctx):  # type: ignore[no-untyped-def]
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        if _PAUSE:
            builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                        "llvm.x86.sse2.pause"), [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _yield_cpu(typingctx):  # type: ignore[no-untyped-def]
    """sched_yield(): the JIT links the symbol by name, in every process that loads the cached code."""
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield"),
                     [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(cache=True, nogil=True)
def counters_for(phases, members):  # type: ignore[no-untyped-def]
    """The zeroed counters of one run of a team program of `phases` phases for `members` members:
    the member count, arrivals and the failed flag, then per phase a claim counter for each
    member's share of the items and the count of items done."""
    counters = np.zeros((3 + phases * (members + 1)) * _STRIDE, np.int64)
    counters[0] = members
    return counters


@njit(inline="always", cache=True, nogil=True)
def join(counters):  # type: ignore[no-untyped-def]
    """This member's index: which share of each phase's items it claims first."""
    return _fetch_add(counters, _STRIDE) % counters[0]


@njit(inline="always", cache=True, nogil=True)
def claim(counters, phase, me, items):  # type: ignore[no-untyped-def]
    """The next unclaimed item of `phase` (of `items`), or `items` when none is left. Each member
    claims its own contiguous share first (the rows it streams stay in one run, which the hardware
    prefetcher follows: claimed round-robin, a DRAM-bound Q4_K layer ran 9% slower), then the
    unclaimed items of the others' shares."""
    members = counters[0]
    for k in range(members):
        share = me + k if me + k < members else me + k - members
        first, end = share * items // members, (share + 1) * items // members
        slot = (3 + phase * (members + 1) + share) * _STRIDE
        if first + _load_acquire(counters, slot) < end:  # (a look first: a spent share takes no add)
            item = first + _fetch_add(counters, slot)
            if item < end:
                return item
    return items


@njit(inline="always", cache=True, nogil=True)
def finish(counters, phase):  # type: ignore[no-untyped-def]
    """Mark one claimed item of `phase` done (after its results are written: the add releases them)."""
    _fetch_add(counters, _done(counters, phase))


@njit(inline="always", cache=True, nogil=True)
def _done(counters, phase):  # type: ignore[no-untyped-def]
    return (3 + phase * (counters[0] + 1) + counters[0]) * _STRIDE


@njit(inline="always", cache=True, nogil=True)
def wait(counters, phase, items):  # type: ignore[no-untyped-def]
    """Wait until all `items` items of `phase` are done, their results visible to this member ->
    True; False as soon as a member failed (its claimed items will never be done): stop then."""
    spins = 0
    while _load_acquire(counters, _done(counters, phase)) < items:
        if failed(counters):
            return False
        if spins < _SPINS:
            _pause()
            spins += 1
        else:  # the item's owner is not running (more threads than cores are free): let it run
            _yield_cpu()
    return True


@njit(inline="always", cache=True, nogil=True)
def fail(counters):  # type: ignore[no-untyped-def]
    """Mark the team failed: a member whose work raised calls it instead of raising (numba passes
    no exception out of a parallel loop's threads reliably), so that the others stop waiting for its
    items, and the program raises once the loop is over (`failed`)."""
    _fetch_add(counters, 2 * _STRIDE)


@njit(inline="always", cache=True, nogil=True)
def failed(counters):  # type: ignore[no-untyped-def]
    return _load_acquire(counters, 2 * _STRIDE) != 0

