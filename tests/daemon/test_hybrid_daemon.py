"""A hybrid model (qwen35: recurrent state per sequence) through a real daemon: concurrent streams,
batched together, each equal to its solo in-process generation; a cancelled stream frees its state
slot for the next request."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import ember
from concurrent_streams import streams_after_a_cancel
from daemon_process import DaemonProcess

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parents[1] / "fixtures" / "qwen35-tiny-q8_0.gguf"
JOBS = [(f"def f{i}(x):\n    return x *", {"max_tokens": 20, "ignore_eos": True, **({"temperature": 0.8, "seed": i} if i % 2 else {})})
        for i in range(6)]


@pytest.fixture(scope="module")
def hybrid_daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess("[engine]\nmax_active = 3\n", args=("--model", str(FIXTURE))).wait_ready(timeout=120)
    yield d
    d.stop()


@pytest.mark.asyncio
async def test_concurrent_streams_equal_their_solo_runs(hybrid_daemon) -> None:  # type: ignore[no-untyped-def]
    model = ember.load(FIXTURE)
    solo = [list(model.generate(p, **o)) for p, o in JOBS]
    assert await streams_after_a_cancel(hybrid_daemon.socket, JOBS, 400) == solo  # 6 streams on 3 running slots
