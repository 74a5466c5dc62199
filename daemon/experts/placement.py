"""Which experts are hot: a greedy knapsack by routing frequency per byte under a byte budget.

Each MoE layer first gets a floor of its `floor` most-routed experts (so no layer runs entirely cold
while the budget allows), then the remaining (layer, expert) items go in by hotness per byte, the
most valuable first, while they fit. Dense layers (expert bytes 0) have no experts to place. Ties
(no statistics yet: all zero) go round the layers by expert id, so a placement is deterministic and,
without statistics, even.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np



def place(hotness: np.ndarray, expert_bytes: list[int], budget: int | None, floor: int) -> np.ndarray:
    """bool [layers, experts]: the hot experts. hotness [layers, experts] (routing counts);
    expert_bytes per layer (one expert's bytes, 0 for a dense layer); budget None: all hot."""
    n_layers, n_experts = hotness.shape
    moe = [layer for layer in range(n_layers) if expert_bytes[layer] > 0]
    hot = np.zeros((n_layers, n_experts), bool)
    if budget is None:
        hot[moe] = True
        return hot
    room = budget
    rank = {layer: _by_hotness(hotness[layer]) for layer in moe}
    for layer in moe:
        for e in rank[layer][:floor]:
            if expert_bytes[layer] <= room:
                hot[layer, e] = True
                room -= expert_bytes[layer]
    # ties (equal hotness per byte) go round the layers, each layer's next-hottest expert in turn
    items = sorted((-hotness[layer, e] / expert_bytes[layer], r, layer, e)
                   for layer in moe for r, e in enumerate(rank[layer]) if not hot[layer, e])
    for _, _, layer, e in items:
        if expert_bytes[layer] <= room:
            hot[layer, e] = True
            room -= expert_bytes[layer]
    return hot


def _by_hotness(row: np.ndarray) -> list[int]:
    return sorted(range(row.size), key=lambda e: (-row[e], e))


def planned_placement(plan, cache_dir: Path) -> tuple[np.ndarray, list[bool]] | None:  # plan: planner.Plan
    """The hot experts [layers, experts] a memory plan gives a MoE model, placed from the routing
    statistics saved for its file under ember's cache directory (none yet: by expert id), and which
    layers are MoE ones; None for a dense model. What `ember plan` shows, and the runtime's first
    placement under the same budget."""
    from ember.daemon.experts.routing_stats import RoutingStats, stats_path
    from ember.daemon.planning.planner import layer_of, weight_class

    cfg = plan.model.config
    if not cfg.n_experts:
        return None
    moe = {layer_of(t.name) for t in plan.model.tensors if weight_class(t.name) == "experts"}
    sizes = [plan.devices[0].expert_bytes if layer in moe else 0 for layer in range(cfg.n_layers)]
    stats = RoutingStats(cfg.n_layers, cfg.n_experts)
    stats.load(stats_path(Path(plan.model.path), cache_dir))
    budget = sum(d.experts_hot for d in plan.devices) if any(d.offloads_experts for d in plan.devices) else None
    return place(stats.counts, sizes, budget, cfg.n_experts_used), [bool(b) for b in sizes]
