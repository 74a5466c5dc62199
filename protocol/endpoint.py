"""Where the daemon's socket is: one rule shared by the daemon (where to bind) and clients (where to
connect), so both find the same path without being told.

Candidates, first match wins:
  $EMBER_SOCKET                          explicit, for both sides
  $RUNTIME_DIRECTORY/ember.sock          set by systemd for the service (RuntimeDirectory=ember)
  $XDG_RUNTIME_DIR/ember/ember.sock      a per-user daemon
  /run/ember/ember.sock                  the system service, seen from a user's session (clients only)
  /tmp/ember-<uid>/ember.sock            no runtime directory at all
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SOCKET_NAME = "ember.sock"
SYSTEM_SOCKET = Path("/run/ember") / SOCKET_NAME
MAX_PATH_BYTES = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux


def daemon_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """Where a daemon binds when its configuration names no socket."""
    return _candidates(os.environ if env is None else env, for_client=False)[0]


def client_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """Where a client connects when given no path: the first candidate that exists (else the first,
    so the error message names the expected place)."""
    candidates = _candidates(os.environ if env is None else env, for_client=True)
    return next((p for p in candidates if p.exists()), candidates[0])


def ipc_address(path: Path | str) -> str:
    """The ZMQ endpoint for a socket path; refuses paths the kernel cannot bind."""
    path = Path(path).absolute()
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise ValueError(f"socket path {path} is longer than {MAX_PATH_BYTES} bytes (a Unix socket limit): choose a shorter one")
    return f"ipc://{path}"


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
