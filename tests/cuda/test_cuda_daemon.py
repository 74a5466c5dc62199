"""One request served by a real `ember serve --device cuda:0` (on the simulator where there is no GPU):
the tokens the CPU gives for the same file."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import ember
from ember.client import Client

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from daemon_process import DaemonProcess  # noqa: E402
from micro_model import write_micro_model  # noqa: E402

pytestmark = pytest.mark.cuda

PROMPT = [1, 17, 300]


def test_a_daemon_on_cuda_serves_a_request(tmp_path: Path) -> None:
    path = write_micro_model(tmp_path)
    want = list(ember.load(path, decode_act="f32", prompt_act="f32").generate(PROMPT, max_tokens=3, ignore_eos=True))
    # no warm-up generation: on the simulator it would double the test's time and prove nothing more
    daemon = DaemonProcess("[engine]\nwarmup = false\n", args=("--device", "cuda:0", "--model", str(path)))
    daemon.wait_ready(timeout=240)
    try:
        with Client(daemon.socket, timeout=240) as client:
            got = [t for chunk in client.generate(PROMPT, max_tokens=3, ignore_eos=True) for t in chunk.token_ids]
        assert got == want, f"the daemon's tokens differ; its log:\n{daemon.log_path.read_text()[-4000:]}"
        events = daemon.log_events()
        assert any(e.get("device") == "cuda:0" for e in events), "the daemon says where the model runs"
    finally:
        assert daemon.stop() == 0
