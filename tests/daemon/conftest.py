"""Fixtures of the daemon tests: uvloop under pytest-asyncio, the demo model in-process (the oracle),
and one shared real daemon process for the end-to-end tests."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvloop

sys.path.insert(0, str(Path(__file__).parent))

from daemon_process import DaemonProcess  # noqa: E402

# small limits and quick probing, so that tests of busy / ring-full / dead clients are fast; one test
# process fills the daemon from many connections (no share per process: test_fair_share.py tests it)
SHARED_CONFIG = """
[server]
probe_interval = 0.2
drain_timeout = 5.0
logits_slots = 4
[engine]
max_active = 3
max_queued = 3
max_per_process = 0
[limits]
max_tokens = 4096
max_requests_per_client = 16
max_message_bytes = 1048576
"""


def pytest_asyncio_loop_factories(config, item):  # type: ignore[no-untyped-def]
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def demo_model():  # type: ignore[no-untyped-def]
    import ember
    from ember.daemon.loader.demo_model import DEMO_MODEL

    return ember.load(DEMO_MODEL)


@pytest.fixture(scope="session")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(SHARED_CONFIG).wait_ready()
    yield d
    died = d.proc.poll()
    d.stop()
    if died is not None:  # every later test failed on it: say why once, with what it printed last
        pytest.fail(f"the shared daemon died (exit {died}) during the tests; its log ends:\n"
                    f"{d.log_path.read_text()[-4000:]}")
