"""A MoE model whose hot experts run on cuda:0 while CPU workers compute the cold ones: the logits equal
the all-hot model's on the device (the activations cross to the workers' shared memory and back)."""
from __future__ import annotations

import numpy as np
import pytest

import ember

pytestmark = pytest.mark.cuda

PROMPT = [1, 17, 300, 45, 9]


def test_cold_experts_on_cpu_workers_beside_a_cuda_device(tmp_path, monkeypatch) -> None:
    from tiny_models import build_hf_model

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = build_hf_model("qwen3_moe", tmp_path / "moe", vocab_size=512)
    want = ember.load(path, device="cuda:0", kv_dtype="f32").logits(PROMPT)
    model = ember.load(path, device="cuda:0", expert_budget="25%", cold_workers=2, kv_dtype="f32")
    try:
        assert model.placement() == [[0, 1], [0, 1]] and model.net.experts.pool is not None
        got = model.logits(PROMPT)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        assert model.expert_stats().cold_slots > 0
    finally:
        model.close()
