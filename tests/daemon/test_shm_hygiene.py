"""Shared memory one client or one crash cannot run away with: segments named after their daemon's socket
and pid, removed by the next daemon on the socket when a daemon was killed; the daemon's logits rings
bounded together by server.max_logits_bytes, the bytes of a ring given back when its client goes."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import _posixshmem
import pytest

from daemon_process import DaemonProcess, wait_until
from ember.client import Client
from ember.client.errors import LimitExceeded
from ember.daemon.config import ConfigError, load_config
from ember.daemon.server.ring_budget import RingBudget
from ember.protocol import limits
from ember.protocol.messages import ShmSlot
from ember.protocol.shm_ring import SHM_DIR, ShmRing, ShmRingReader, owner_id, remove_dead_segments

pytestmark = pytest.mark.slow

# 4 slots of the demo's 8192 floats: 128 KiB a ring; the bound holds two rings, not three
BOUNDED = """
[server]
probe_interval = 0.2
logits_slots = 4
max_logits_bytes = 300000
max_logits_bytes_per_user = 300000
[engine]
warmup = false
"""



def segments(pid: int, socket: Path) -> list[str]:
    return glob.glob(f"{SHM_DIR}/ember-{pid}-{owner_id(socket)}*")


def take_ring(client: Client) -> None:
    """A request with logits: the daemon makes this connection's ring (kept until it disconnects)."""
    assert len(list(client.generate("def f", max_tokens=2, ignore_eos=True, return_logits=True))) == 2


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited (pids are not reused this soon)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def made() -> Iterator[list[str]]:
    """Names of segments a test makes by hand; whatever is left is unlinked after it."""
    names: list[str] = []
    yield names
    for name in names:
        try:
            _posixshmem.shm_unlink("/" + name)
        except FileNotFoundError:
            pass


