"""Fixtures of the gateway tests: one real daemon on the built-in demo model (tests/daemon's
DaemonProcess), gateways in front of it served by threads of the test process, and the openai SDK's
clients pointed at them (no retries: a test sees the first answer)."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from daemon_process import DaemonProcess
from gateway_setup import API_KEY, DAEMON_CONFIG
from gateway_thread import GatewayThread


@pytest.fixture(scope="session")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(DAEMON_CONFIG).wait_ready(300)  # the first start after an install compiles the kernels
    yield d
    d.stop()


@pytest.fixture(scope="session")
def gateway(daemon: DaemonProcess) -> Iterator[GatewayThread]:
    g = GatewayThread(socket=daemon.socket)
    yield g
    g.stop()


@pytest.fixture(scope="session")
def keyed_gateway(daemon: DaemonProcess) -> Iterator[GatewayThread]:
    g = GatewayThread(socket=daemon.socket, api_key=API_KEY, max_body_bytes=64 * 1024, max_requests=2)
    yield g
    g.stop()


@pytest.fixture
def client(gateway: GatewayThread):  # type: ignore[no-untyped-def]
    import openai

    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def native(daemon: DaemonProcess):  # type: ignore[no-untyped-def]
    from ember.client import Client

    with Client(daemon.socket) as c:
        yield c
