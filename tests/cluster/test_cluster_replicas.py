"""Replicas on a real Ray cluster of two nodes on this machine (conftest.py): two EmberReplicas, one per
node, behind the ingress, against one daemon alone."""
from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ember[cluster]')")
openai = pytest.importorskip("openai")

sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))
sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))

from daemon_process import DaemonProcess, alive, wait_until  # noqa: E402
from gateway_thread import GatewayThread  # noqa: E402

from ember.cluster.config import ClusterConfig, DaemonOptions, ReplicaOptions  # noqa: E402
from ember.cluster.deployment import deploy, replica_ids, serve_ingress  # noqa: E402
from ember.cluster.ingress import Ingress  # noqa: E402

pytestmark = pytest.mark.slow
APP = "ember"
# one process (a replica's gateway, the lone daemon's gateway) may carry all 32 requests
DAEMON_CONFIG = "[engine]\nmax_per_process = 0\n"
GROUPS = [f"You are assistant number {g}, and you answer questions about {topic} briefly and well. " * 3
          for g, topic in enumerate(("rivers", "prime numbers", "old ships", "bread"))]


class IngressThread:
    """The ingress on a thread of the test process, on a free loopback port."""

    def __init__(self, handle, config: ClusterConfig) -> None:  # type: ignore[no-untyped-def]
        gateway = replace(config.gateway(None), port=0)
        self.ingress = Ingress(handle, gateway, config.ingress.retries, lambda: replica_ids(APP))
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        started: asyncio.Future[str] = self._loop.create_future()
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(serve_ingress(self.ingress, self._stop, started),), daemon=True)
        self._thread.start()
        assert wait_until(started.done, 30)
        self.url = started.result()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.fixture(scope="module")
def cluster(ray_nodes: str, tmp_path_factory) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """Two replicas (one CPU each: one per node) behind the ingress; its URL."""
    from ray import serve

    daemon_config = tmp_path_factory.mktemp("cluster") / "ember.toml"
    daemon_config.write_text(DAEMON_CONFIG)
    config = ClusterConfig(replicas=ReplicaOptions(min=2, max=2, cpus=1),
                           daemon=DaemonOptions(config=str(daemon_config)))
    ingress = IngressThread(deploy(config), config)
    yield ingress.url
    ingress.stop()
    serve.shutdown()  # the replicas' CPUs go back: the split's stages take them next


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """One daemon and its gateway: what the replicas must answer alike."""
    daemon = DaemonProcess(DAEMON_CONFIG).wait_ready(300)
    gateway = GatewayThread(socket=daemon.socket)
    yield gateway.url
    gateway.stop()
    daemon.stop()


def _client(url: str):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _replicas(url: str) -> dict[str, dict]:  # type: ignore[type-arg]
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/cluster/replicas", timeout=30) as r:
        return {d["replica"]: d for d in msgspec.json.decode(r.read())["data"]}


def _ask(url: str, system: str, question: str) -> tuple[str, str]:
    """A greedy chat answer, and the replica that gave it ("" from a lone daemon's gateway)."""
    with _client(url) as c:
        raw = c.chat.completions.with_raw_response.create(
            model="ember-demo", max_tokens=12, temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
        return raw.parse().choices[0].message.content or "", raw.headers.get("x-ember-replica", "")


def test_two_replicas_answer_32_concurrent_requests_as_one_daemon_does(cluster: str, single: str) -> None:
    asks = [(GROUPS[i % 4], f"Question {i}: what do you know?") for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        spread = list(pool.map(lambda a: _ask(cluster, *a), asks))
    with ThreadPoolExecutor(32) as pool:
        alone = list(pool.map(lambda a: _ask(single, *a)[0], asks))
    assert [text for text, _ in spread] == alone
    # both replicas served (a prefix may be on both here: 32 at once, load wins past routing.max_imbalance)
    assert len({replica for _, replica in spread}) == 2


def test_requests_that_share_a_prefix_go_to_the_replica_that_holds_it(cluster: str) -> None:
    system = "You are the ember cluster's test assistant. Answer in one short sentence, plainly. " * 4
    before = _replicas(cluster)
    replicas = {_ask(cluster, system, f"What is {i} plus {i}?")[1] for i in range(6)}
    assert len(replicas) == 1
    (chosen,) = replicas
    after = _replicas(cluster)
    hits = {r: after[r]["stats"]["prefix_hits"] - before[r]["stats"]["prefix_hits"] for r in after}
    assert hits[chosen] >= 5  # the five after the first each found the system prompt's blocks
    assert all(h == 0 for r, h in hits.items() if r != chosen)


def test_a_replica_killed_mid_stream_ends_its_stream_clearly_and_the_cluster_serves_on(cluster: str) -> None:
    import ray

    with _client(cluster) as c:
        raw = c.chat.completions.with_raw_response.create(
            model="ember-demo", max_tokens=3000, temperature=0, stream=True, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Count to a thousand."}])
        victim = raw.headers["x-ember-replica"]
        daemon_pid = _replicas(cluster)[victim]["daemon_pid"]
        chunks = iter(raw.parse())
        next(chunks)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#EmberReplica#{victim}", namespace="serve"), no_restart=True)
        with pytest.raises(openai.APIError, match="died mid-answer"):
            for _ in chunks:
                pass
    answers = [_ask(cluster, "You are brief.", f"Say {i}.") for i in range(4)]  # the next requests succeed
    assert all(text and replica != victim for text, replica in answers)
    assert wait_until(lambda: not alive(daemon_pid), 30, every=0.2)  # the dead replica's daemon went with it
    assert wait_until(lambda: len(_serving(cluster) - {victim}) == 2, 120, every=0.5)  # Serve replaced it


def _serving(url: str) -> set[str]:
    """The replicas that answer for their counters."""
    return {r for r, d in _replicas(url).items() if "stats" in d}


def test_a_replica_whose_daemon_cannot_start_says_why_and_leaves_nothing(tmp_path: Path) -> None:
    import glob
    import tempfile

    from ember.cluster.replica import EmberReplica, ReplicaStartError

    made = f"{tempfile.gettempdir()}/ember-replica-*"
    before = set(glob.glob(made))
    with pytest.raises(ReplicaStartError, match=r"(?s)the replica's daemon exited with status 1.*nonexistent\.gguf"):
        EmberReplica(["--model", str(tmp_path / "nonexistent.gguf")], start_timeout=120)
    assert set(glob.glob(made)) == before  # its socket directory and log are gone
