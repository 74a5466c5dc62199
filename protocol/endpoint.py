"""Where the daemon's socket is: one rule shared by the daemon (where to bind) and clients (where to
connect), so both find the same path without being told.

Candidates, first match wins:
  $EMBER_SOCKET                          explicit, for both sides
  $RUNTIME_DIRECTORY/ember.sock          set by systemd for the service (RuntimeDirectory=ember)
  $XDG_RUNTIME_DIR/ember/ember.sock      a per-user daemon
  /run/ember/ember.sock                  the system service, seen from a user's session (clients only)
  /tmp/ember-<uid>/ember.sock            no runtime directory at all

A client trusts a socket only in a directory that nobody but the daemon's side could have filled:
owned by the client's user, root or the system service's user, and writable by its owner alone. Else
another local user who made the directory first (/tmp/ember-<uid> can be made by anyone) would get the
prompts and forge the replies. `socket_dir_problem` says why a directory fails; `listener_problem`
whether anything still listens on a socket file (a killed daemon leaves its file behind).

Beside the socket, `<socket>.lock` is the daemon's: it holds an flock on it from its first moment and
writes its pid and what it is doing there (compiling kernels, downloading, loading), so that a client
finds a daemon that does not serve yet, and says what it waits for (`starting_daemon`).
"""
from __future__ import annotations

import errno
import fcntl
import os
import pwd
import socket
import stat
from collections.abc import Mapping
from pathlib import Path

SOCKET_NAME = "ember.sock"
SYSTEM_SOCKET = Path("/run/ember") / SOCKET_NAME
MAX_PATH_BYTES = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
SERVICE_USER = "ember"  # the system service's own user (systemd/ember.sysusers), owner of /run/ember


def daemon_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """Where a daemon binds when its configuration names no socket."""
    return _candidates(os.environ if env is None else env, for_client=False)[0]


def client_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """Where a client connects when given no path: the first candidate that exists; else the first this
    user may not look into (the system service's directory admits its group only: the error then says
    so); else the first, so the error message names the expected place."""
    candidates = _candidates(os.environ if env is None else env, for_client=True)
    found = [_lexists(p) for p in candidates]
    for wanted in (True, None):
        if wanted in found:
            return candidates[found.index(wanted)]
    return candidates[0]


def lock_path(socket_path: Path | str) -> Path:
    """The daemon's lock and status file beside its socket."""
    path = Path(socket_path)
    return path.with_name(path.name + ".lock")


def starting_daemon(socket_path: Path | str) -> tuple[int, str] | None:
    """(pid, what it is doing) of a daemon that holds the socket's lock, as its lock file says; None
    where no daemon holds it, or the directory is not one a client trusts (socket_dir_problem)."""
    if socket_dir_problem(socket_path) is not None:
        return None
    try:
        fd = os.open(lock_path(socket_path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # nobody holds it: no daemon (a dead one's file)
        except BlockingIOError:
            pass
        lines = os.pread(fd, 4096, 0).decode(errors="replace").splitlines()
    finally:
        os.close(fd)
    pid = int(lines[0]) if lines and lines[0].strip().isdigit() else 0
    return pid, (lines[1].strip() if len(lines) > 1 and lines[1].strip() else "starting")


def socket_dir_problem(path: Path | str) -> str | None:
    """Why a client must not trust the directory that holds the socket `path`, or None when it may
    (also when the directory does not exist: there is no socket to be fooled by)."""
    directory = Path(path).absolute().parent
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    except PermissionError:
        return f"{directory} cannot be looked at by this user (uid {os.geteuid()})"
    if stat.S_ISLNK(st.st_mode):
        return f"{directory} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    if st.st_uid not in _trusted_owners():
        return (f"{directory} belongs to {_user_name(st.st_uid)}, not to this user ({_user_name(os.geteuid())}), "
                f"root or the {SERVICE_USER} service: another user may have made it to receive your prompts")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{directory} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                f"(mode {stat.S_IMODE(st.st_mode):04o}): anyone who may write there may have put the socket")
    return None


def listener_problem(path: Path | str, timeout: float = 0.5) -> str | None:
    """Why nothing accepts connections on the socket file `path` ("nothing listens on it": a daemon
    killed before it could remove it), or None when something does (or is too busy to say no at once).
    One plain connect, closed at once; only asked after a connection failed or broke."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(os.fspath(path))
    except FileNotFoundError:
        return "its socket file is gone"
    except ConnectionRefusedError:
        return "nothing listens on its socket file"
    except (TimeoutError, BlockingIOError):
        return None  # a full accept backlog: a daemon is there, just busy
    except OSError as e:
        return os.strerror(e.errno) if e.errno else str(e)
    finally:
        s.close()
    return None


def ipc_address(path: Path | str) -> str:
    """The ZMQ endpoint for a socket path; refuses paths the kernel cannot bind."""
    path = Path(path).absolute()
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise ValueError(f"socket path {path} is longer than {MAX_PATH_BYTES} bytes (a Unix socket limit): choose a shorter one")
    return f"ipc://{path}"


def _lexists(path: Path) -> bool | None:
    """Whether `path` exists (a dangling link counts: the trust check names it); None when this user
    may not look."""
    try:
        os.lstat(path)
        return True
    except PermissionError:
        return None
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG):
            return False
        raise


def _trusted_owners() -> set[int]:
    """Who may own a socket's directory: this user, root (who could do anything anyway) and the
    system service's user."""
    owners = {os.geteuid(), 0}
    try:
        owners.add(pwd.getpwnam(SERVICE_USER).pw_uid)
    except KeyError:
        pass
    return owners


def _user_name(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _candidates(env: Mapping[str, str], for_client: bool) -> list[Path]:
    if env.get("EMBER_SOCKET"):
        return [Path(env["EMBER_SOCKET"])]
    out = []
    if env.get("RUNTIME_DIRECTORY"):
        out.append(Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / SOCKET_NAME)
    if env.get("XDG_RUNTIME_DIR"):
        out.append(Path(env["XDG_RUNTIME_DIR"]) / "ember" / SOCKET_NAME)
    if for_client:
        out.append(SYSTEM_SOCKET)
    out.append(Path(f"/tmp/ember-{os.getuid()}") / SOCKET_NAME)
    return out