def fake_segment(made: list[str], name: str) -> str:
    os.close(_posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    made.append(name)
    return name


# --- names and the sweep -------------------------------------------------------------------------------
def test_names_carry_pid_and_socket_and_readers_accept_only_ember_names(tmp_path: Path) -> None:
    owner = owner_id(tmp_path / "ember.sock")
    assert owner == owner_id(f"{tmp_path}/./ember.sock") and owner != owner_id(tmp_path / "other.sock")
    ring = ShmRing.create(2, 64, owner=owner)
    try:
        assert ring.name.startswith(f"ember-{os.getpid()}-{owner}") and len(ring.name.rsplit("-", 1)[1]) == 16
        reader = ShmRingReader()
        assert reader.view(ring.write(ring.acquire(), [1.0, 2.0])).tolist() == [1.0, 2.0]
        reader.close()
    finally:
        ring.close()
    for bad in (f"ember-{os.getpid()}-{owner}", f"ember-1-{owner}0123456789", "ember-x-0123456789abcdef",
                "ember-1-0123456789ABCDEF", "other-1-0123456789abcdef", "ember-1-0123456789abcdef/../../x"):
        with pytest.raises(ValueError, match="not an ember"):
            ShmRingReader().view(ShmSlot(bad, 0, 0, (1,)))
    with pytest.raises(ValueError, match="owner"):
        ShmRing.create(2, 64, owner="../x")


def test_sweep_removes_only_dead_daemons_segments_of_its_socket(tmp_path: Path, dead_pid: int,
                                                                 made: list[str]) -> None:
    mine, other = owner_id(tmp_path / "a.sock"), owner_id(tmp_path / "b.sock")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gone = [fake_segment(made, f"ember-{dead_pid}-{mine}0000000{i}") for i in (1, 2)]
        # a predecessor whose pid this process got again: the socket's lock says it is not alive
        gone.append(fake_segment(made, f"ember-{os.getpid()}-{mine}00000003"))
        kept = [fake_segment(made, f"ember-{live.pid}-{mine}00000004"),  # a live process's
                fake_segment(made, f"ember-{dead_pid}-{other}00000005"),  # another socket's
                fake_segment(made, f"ember-{dead_pid}-{mine}0000006"),  # not a name ember makes
                fake_segment(made, f"xember-{dead_pid}-{mine}00000007")]
        removed = remove_dead_segments(mine)
        again = remove_dead_segments(mine)
    finally:
        live.kill()
        live.wait()
    assert sorted(name for name, _ in removed) == sorted(gone) and again == []
    assert all(not os.path.exists(SHM_DIR / n) for n in gone) and all(os.path.exists(SHM_DIR / n) for n in kept)
    assert remove_dead_segments(mine, tmp_path / "no-such-dir") == []


# --- the bound on rings ----------------------------------------------------------------------------------
def test_ring_close_gives_its_bytes_back_once() -> None:
    budget = RingBudget(2 * ShmRing.bytes_for(2, 100))
    rings = []
    for _ in range(2):
        budget.take(ShmRing.bytes_for(2, 100))
        rings.append(ShmRing.create(2, 100, on_close=lambda: budget.give(ShmRing.bytes_for(2, 100))))
    assert rings[0].nbytes == ShmRing.bytes_for(2, 100) == 2 * 128 and budget.used == 512
    with pytest.raises(limits.LimitExceeded, match=r"2 clients' logits rings hold 512 bytes; one more of 256 bytes "
                                                   r"is over the limit of 512"):
        budget.take(256)
    rings[0].close()
    rings[0].close()  # twice gives back once
    assert budget.used == 256 and budget.rings == 1
    budget.take(256)
    rings[1].close()


def test_one_user_holds_at_most_its_share() -> None:
    """server.max_logits_bytes_per_user: one user's rings together, whatever its connections; another user
    still gets one."""
    ring = ShmRing.bytes_for(2, 100)
    budget = RingBudget(4 * ring, per_user=2 * ring)
    budget.take(ring, user=1000)
    budget.take(ring, user=1000)
    with pytest.raises(limits.LimitExceeded, match="max_logits_bytes_per_user: this user's logits rings hold 512"):
        budget.take(ring, user=1000)
    budget.take(ring, user=1001)  # another user's share is its own
    budget.give(ring, user=1000)
    budget.take(ring, user=1000)
    assert budget.used == 3 * ring and budget.rings == 3


def test_max_logits_bytes_is_configurable_and_checked() -> None:
    assert load_config(env={}).server.max_logits_bytes == 256 << 20
    assert load_config(env={}).server.logits_bytes_per_user == 128 << 20  # half, by default
    assert load_config(env={"EMBER_SERVER_MAX_LOGITS_BYTES": "1048576"}).server.max_logits_bytes == 1 << 20
    with pytest.raises(ConfigError, match="server.max_logits_bytes: max_logits_bytes must be >= 0"):
        load_config(env={"EMBER_SERVER_MAX_LOGITS_BYTES": "-1"})


# --- real daemons ----------------------------------------------------------------------------------------
def test_segments_of_a_killed_daemon_are_removed_by_the_next_one(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as bystander:  # a live daemon on another socket: its ring must survive
        take_ring(bystander)
        (theirs,) = segments(daemon.engine_pid, daemon.socket)
        first = DaemonProcess(BOUNDED).wait_ready()
        try:
            with Client(first.socket, timeout=5.0) as client:
                take_ring(client)
                assert len(segments(first.engine_pid, first.socket)) == 1
                first.proc.kill()
                first.proc.wait()
        finally:
            first.stop()
        try:
            left = segments(first.engine_pid, first.socket)
            assert len(left) == 1 and first.socket.is_socket()  # what a SIGKILL leaves: nobody could unlink
            second = DaemonProcess(BOUNDED, args=("--socket", str(first.socket))).wait_ready()
            try:
                assert not os.path.exists(left[0]) and os.path.exists(theirs)
                assert any(e["event"] == "removed the logits segments of a daemon that died" and e["segments"] == 1
                           for e in second.log_events())
                with Client(first.socket) as client:  # the stale socket file was replaced: it serves
                    take_ring(client)
                    assert len(segments(second.engine_pid, first.socket)) == 1
                assert bystander.health().status == "ok"
            finally:
                assert second.stop() == 0
            assert segments(second.engine_pid, first.socket) == []  # a clean exit unlinks its own
        finally:
            remove_dead_segments(owner_id(first.socket))  # leave /dev/shm clean even if this test failed


def test_logits_rings_are_bounded_and_a_disconnect_frees_room() -> None:
    d = DaemonProcess(BOUNDED).wait_ready()
    try:
        with ExitStack() as clients:  # every client closed, whatever fails: an open one blocks pytest's exit
            bystander = clients.enter_context(Client(d.socket))
            stream = bystander.generate("x", max_tokens=4000, ignore_eos=True)
            next(stream)
            holders = [clients.enter_context(Client(d.socket)) for _ in range(2)]
            for holder in holders:
                take_ring(holder)
            late = clients.enter_context(Client(d.socket))
            with pytest.raises(LimitExceeded, match="max_logits_bytes"):
                take_ring(late)
            next(stream)
            holders[0].close()  # the daemon finds it gone and closes its ring
            assert wait_until(lambda: _ring_granted(late), 30.0, every=0.05)
            assert len(segments(d.engine_pid, d.socket)) == 2
            next(stream)
            stream.close()
            assert stream.finished is not None and stream.finished.reason == "cancelled"
    finally:
        assert d.stop() == 0


def test_one_user_with_many_connections_gets_its_share_of_rings() -> None:
    """A user's rings are bounded together (server.max_logits_bytes_per_user, half of the whole by
    default): its second connection with logits is refused, naming that bound, with room left over."""
    d = DaemonProcess(BOUNDED.replace("max_logits_bytes_per_user = 300000", "")).wait_ready()
    try:
        with Client(d.socket) as first, Client(d.socket) as second:
            take_ring(first)
            with pytest.raises(LimitExceeded, match="max_logits_bytes_per_user: this user's logits rings hold"):
                take_ring(second)
            assert len(segments(d.engine_pid, d.socket)) == 1
    finally:
        assert d.stop() == 0


def _ring_granted(client: Client) -> bool:
    try:
        take_ring(client)
    except LimitExceeded:
        return False
    return True


def test_thirty_idle_connections_hold_no_more_than_the_bound() -> None:
    # each connection that once asked for logits keeps a ring until it disconnects: 30 of them, idle,
    # would hold 30 rings; the bound (two rings' worth here) holds the total, and a bystander streams on
    d = DaemonProcess(BOUNDED).wait_ready()
    try:
        with ExitStack() as clients:
            bystander = clients.enter_context(Client(d.socket))
            stream = bystander.generate("x", max_tokens=4000, ignore_eos=True)
            next(stream)
            granted = refused = 0
            for _ in range(30):
                idle = clients.enter_context(Client(d.socket))
                if _ring_granted(idle):
                    granted += 1
                else:
                    refused += 1
                next(stream)
            assert (granted, refused) == (2, 28)
            assert len(segments(d.engine_pid, d.socket)) == 2
            stream.close()
    finally:
        assert d.stop() == 0
