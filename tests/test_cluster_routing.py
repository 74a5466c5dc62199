"""The cluster's routing pieces that need no Ray: the prefix index, the text a request is routed by,
the configuration's refusals, and the error that ends a stream whose replica died."""
from __future__ import annotations

import json

import msgspec
import pytest

from ember.cluster.config import ClusterConfigError, load_cluster_config
from ember.cluster.ingress import lost_tail, routing_text
from ember.cluster.prefix_index import PrefixIndex


def test_a_prompt_matches_the_replica_that_saw_its_prefix_block_by_block() -> None:
    index = PrefixIndex(block_chars=8, max_blocks=100)
    system = "You are a helpful assistant. " * 4  # 116 characters: 14 whole blocks
    index.insert("a", index.blocks(system + "What is 2+2?"))
    index.insert("b", index.blocks("Something else entirely, and long enough."))
    asked = index.blocks(system + "Name a prime number.")
    assert index.matches(asked, ["a", "b", "c"]) == {"a": 14, "b": 0, "c": 0}
    # a block's name stands for its whole prefix: the same block after another beginning is no match
    assert index.matches(index.blocks("X" + system), ["a"]) == {"a": 0}
    assert index.blocks("short") == []  # no whole block: nothing to share yet


def test_old_blocks_are_forgotten_first_and_a_gone_replica_holds_nothing() -> None:
    index = PrefixIndex(block_chars=4, max_blocks=3)
    index.insert("a", index.blocks("aaaabbbbcccc"))
    index.insert("a", index.blocks("ddddeeee"))  # 5 blocks seen, 3 kept: the first prompt's first two go
    assert index.size("a") == 3
    assert index.matches(index.blocks("aaaabbbbcccc"), ["a"]) == {"a": 0}
    assert index.matches(index.blocks("ddddeeee"), ["a"]) == {"a": 2}
    index.keep_only({"b"})
    assert index.size("a") == 0
    with pytest.raises(ValueError, match="block_chars"):
        PrefixIndex(block_chars=0)


@pytest.mark.parametrize("body, text", [
    ({"model": "m", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]},
     "system\x1eS\x1euser\x1eU"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]},
     "user\x1ea"),
    ({"model": "m", "prompt": "hello"}, "hello"),
    ({"model": "m", "prompt": ["p1", "p2"]}, "p1\x1ep2"),
    ({"model": "m", "instructions": "be brief", "input": "hi"}, "be brief\x1ehi"),  # the Responses API
    ({"model": "m"}, ""),
])
def test_routing_text_is_the_prompt_in_order(body: dict, text: str) -> None:  # type: ignore[type-arg]
    assert routing_text(json.dumps(body).encode()) == text


def test_what_is_no_json_object_is_routed_by_load_alone() -> None:
    assert routing_text(b"not json") == routing_text(b"[1, 2]") == routing_text(b"") == ""


def test_a_lost_replica_ends_a_stream_in_the_stream_own_error_form() -> None:
    event = lost_tail("text/event-stream", "r1")
    assert event is not None and event.startswith(b"data: ") and event.endswith(b"\n\n")
    error = msgspec.json.decode(event[len(b"data: "):])["error"]
    assert error["code"] == "replica_lost" and "r1" in error["message"]
    line = lost_tail("application/x-ndjson", "r1")
    assert line is not None and "died" in msgspec.json.decode(line)["error"]
    assert lost_tail("application/json", "r1") is None  # no error form: the connection is cut instead


def test_the_configuration_refuses_what_would_not_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def load(text: str):  # type: ignore[no-untyped-def]
        (tmp_path / "c.toml").write_text(text)
        return load_cluster_config(tmp_path / "c.toml")

    config = load('[replicas]\nmin = 1\nmax = 3\ncpus = 2\n[daemon]\nargs = ["--max-active", "8"]\n')
    assert (config.replicas.max, config.replicas.cpus, config.daemon.args) == (3, 2.0, ["--max-active", "8"])
    assert load_cluster_config(None).replicas.min == 1
    with pytest.raises(ClusterConfigError, match="replicas.min"):
        load("[replicas]\nmin = 3\nmax = 2\n")
    with pytest.raises(ClusterConfigError, match="repicas"):  # a typo is named, not taken for a default
        load("[repicas]\nmin = 2\n")
    with pytest.raises(ClusterConfigError, match="--socket"):
        load('[daemon]\nargs = ["--socket", "/tmp/x.sock"]\n')
    with pytest.raises(ClusterConfigError, match="not TOML"):
        load("[replicas\n")
    with pytest.raises(ClusterConfigError, match="cannot read"):
        load_cluster_config(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="API key"):  # exposure is refused before anything starts
        load('[ingress]\nlisten = "0.0.0.0:8000"\n').gateway(None)


def test_a_replica_sweeps_the_directories_of_replicas_that_died_and_only_those(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import fcntl
    import os

    from ember.cluster.replica import DIR_PREFIX, STALE_AFTER, sweep_stale_dirs

    def made(name: str, lock: bool, age: float = 0.0):  # type: ignore[no-untyped-def]
        d = tmp_path / (DIR_PREFIX + name)
        d.mkdir()
        if lock:
            (d / "ember.sock.lock").touch()
        os.utime(d, (d.stat().st_atime - age, d.stat().st_mtime - age))
        return d

    live, dead, starting, failed = made("live", True), made("dead", True), made("starting", False), \
        made("failed", False, age=STALE_AFTER + 60)
    with open(live / "ember.sock.lock", "a") as held:  # a running daemon holds its lock for its life
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert sorted(sweep_stale_dirs(tmp_path)) == sorted([dead, failed])
    assert live.exists() and starting.exists() and not dead.exists() and not failed.exists()
