"""Which experts are hot: a greedy knapsack by routing frequency per byte under a byte budget.

Each MoE layer first gets a floor of its `floor` most-routed experts (so no layer runs entirely cold
while the budget allows), then the remaining (layer, expert) items go in by hotness per byte, the
most valuable first, while they fit. Dense layers (expert bytes 0) have no experts to place. Ties
(no statistics yet: all zero) go to the lower layer and expert id, so a placement is deterministic.
"""
from __future__ import annotations

import numpy as np

from ember.daemon.planning.planner import parse_size


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
    for layer in moe:
        for e in _by_hotness(hotness[layer])[:floor]:
            if expert_bytes[layer] <= room:
                hot[layer, e] = True
                room -= expert_bytes[layer]
    items = sorted(((-hotness[layer, e] / expert_bytes[layer], layer, e) for layer in moe for e in range(n_experts)
                    if not hot[layer, e]))
    for _, layer, e in items:
        if expert_bytes[layer] <= room:
            hot[layer, e] = True
            room -= expert_bytes[layer]
    return hot


def _by_hotness(row: np.ndarray) -> list[int]:
    return sorted(range(row.size), key=lambda e: (-row[e], e))


def parse_budget(spec: int | str | None, total: int) -> int | None:
    """expert_budget as bytes: None (every expert hot), a byte count, a size ("512M"), or "N%" of
    `total` (every expert's bytes)."""
    if spec is None:
        return None
    if isinstance(spec, str):
        text = spec.strip()
        if text.endswith("%"):
            try:
                share = float(text[:-1])
            except ValueError:
                raise ValueError(f"expert_budget {spec!r} is not a percentage") from None
            if not 0 <= share <= 100:
                raise ValueError(f"expert_budget {spec!r} must be between 0% and 100%")
            return int(total * share / 100)
        spec = parse_size(text)
    if isinstance(spec, bool) or not isinstance(spec, (int, np.integer)) or spec < 0:
        raise ValueError(f"expert_budget must be None, bytes >= 0, a size or 'N%', got {spec!r}")
    return int(spec)
