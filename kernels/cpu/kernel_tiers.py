"""Which of the CPU kernels this process runs: all of them, or the first tier only.

A first start compiles the kernels in two tiers (daemon/runner/kernel_cache.py): the first is every
op run op by op, each twin in its serial variant, about a quarter of the compile; the second adds the
twins' parallel variants, the fused decoder layers and the greedy decode bursts, and compiles in the
background while the daemon already serves with the first. Until it is in the cache, a process runs
the first tier's kernels alone, so it never compiles one itself (a kernel compiled in-process runs
other code than the cached one: kernel_cache.py's docstring).

The tiers compute the same bits: a twin's variants are bit for bit the same (twin.py), and so are the
fused layers and the greedy bursts and the op-by-op path (decoder_layer.py, greedy_decode.py). Moving
from one to the other, between steps or within one, changes a step's speed and never its tokens.
"""
from __future__ import annotations

_first_tier_only = False


def first_tier_only() -> bool:
    """This process runs the first tier's kernels alone (serial variants, op by op)."""
    return _first_tier_only


def use_first_tier() -> None:
    global _first_tier_only
    _first_tier_only = True


def use_all() -> None:
    global _first_tier_only
    _first_tier_only = False
