"""The daemon with a feature-conditioned (DFlash) draft: `ember serve --draft D.gguf` recognises it by
its architecture, greedy streams equal decoding without a draft, Stats count the verification steps,
the memory plan counts its feature mirror in the dtype EMBER_FEATURE_DTYPE chose, and the per-model
`feature_dtype` key is read and checked."""
from __future__ import annotations

import pytest

from daemon_process import DaemonProcess
from dflash_files import write_dflash
from ember.client import Client
from ember.daemon.config import ConfigError, load_config
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.planning.planner import fmt_bytes
from ember.kernels.convert import storage_bytes

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n"]


def test_serve_with_a_dflash_draft(tmp_path, demo_model) -> None:  # type: ignore[no-untyped-def]
    draft = write_dflash(tmp_path / "dflash.gguf", DEMO_MODEL, target_layers=(1, 3), block_size=6)
    d = DaemonProcess("[engine]\nmax_active = 2\nctx = 1024\n", env={"EMBER_FEATURE_DTYPE": "q8_0"},
                      args=("--draft", str(draft), "--draft-tokens", "8")).wait_ready(240)
    try:
        with Client(d.socket) as client:
            streams = [client.generate(p, max_tokens=32, ignore_eos=True) for p in PROMPTS]
            got = [[t for c in s for t in c.token_ids] for s in streams]
            stats = client.stats()
        plans = [e for e in d.log_events() if e.get("event") == "memory plan"]
    finally:
        d.stop()
    for prompt, ids in zip(PROMPTS, got):
        assert ids == list(demo_model.generate(prompt, max_tokens=32, ignore_eos=True)), prompt
    assert stats.spec_mean_accepted_length >= 1.0  # verification ran (random weights: few accepted)
    assert plans and plans[0]["feature_mirror"] == fmt_bytes(2 * 1024 * storage_bytes("q8_0", 2 * 384))


def test_feature_dtype_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    file = tmp_path / "ember.toml"
    file.write_text(f'[[models]]\npath = "{DEMO_MODEL}"\nfeature_dtype = "bf16"\n')
    (model,) = load_config(file, env={}).models
    assert model.feature_dtype == "bf16"
    file.write_text(f'[[models]]\npath = "{DEMO_MODEL}"\nfeature_dtype = "f8"\n')
    with pytest.raises(ConfigError, match="feature_dtype must be one of f32, f16, bf16, q8_0"):
        load_config(file, env={})
