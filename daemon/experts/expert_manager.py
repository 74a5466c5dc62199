"""ExpertManager: a MoE model's experts at run time — which are hot, who computes the cold ones, the
routing statistics that decide it, and the swaps that follow them.

Hot experts are held by each layer's MoEFFN on the engine's device; cold ones are computed exactly by
the ColdPool's worker processes (cold_policy "exact", the default) or dropped (weight 0: "mask",
opt-in and lossy). Placement (placement.py) runs at load from the saved statistics and again at
request boundaries (`between_requests`), never inside a step; one swap moves at most `swap_bytes`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ember.daemon.experts.cold_pool import ColdPool, Pending
from ember.daemon.experts.placement import place
from ember.daemon.planning.planner import parse_expert_budget
from ember.daemon.experts.routing_stats import RoutingStats, stats_path
from ember.kernels.ops import Array, Ops

if TYPE_CHECKING:
    from ember.daemon.experts.moe_ffn import MoEFFN

log = logging.getLogger("ember.experts")

COLD_POLICIES = ("exact", "mask")
SAVE_EVERY_S = 30.0  # routing statistics reach the disk at a request boundary at most this often
SWAP_MARGIN = 1.25  # a cold expert replaces a hot one only if routed this much more often per byte


@dataclass(frozen=True)
class ExpertOptions:
    budget: int | str | None = None  # hot experts' bytes: None (all), bytes, a size, or "N%" of all experts
    cold_workers: int | None = None  # None: 2 when some experts are cold under the exact policy
    cold_policy: str = "exact"
    swap_bytes: int | None = None  # bytes one swap may move; None: an eighth of the budget (one expert at least)
    # where the routing statistics persist: this file, else under this cache directory (routing_stats.stats_path,
    # the top's cache_root); neither: in memory only, for this run
    stats_file: Path | None = None
    cache_dir: Path | None = None
    device_room: int | None = None  # the most hot-expert bytes the device has room for (the memory plan's)

    def __post_init__(self) -> None:
        if self.cold_policy not in COLD_POLICIES:
            raise ValueError(f"cold_policy must be one of {', '.join(COLD_POLICIES)}, got {self.cold_policy!r}")
        if self.cold_workers is not None and (isinstance(self.cold_workers, bool) or self.cold_workers < 0):
            raise ValueError(f"cold_workers must be >= 0, got {self.cold_workers!r}")


@dataclass(frozen=True)
class ExpertStats:
    hot_experts: int
    total_experts: int
    routed_slots: int  # (token, expert) pairs routed
    cold_slots: int  # of those, computed cold (or dropped, under "mask")
    swaps: int  # experts promoted by swaps
    swapped_bytes: int
    worker_restarts: int
    cold_busy_s: float = 0.0  # seconds the cold workers computed (the slowest worker of each layer's step)
    cold_wait_s: float = 0.0  # seconds the engine waited for them after its hot experts were done

    @property
    def cold_share(self) -> float:
        return self.cold_slots / self.routed_slots if self.routed_slots else 0.0

    @property
    def overlap(self) -> float:
        """The share of the cold work done while the engine computed the hot experts."""
        return max(0.0, 1 - self.cold_wait_s / self.cold_busy_s) if self.cold_busy_s else 0.0


class ExpertManager:
    def __init__(self, model: Path, hidden: int, n_used: int, expert_bytes: list[int], n_experts: int,
                 options: ExpertOptions, prompt_act: str) -> None:
        """prompt_act: the model's prompt activations, which its cold workers compute with too."""
        self.model, self.options = Path(model), options
        self.expert_bytes = expert_bytes
        self.floor = n_used
        total = sum(expert_bytes) * n_experts
        budget = parse_expert_budget(options.budget, total)
        if budget is not None and options.device_room is not None:
            budget = min(budget, options.device_room)
        self.budget = None if budget is None or budget >= total else budget
        self.stats = RoutingStats(len(expert_bytes), n_experts)
        self.stats_file = options.stats_file or (stats_path(self.model, options.cache_dir) if options.cache_dir else None)
        if self.stats_file is not None and self.stats.load(self.stats_file):
            log.info("routing statistics from %s", self.stats_file)
        self.hot = place(self.stats.counts, expert_bytes, self.budget, self.floor)
        self.ffns: dict[int, MoEFFN] = {}
        self.cold = self.swaps = self.swapped_bytes = 0
        self.routed_slots = np.zeros(1, np.int64)  # (token, expert) pairs routed; compiled code adds to it too
        self.cold_busy = self.cold_wait = 0.0
        self._saved_at = time.monotonic()
        self.pool: ColdPool | None = None
        some_cold = not self.hot[[i for i, b in enumerate(expert_bytes) if b]].all()
        workers = options.cold_workers if options.cold_workers is not None else (2 if some_cold else 0)
        if some_cold and options.cold_policy == "exact":
            if workers == 0:
                raise ValueError("expert_budget leaves experts cold: cold_policy 'exact' needs cold_workers >= 1 "
                                 "(or cold_policy 'mask', which drops them)")
            self.pool = ColdPool(self.model, workers, hidden, prompt_act=prompt_act)
        elif workers and options.cold_policy == "exact":
            self.pool = ColdPool(self.model, workers, hidden, prompt_act=prompt_act)  # every expert hot for now; swaps may change that

    # --- during a step --------------------------------------------------------------------------
    def hot_experts(self, layer: int) -> list[int]:
        return np.flatnonzero(self.hot[layer]).tolist()

    def record(self, layer: int, expert: np.ndarray, n_tokens: int) -> None:
        self.stats.record(layer, expert, n_tokens)
        self.routed_slots[0] += expert.size

    def compute_cold(self, ops: Ops, layer: int, x: Array, rows: Array | None, token: np.ndarray,
                     expert: np.ndarray, weight: np.ndarray) -> _ColdResult | None:
        """Start the cold pairs of a layer's step; None under "mask" (they are dropped)."""
        self.cold += expert.size
        if self.options.cold_policy == "mask":
            return None
        if self.pool is None:
            raise RuntimeError("cold experts but no cold workers")  # prevented at construction
        host = ops.to_numpy(x)
        decode = np.zeros(len(token), bool) if rows is None else np.asarray(ops.to_numpy(rows), bool)[token]
        pending = self.pool.submit(layer, host[token], token, expert, weight, decode, host.shape[0])
        return _ColdResult(pending, ops, self)

    # --- between requests -----------------------------------------------------------------------
    def register(self, ffn: MoEFFN) -> None:
        self.ffns[ffn.layer] = ffn

    def between_requests(self, ops: Ops) -> None:
        """Follow the routing: swap experts toward the placement the statistics now give (at most
        swap_bytes), and save the statistics now and then. Never called inside a step."""
        if self.budget is not None:
            self._swap(ops)
        if time.monotonic() - self._saved_at > SAVE_EVERY_S:
            self.save_stats()

    def revive_workers(self) -> None:
        """Restart the cold workers that died since the last step (ColdPool.revive)."""
        if self.pool is not None:
            self.pool.revive()

    def _swap(self, ops: Ops) -> None:
        target = place(self.stats.counts, self.expert_bytes, self.budget, self.floor)
        limit = self.options.swap_bytes or max(self.budget // 8, max(self.expert_bytes))
        value = self.stats.counts / np.maximum(np.asarray(self.expert_bytes, np.float64), 1)[:, None]
        ins = sorted(zip(*np.nonzero(target & ~self.hot)), key=lambda le: -value[le])
        outs = sorted(zip(*np.nonzero(self.hot & ~target)), key=lambda le: value[le])
        room = self.budget - self.hot_bytes()
        moved = 0
        promoted: list[tuple[int, int]] = []
        for layer, e in ins:
            size = self.expert_bytes[layer]
            if moved + size > limit:
                break
            # the least valuable hot experts that make room, if each is clearly less valuable
            freed, victims = room, 0
            while freed < size and victims < len(outs) and value[layer, e] > SWAP_MARGIN * value[outs[victims]]:
                freed += self.expert_bytes[outs[victims][0]]
                victims += 1
            if freed < size:
                break
            for out_layer, out_e in outs[:victims]:
                self.hot[out_layer, out_e] = False
                self.ffns[out_layer].demote(ops, [int(out_e)])
            outs = outs[victims:]
            self.hot[layer, e] = True
            self.ffns[layer].promote(ops, [int(e)])
            room = freed - size
            moved += size
            promoted.append((int(layer), int(e)))
        if promoted:
            self.swaps += len(promoted)
            self.swapped_bytes += moved
            log.info("expert swap: promoted %s (%d bytes)", promoted, moved)

    def hot_bytes(self) -> int:
        return int(sum(self.hot[layer].sum() * b for layer, b in enumerate(self.expert_bytes)))

    # --- reporting ------------------------------------------------------------------------------
    def placement(self) -> list[list[int]]:
        return [self.hot_experts(layer) if b else [] for layer, b in enumerate(self.expert_bytes)]

    def snapshot(self) -> ExpertStats:
        moe = [i for i, b in enumerate(self.expert_bytes) if b]
        return ExpertStats(int(self.hot[moe].sum()), len(moe) * self.hot.shape[1], int(self.routed_slots[0]), self.cold,
                           self.swaps, self.swapped_bytes, self.pool.restarts if self.pool else 0,
                           self.cold_busy, self.cold_wait)

    def save_stats(self) -> None:
        if self.stats_file is None:
            return
        try:
            self.stats.save(self.stats_file)
        except OSError as e:
            log.warning("could not save routing statistics to %s: %s", self.stats_file, e)
        self._saved_at = time.monotonic()

    def close(self) -> None:
        self.save_stats()
        if self.pool is not None:
            self.pool.close()


class _ColdResult:
    def __init__(self, pending: Pending, ops: Ops, manager: ExpertManager) -> None:
        self.pending, self.ops, self.manager = pending, ops, manager

    def wait(self) -> Array:
        out = self.pending.wait()
        self.manager.cold_busy += self.pending.busy
        self.manager.cold_wait += self.pending.waited
        return self.ops.to_device(out)
