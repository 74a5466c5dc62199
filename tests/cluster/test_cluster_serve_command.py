"""`ember cluster serve CONFIG --address ADDR`, the one command, as a process of its own on the test
cluster (conftest.py): it serves, Serve adds the second replica its autoscaling allows when the load
stays above the target, and SIGTERM stops it cleanly, taking its replicas with it. Runs after
test_cluster_replicas.py's module has given the nodes' CPUs back."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from daemon_process import wait_until  # noqa: E402

from ember.cluster.deployment import replica_ids  # noqa: E402

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serving(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/v1/cluster/replicas", timeout=10) as r:
            return sum("stats" in d for d in msgspec.json.decode(r.read())["data"])
    except OSError:
        return 0


def test_the_command_serves_scales_up_under_load_and_stops_cleanly(ray_nodes: str, tmp_path: Path) -> None:
    port = _free_port()
    config = tmp_path / "cluster.toml"
    config.write_text(f'[ingress]\nlisten = "127.0.0.1:{port}"\n[ray]\napp = "scaling"\n'
                      "[replicas]\nmin = 1\nmax = 2\ncpus = 1\ntarget_ongoing_requests = 1\nupscale_delay_s = 1\n")
    env = {k: v for k, v in os.environ.items() if k != "EMBER_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-m", "ember.client.cli", "cluster", "serve", str(config),
                             "--address", ray_nodes, "--log-format", "json"], env=env,
                            stdout=open(tmp_path / "log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: _serving(url) == 1, 300, every=0.5), (tmp_path / "log").read_text()[-3000:]

        def stream(i: int) -> int:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
                chunks = c.completions.create(model="ember-demo", prompt=f"Story {i}:", max_tokens=1500, stream=True,
                                              extra_body={"ignore_eos": True})
                return sum(1 for _ in chunks)

        with ThreadPoolExecutor(6) as pool:  # six long streams: six ongoing requests against a target of one
            streams = [pool.submit(stream, i) for i in range(6)]
            assert wait_until(lambda: _serving(url) == 2, 120, every=1.0)
            assert all(s.result() > 0 for s in streams)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    assert code == 0, (tmp_path / "log").read_text()[-3000:]
    assert replica_ids("scaling") == []  # the command's application went with it
