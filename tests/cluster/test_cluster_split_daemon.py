"""`ember serve --devices ray:0/cpu,ray:1/cpu`: the daemon's engine joins the Ray cluster (conftest.py)
named by RAY_ADDRESS and serves a model whose two stages are actors on its two nodes; each sampling
option gives what the unsplit model gives in process (f32 staging computes the same logits). Runs after
test_cluster_split.py's module has given the nodes' CPUs back."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from daemon_process import DaemonProcess  # noqa: E402

import ember  # noqa: E402
from ember.client import Client  # noqa: E402
from ember.daemon.loader.demo_model import DEMO_MODEL  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def ray_daemon(ray_nodes: str) -> Iterator[DaemonProcess]:
    d = DaemonProcess('[engine]\nact_dtype = "f32"\n', env={"RAY_ADDRESS": ray_nodes},
                      args=("--devices", "ray:0/cpu,ray:1/cpu", "--split", "3,2")).wait_ready(300)
    yield d
    d.stop()


@pytest.mark.parametrize("options", [
    {},
    {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.02, "seed": 11},
    {"temperature": 0.7, "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5, "seed": 15},
], ids=["greedy", "sampled", "penalties"])
def test_sampling_through_the_ray_stages_equals_unsplit(ray_daemon: DaemonProcess, options: dict) -> None:  # type: ignore[type-arg]
    model = ember.load(DEMO_MODEL)
    with Client(ray_daemon.socket) as client:
        got = [t for chunk in client.generate(PROMPT, max_tokens=24, ignore_eos=True, **options) for t in chunk.token_ids]
    assert got == list(model.generate(PROMPT, 24, ignore_eos=True, **options))
    events = [e for e in ray_daemon.log_events() if e.get("event") == "layer-split stage ready"]
    assert sorted(e["stage"] for e in events) == ["stage ray:0/cpu (layers 0-2)", "stage ray:1/cpu (layers 3-4)"]
