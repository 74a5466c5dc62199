"""A MoE model through the daemon with a quarter of its experts hot and two cold-expert workers: its
logits equal the all-hot model's in process, and a killed worker fails one request clearly, is
restarted, and the daemon keeps serving."""
from __future__ import annotations

import os
import sys
import signal
from pathlib import Path

import numpy as np
import pytest

import ember
from ember.client import Client
from ember.daemon.step.defaults import KV_BLOCK
from ember.daemon.engine.sequence import Sequence

from daemon_process import DaemonProcess, alive, children, exited, wait_until

pytestmark = pytest.mark.slow

TRAINED_MOE = Path(__file__).parents[1] / "fixtures" / "ember-demo-moe-q8_0.gguf"
PROMPT = "import os\n\ndef main():\n"


def cold_workers(engine_pid: int) -> list[int]:
    return [p for p in children(engine_pid) if b"cold_worker" in Path(f"/proc/{p}/cmdline").read_bytes()]


def cold_expert_daemon(tmp_path_factory, path: Path, name: str, budget: str) -> DaemonProcess:
    """A daemon serving `path` with `budget` of its experts hot and two cold workers."""
    config = f"""
[[models]]
path = "{path}"
name = "{name}"
expert_budget = "{budget}"
cold_workers = 2
[server]
logits_slots = 32
[engine]
max_active = 2
ctx = 512
"""
    return DaemonProcess(config, env={"EMBER_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}).wait_ready(timeout=300)


def all_hot_step_logits(path: Path, prompt: str, n: int) -> list[np.ndarray]:
    """Each step's logits of a request alone, every expert hot, in process: what the daemon should send."""
    all_hot = ember.load(path)
    engine = all_hot.engine(8 * KV_BLOCK)  # what the daemon runs for a request alone
    engine.add(Sequence(all_hot.tokenize(prompt), n, wants_logits=True, stop_ids=frozenset()))
    expected = []
    while engine.has_work:
        expected += [o.logits for o in engine.step().outputs]
    return expected


@pytest.fixture(scope="module")
def moe_daemon(tmp_path_factory) -> DaemonProcess:
    d = cold_expert_daemon(tmp_path_factory, TRAINED_MOE, "moe", "25%")
    yield d
    d.stop()


def test_cold_experts_through_the_daemon_equal_all_hot_and_a_worker_killed_while_idle_fails_nothing(moe_daemon, tmp_path,
                                                                                    monkeypatch) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    expected = all_hot_step_logits(TRAINED_MOE, PROMPT, 12)
    with Client(moe_daemon.socket) as client:
        rows = [c.logits[0].copy() for c in client.generate(PROMPT, max_tokens=12, return_logits=True, ignore_eos=True)]
        assert len(rows) == len(expected) == 12
        for got, want in zip(rows, expected):
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        stats = client.stats()
        assert (stats.hot_experts, stats.total_experts) == (24, 96) and 0 < stats.cold_share < 1

        workers = cold_workers(moe_daemon.engine_pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)  # while the daemon is idle: the next request must not fail for it
        assert wait_until(lambda: exited(workers[0]), 10)  # dead (kill() returns before it is)
        again = client.generate(PROMPT, max_tokens=12, return_logits=True, ignore_eos=True)
        rows = [c.logits[0].copy() for c in again]
        assert again.finished.reason == "length"
        for got, want in zip(rows, expected):
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        assert client.stats().cold_worker_restarts == 1
        assert len(cold_workers(moe_daemon.engine_pid)) == 2 and workers[0] not in cold_workers(moe_daemon.engine_pid)


def test_a_killed_engines_cold_expert_workers_go_with_it(moe_daemon) -> None:  # type: ignore[no-untyped-def]
    """The engine process's children die with it; the restarted engine starts its own."""
    first = moe_daemon.engine_pid
    workers = cold_workers(first)
    assert len(workers) == 2 and all(alive(w) for w in workers)
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: not any(alive(w) for w in workers), 10.0)
    with Client(moe_daemon.socket, timeout=300) as client:
        stream = client.generate(PROMPT, max_tokens=8, ignore_eos=True)
        assert len([t for c in stream for t in c.token_ids]) == 8
        assert client.stats().total_experts == 96
    again = cold_workers(moe_daemon.engine_pid)
    assert len(again) == 2 and not set(again) & set(workers)



@pytest.fixture(scope="module")
def laguna_daemon(tmp_path_factory) -> tuple[DaemonProcess, Path]:
    """A tiny random Laguna (Hugging Face directory) served with 60% of its experts hot, two cold workers."""
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from tiny_models import build_hf_model

    path, _ = build_hf_model("laguna", tmp_path_factory.mktemp("laguna") / "hf")
    d = cold_expert_daemon(tmp_path_factory, path, "laguna", "60%")
    yield d, path
    d.stop()


def test_laguna_with_cold_experts_through_the_daemon_equals_all_hot(laguna_daemon, tmp_path, monkeypatch) -> None:
    """Laguna (sliding-window layers, a dense lead layer, sigmoid routing, a shared expert) through the
    daemon with cold workers: every step's logits, prompt and decode, are the all-hot model's."""
    daemon, path = laguna_daemon
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    expected = all_hot_step_logits(path, PROMPT * 3, 12)  # past the window of 8
    with Client(daemon.socket) as client:
        rows = [c.logits[0].copy() for c in client.generate(PROMPT * 3, max_tokens=12, return_logits=True,
                                                             ignore_eos=True)]
        assert len(rows) == len(expected) == 12
        for got, want in zip(rows, expected):
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        stats = client.stats()
        assert stats.total_experts == 32 and 0 < stats.hot_experts < 32 and 0 < stats.cold_share < 1
    assert len(cold_workers(daemon.engine_pid)) == 2
