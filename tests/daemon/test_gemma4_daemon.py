"""Gemma 4 through a real daemon: its sliding layers keep their window in rings (steps of 16
positions), concurrent streams with greedy and sampled decoding each equal their solo in-process
generation, and a cancelled stream frees its slot (and ring) for the next request."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import ember
from concurrent_streams import streams_after_a_cancel
from daemon_process import DaemonProcess

pytestmark = pytest.mark.slow

JOBS = [(f"def f{i}(x):\n    return x *", {"max_tokens": 40, "ignore_eos": True,
                                          **({"temperature": 0.8, "top_p": 0.9, "seed": i} if i % 2 else {})})
        for i in range(6)]


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> Iterator[tuple[DaemonProcess, Path]]:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from tiny_models import build_hf_model

    path, _ = build_hf_model("gemma4", tmp_path_factory.mktemp("gemma4") / "hf")
    d = DaemonProcess("[engine]\nmax_active = 3\nmax_step_tokens = 16\nctx = 256\n",
                      args=("--model", str(path))).wait_ready(timeout=180)
    yield d, path
    d.stop()


@pytest.mark.asyncio
async def test_concurrent_streams_equal_their_solo_runs(gemma4) -> None:  # type: ignore[no-untyped-def]
    daemon, path = gemma4
    model = ember.load(path)
    solo = [list(model.generate(p, **o)) for p, o in JOBS]
    assert await streams_after_a_cancel(daemon.socket, JOBS, 200) == solo  # 6 streams on 3 running slots
