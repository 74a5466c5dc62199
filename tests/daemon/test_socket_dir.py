"""The socket directory's permissions and the one-daemon-per-socket lock."""
from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from ember.daemon.server.socket_dir import SocketInUse, SocketLock, prepare_socket_dir


def test_directory_is_created_private_and_tightened(tmp_path: Path) -> None:
    sock = tmp_path / "a" / "b" / "ember.sock"
    prepare_socket_dir(sock)
    assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700
    os.chmod(sock.parent, 0o777)
    prepare_socket_dir(sock)
    assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o700


def test_group_mode_and_unknown_group(tmp_path: Path) -> None:
    import grp

    group = grp.getgrgid(os.getegid()).gr_name
    prepare_socket_dir(tmp_path / "g" / "ember.sock", group)
    st = os.stat(tmp_path / "g")
    assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_gid == os.getegid()
    with pytest.raises(ValueError, match="does not exist"):
        prepare_socket_dir(tmp_path / "h" / "ember.sock", "no-such-group-ember")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory someone else's")
def test_someone_elses_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    os.chown(tmp_path / "d", 12345, -1)
    with pytest.raises(PermissionError, match="belongs to uid 12345"):
        prepare_socket_dir(tmp_path / "d" / "ember.sock")


def test_second_lock_fails_naming_the_first_pid(tmp_path: Path) -> None:
    sock = tmp_path / "ember.sock"
    first = SocketLock(sock)
    first.acquire()
    with pytest.raises(SocketInUse, match=rf"pid {os.getpid()}\) is already serving {sock}"):
        SocketLock(sock).acquire()
    first.release()
    again = SocketLock(sock)
    again.acquire()  # free once released
    again.release()


def test_stale_socket_is_removed_and_other_files_are_not(tmp_path: Path) -> None:
    sock = tmp_path / "ember.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))  # a socket file nobody serves (a crashed daemon's)
    s.close()
    lock = SocketLock(sock)
    lock.acquire()
    assert not sock.exists()
    lock.release()
    sock.write_text("precious")
    with pytest.raises(FileExistsError, match="not a socket"):
        SocketLock(sock).acquire()
    assert sock.read_text() == "precious"


def test_an_existing_sticky_directory_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    for mode in (0o1777, 0o1770, 0o1700):
        os.chmod(shared, mode)
        with pytest.raises(PermissionError, match="shared"):
            prepare_socket_dir(shared / "ember.sock")
        assert stat.S_IMODE(os.stat(shared).st_mode) == mode  # never tightened under its other users
