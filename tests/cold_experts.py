"""Cold experts against all hot, for the MoE architectures' tests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

import ember


def cold_equals_all_hot(path: Path, budget: str) -> tuple[list[int], Any]:
    """`budget` of each sparse layer's experts hot and the rest computed by two cold workers: the logits
    of a 40-token prompt and 24 decoded tokens are the all-hot model's, and the lossy `mask` policy runs
    and differs -> each layer's hot expert count and the expert statistics, for the caller's checks."""
    ids = np.random.default_rng(7).integers(1, 8192, 40).tolist()
    all_hot = ember.load(path)
    expected = all_hot.logits(ids)
    tokens = list(all_hot.generate(ids[:5], max_tokens=24, ignore_eos=True))
    model = ember.load(path, expert_budget=budget, cold_workers=2)
    try:
        assert np.abs(model.logits(ids) - expected).max() <= 1e-5 * np.abs(expected).max()
        assert list(model.generate(ids[:5], max_tokens=24, ignore_eos=True)) == tokens
        hot, stats = [len(h) for h in model.placement()], model.expert_stats()
    finally:
        model.close()
    masked = ember.load(path, expert_budget=budget, cold_policy="mask").logits(ids)
    assert np.isfinite(masked).all() and np.abs(masked - expected).max() > 1e-3 * np.abs(expected).max()
    return hot, stats
