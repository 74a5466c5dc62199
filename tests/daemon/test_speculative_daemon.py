"""The daemon with a draft model (`ember serve --draft PATH --draft-tokens K`, or the per-model config
keys): streams equal in-process generation, greedy without a draft and seeded sampling with it, and
Stats report how speculation went. The same with n-gram lookup (`--draft ngram`: no draft model)."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

import ember
from daemon_process import DaemonProcess
from ember.client import Client
from ember.daemon.config import ConfigError, load_config
from ember.daemon.loader.demo_model import DEMO_DRAFT, DEMO_MODEL

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):"]


@pytest.fixture(scope="module")
def spec_daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess("[engine]\nmax_active = 3\n", args=("--draft", str(DEMO_DRAFT), "--draft-tokens", "3")).wait_ready(120)
    yield d
    d.stop()


def test_streams_equal_in_process_generation(spec_daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    spec = ember.load(DEMO_MODEL, draft=DEMO_DRAFT, draft_tokens=3)
    sampled = dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1, seed=11)
    with Client(spec_daemon.socket) as client:
        streams = [client.generate(p, max_tokens=48, ignore_eos=True) for p in PROMPTS]
        streams.append(client.generate(PROMPTS[0], max_tokens=48, ignore_eos=True, **sampled))
        got = [[t for c in s for t in c.token_ids] for s in streams]
        stats = client.stats()
    for prompt, ids in zip(PROMPTS, got):
        assert ids == list(demo_model.generate(prompt, max_tokens=48, ignore_eos=True)), prompt
    assert got[-1] == list(spec.generate(PROMPTS[0], max_tokens=48, ignore_eos=True, **sampled))
    assert stats.spec_acceptance_rate > 0.5 and stats.spec_mean_accepted_length > 1.5
    assert 1.0 <= stats.spec_mean_proposals <= 3.0  # the k chosen: at most draft_tokens, fewer where it stops early
    status = subprocess.run([sys.executable, "-m", "ember.client.cli", "status", "--socket", str(spec_daemon.socket)],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "speculative decoding:" in status.stdout
    assert f"{stats.spec_plain_tokens} tokens decoded without the draft" in status.stdout
    assert f"k {stats.spec_mean_proposals:.2f}" in status.stdout


def test_per_model_config_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    file = tmp_path / "ember.toml"
    file.write_text(f'[[models]]\npath = "{DEMO_MODEL}"\ndraft = "{DEMO_DRAFT}"\ndraft_tokens = 6\n')
    (model,) = load_config(file, env={}).models
    assert (model.draft, model.draft_tokens, model.adaptive_draft) == (str(DEMO_DRAFT), 6, True)
    file.write_text(f'[[models]]\npath = "{DEMO_MODEL}"\ndraft = "{DEMO_DRAFT}"\nadaptive_draft = false\n')
    assert not load_config(file, env={}).models[0].adaptive_draft
    file.write_text(f'[[models]]\npath = "{DEMO_MODEL}"\ndraft_tokens = 0\n')
    with pytest.raises(ConfigError, match="draft_tokens"):
        load_config(file, env={})


def test_memory_plan_counts_the_draft(spec_daemon) -> None:  # type: ignore[no-untyped-def]
    plan = next(e for e in spec_daemon.log_events() if e["event"] == "memory plan")
    assert plan["draft"] != "0 B" and plan["fits"] is True


@pytest.fixture(scope="module")
def ngram_daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess("[engine]\nmax_active = 3\n", args=("--draft", "ngram", "--draft-tokens", "6")).wait_ready(120)
    yield d
    d.stop()


def test_ngram_lookup_streams_equal_in_process_generation(ngram_daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    """The demo model's greedy text repeats itself: the daemon speculates from it, and every stream's
    tokens are those of decoding without speculation; the plan holds no draft, its logits rows the
    proposals' too."""
    with Client(ngram_daemon.socket) as client:
        streams = [client.generate(p, max_tokens=96, ignore_eos=True) for p in PROMPTS]
        got = [[t for c in s for t in c.token_ids] for s in streams]
        stats = client.stats()
    for prompt, ids in zip(PROMPTS, got):
        assert ids == list(demo_model.generate(prompt, max_tokens=96, ignore_eos=True)), prompt
    assert stats.spec_acceptance_rate > 0.5 and stats.spec_mean_accepted_length > 1.5
    plan = next(e for e in ngram_daemon.log_events() if e["event"] == "memory plan")
    assert plan["draft"] == "0 B" and plan["fits"] is True


def test_ngram_in_the_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    file = tmp_path / "ember.toml"
    file.write_text(f'[[models]]\npath = "{DEMO_MODEL}"\ndraft = "ngram"\ndraft_tokens = 7\n')
    (model,) = load_config(file, env={}).models
    assert (model.draft, model.draft_tokens) == ("ngram", 7)
