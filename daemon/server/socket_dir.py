"""The socket's directory and the lock that makes one daemon its only owner.

- The directory is created 0700 (0750 and group-owned when a group may connect): the directory, not the
  socket file's mode, is what keeps other users out, since libzmq creates the socket with the umask.
  A directory that belongs to someone else is refused, and so is an existing sticky one (a shared
  directory such as /tmp, which a root daemon owns): tightening it would lock everyone else out.
- `<socket>.lock` is flock()ed for the daemon's whole life. libzmq silently unlinks and replaces an
  existing ipc socket when it binds, so without the lock a second daemon would steal the first one's
  clients; with it, the second one fails with a message naming the first one's pid. A socket file left
  by a daemon that crashed is stale once the lock is ours, and is removed.
- The lock file itself is left in place at exit: unlinking a lock file others may have opened is racy.
"""
from __future__ import annotations

import fcntl
import grp
import os
import stat
from pathlib import Path

from ember.protocol.endpoint import lock_path


class SocketInUse(RuntimeError):
    """Another daemon holds the socket's lock."""


def prepare_socket_dir(socket_path: Path, group: str = "") -> None:
    directory = socket_path.parent
    mode = 0o750 if group else 0o700
    existed = directory.exists()
    directory.mkdir(mode=mode, parents=True, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{directory} is not a directory: refusing to put the ember socket there")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{directory} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                              "refusing to put the ember socket there")
    if existed and st.st_mode & stat.S_ISVTX:  # a shared directory such as /tmp: never tighten it
        raise PermissionError(f"{directory} is shared (mode {stat.S_IMODE(st.st_mode):o}): give the ember socket a "
                              "directory of its own, e.g. --socket /tmp/ember-$USER/ember.sock")
    os.chmod(directory, mode)
    if group:
        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise ValueError(f"socket_group {group!r} does not exist") from None
        os.chown(directory, -1, gid)


class SocketLock:
    """flock() on `<socket>.lock`, held until release() (or the process ends: the kernel drops it)."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.path = lock_path(socket_path)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").split("\n", 1)[0].strip() or "unknown"  # its pid line
            os.close(fd)
            raise SocketInUse(f"another ember daemon (pid {holder}) is already serving {self.socket_path}; "
                              "stop it first or choose another --socket") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        self._remove_stale_socket()

    def note(self, line: str) -> None:
        """What the daemon is doing, after its pid, for a client that finds it not serving yet
        (protocol/endpoint.py's starting_daemon): one line of at most 300 characters."""
        if self._fd is None:
            return
        text = f"{os.getpid()}\n{' '.join(line.split())[:300]}\n".encode()
        os.pwrite(self._fd, text, 0)
        os.ftruncate(self._fd, len(text))

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _remove_stale_socket(self) -> None:
        try:
            st = os.lstat(self.socket_path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            self.release()
            raise FileExistsError(f"{self.socket_path} exists and is not a socket: refusing to replace it")
        os.unlink(self.socket_path)  # left by a daemon that died: nobody holds the lock
