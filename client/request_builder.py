"""What the sync and async clients share: the checks before connecting (is the socket's directory
trusted, is it a socket), the DEALER's options and the monitor events they watch, building and encoding
request messages (every failure an EmberError, nothing over the daemon's frame limit), reading replies,
turning Tokens frames into Chunks, and why a connection broke. No ZMQ I/O here: the clients own their
sockets."""
from __future__ import annotations

import grp
import json
import os
import socket
import stat
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import msgspec
import numpy as np
import zmq

from ember.client.errors import (BadRequest, ConnectionLost, DaemonUnavailable, EmberError, GenerationFailed,
                                 LimitExceeded, UntrustedSocket, error_from)
from ember.protocol.codec import Codec
from ember.protocol.endpoint import ipc_address, listener_problem, socket_dir_problem
from ember.protocol.limits import Limits
from ember.protocol.device_ring import DeviceRingReader
from ember.protocol.messages import (ChatMessage, Error, Finished, FinishReason, Generate, Grammar, Release,
                                     ServerMessage, Tokens, Tool, ToolCall, ToolChoice, Welcome, Wire)
from ember.protocol.shm_ring import ShmRingReader

T = TypeVar("T")

# what the monitor reports: a connection made, a connection lost, a connect that failed and will be retried
MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
HEARTBEAT_IVL_MS = 1000


def daemon_address(socket_path: Path) -> str:
    """The ipc address of the daemon's socket, once it is safe to send there: DaemonUnavailable when
    there is no socket (or this user may not reach it), UntrustedSocket when another user could have
    put it there."""
    try:
        address = ipc_address(socket_path)
    except ValueError as e:
        raise DaemonUnavailable(str(e)) from e
    problem = socket_dir_problem(socket_path)
    if problem is not None:
        raise UntrustedSocket(f"refusing to connect to {socket_path}: {problem}")
    try:
        st = os.lstat(socket_path)
    except (FileNotFoundError, NotADirectoryError):
        raise DaemonUnavailable(f"no ember daemon at {socket_path} (start one with `ember serve`)") from None
    except PermissionError as e:
        raise DaemonUnavailable(f"cannot reach the ember daemon at {socket_path}: permission denied "
                                f"({_admits(socket_path.parent)})") from e
    if not stat.S_ISSOCK(st.st_mode):
        raise DaemonUnavailable(f"{socket_path} is not a socket: no ember daemon there")
    return address


class PeerCheck:
    """Every connection libzmq makes to the socket path, the first and each reconnection, must reach the
    daemon the first one reached: a process of the same user (SO_PEERCRED of the connection, from the
    monitor's CONNECTED event), in a directory that still passes the trust check. A reconnection after
    a daemon restart could otherwise reach whatever another user put at the path meanwhile."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.uid: int | None = None  # the daemon's user, from the first connection
        self.problem: str | None = None  # why the connection now is refused (then every later one too)

    def connected(self, fd: int) -> str | None:
        """A connection was made on `fd`: None if it may be used, else why not (kept in `problem`)."""
        uid = peer_uid(fd)
        why = socket_dir_problem(self.socket_path)
        if why is None and self.uid is not None and uid != self.uid:
            why = f"the process listening there now runs as uid {uid}, not as the daemon's uid {self.uid}"
        if why is not None:
            self.problem = f"refusing the connection to {self.socket_path}: {why}"
            return self.problem
        if self.uid is None:
            self.uid = uid
        return None


def peer_uid(fd: int) -> int | None:
    """The uid of the process at the other end of the Unix socket `fd` (None where the kernel does not say)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:  # a duplicate: closing it leaves libzmq's alone
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
    except OSError:
        return None
    return int(uid)


def _admits(directory: Path) -> str:
    """Who may enter the socket's directory, for the message that tells a user they may not."""
    try:
        st = os.stat(directory)
        group = grp.getgrgid(st.st_gid).gr_name
    except (OSError, KeyError):
        return f"{directory} does not admit this user"
    if st.st_mode & stat.S_IXGRP:
        return f"{directory} admits members of group {group} only: ask for it (usermod -aG {group} USER)"
    return f"{directory} admits the daemon's user only"


def configure(sock: zmq.Socket[Any], timeout: float) -> None:
    """The DEALER's options, before it connects."""
    sock.setsockopt(zmq.LINGER, 0)
    # no ZMQ_IMMEDIATE: with it, libzmq discards frames not yet read when the daemon
    # disconnects, and a daemon that shuts down sends its last Finished frames just before that
    # heartbeats find a daemon that is frozen (stopped, not killed: the kernel reports a killed one at
    # once); `timeout` is what the client waits for any answer anyway
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(int(timeout * 1000), HEARTBEAT_IVL_MS))
    # a daemon that is gone is retried ever more slowly (every second at most): a restarted one is found
    # soon, and the monitor's queue fills slowly while nobody reads it
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)


def message_limit(welcome: Welcome | None) -> int:
    """The largest frame the daemon takes: what its Welcome announces, else the default limit (a bigger
    frame makes libzmq drop the connection, and every request on it, without a word)."""
    announced = welcome.max_message_bytes if welcome is not None else 0  # 0: a daemon that does not say
    return announced or Limits().max_message_bytes


def encode(codec: Codec, message: Wire, limit: int) -> bytes:
    """`message` as a frame: BadRequest when it cannot be encoded (a lone surrogate in a string, an
    integer beyond 64 bits), LimitExceeded when the frame is over `limit` bytes."""
    try:
        payload = codec.encode(message)
    except (msgspec.EncodeError, UnicodeEncodeError, OverflowError, TypeError, ValueError) as e:
        raise BadRequest(f"cannot encode the {type(message).__name__} request: {e}") from e
    if len(payload) > limit:
        raise LimitExceeded(f"the {type(message).__name__} request is {len(payload)} bytes, over the daemon's "
                            f"limit of {limit} bytes per message (limits.max_message_bytes)")
    return payload


_LISTENER_GRACE = 0.3  # seconds a dying daemon's listening socket may outlive a connection of it


@dataclass(frozen=True)
class Lost:
    """Stands in a request's queue, after the frames that came before, for a request that a broken
    connection took with it. Raises on every read: the request will never get another frame."""

    error: type[DaemonUnavailable]
    message: str

    def raise_(self) -> NoReturn:
        raise self.error(self.message)


def lost_connection(socket_path: Path) -> Lost:
    """Why the connection broke while requests were in flight: the daemon is gone, or it still listens
    and has dropped this connection (and cancelled its requests). A daemon that is being killed may
    close this connection a moment before its listening socket (its exit competes for the cores with
    its engine process), so a listener is asked again over _LISTENER_GRACE before it counts."""
    deadline = time.monotonic() + _LISTENER_GRACE
    while (why := listener_problem(socket_path)) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if why is not None:
        return Lost(DaemonUnavailable, f"the ember daemon at {socket_path} went away ({why}): it stopped or was "
                                       "killed while this request was in flight")
    return Lost(ConnectionLost, f"the connection to the ember daemon at {socket_path} broke and the daemon, still "
                                "running, cancelled this request: it drops a connection that misses its heartbeats "
                                "for a few seconds (this process stopped, e.g. by Ctrl-Z) or sends a message over "
                                "its limits.max_message_bytes")


def unreachable(socket_path: Path) -> Lost | None:
    """After a connect failed (libzmq retries it): the Lost for requests waiting on a daemon that is not
    there, or None when something listens (a retry may succeed)."""
    why = listener_problem(socket_path)
    if why is None:
        return None
    return Lost(DaemonUnavailable, f"no ember daemon at {socket_path}: {why} (a daemon that was killed leaves it "
                                   "behind; start one with `ember serve`)")


@dataclass(frozen=True)
class Chunk:
    """What one Tokens frame brought: new token ids, the text they add, and when asked for, their
    log-probabilities and logits. `logits` ([n, vocab] float32) is a read-only view of shared memory
    (return_logits), or with device_logits a CuPy array on the model's GPU, read in place (the current
    stream waits for the daemon's write); either is valid until the stream advances: copy it to keep it."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    logits: Any = None


def generate_message(request_id: int, prompt: str | Sequence[int] | None = None, *,
                     messages: Sequence[Mapping[str, Any] | ChatMessage] | None = None, model: str | None = None,
                     max_tokens: int = 256, temperature: float | None = 0.0, top_k: int | None = 0,
                     top_p: float | None = 1.0, min_p: float | None = 0.0, repetition_penalty: float | None = 1.0,
                     frequency_penalty: float = 0.0,
                     presence_penalty: float = 0.0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                     stop_ids: Sequence[int] | None = None, ignore_eos: bool = False, return_logits: bool = False,
                     logprobs: bool = False, top_logprobs: int = 0,
                     logit_bias: Mapping[int, float] | None = None, grammar: Grammar | None = None,
                     json_schema: Mapping[str, Any] | str | None = None, tools: Sequence[Tool] = (),
                     tool_choice: str = ToolChoice.AUTO, tool_name: str = "", parallel_tool_calls: bool = True,
                     device_logits: bool = False) -> Generate:
    """The Generate message of these options. Sampling defaults to greedy; None for temperature, top_k,
    top_p, min_p or repetition_penalty leaves that parameter to the model's recommendation. The text
    follows `grammar` (ember.protocol.messages.Grammar: json_schema, json, regex, lark or gbnf), or
    `json_schema` (a schema, or its JSON text) for short, and ends where it is complete. A chat may offer
    `tools` (ember.protocol.messages.Tool) for the model to call (tool_choice auto, none, or required,
    with tool_name the one function); its calls come in its text, in the model's format
    (ember.client.tool_calls parses them). return_logits gives each token's logits in shared memory;
    device_logits gives them on the model's GPU instead (CUDA IPC: a model on a GPU, CuPy here)."""
    try:
        if json_schema is not None:
            if grammar is not None:
                raise ValueError("give grammar or json_schema, not both")
            grammar = Grammar("json_schema", json_schema if isinstance(json_schema, str) else json.dumps(json_schema))
        text = prompt if isinstance(prompt, str) else None
        ids = tuple(int(t) for t in prompt) if prompt is not None and not isinstance(prompt, str) else None
        chat = tuple(_chat_message(m) for m in messages) if messages is not None else None
        return Generate(
            request_id, model or "", text, ids, chat, max_tokens, _float(temperature),
            None if top_k is None else int(top_k), _float(top_p), _float(min_p), _float(repetition_penalty),
            float(frequency_penalty), float(presence_penalty), seed,
            (stop,) if isinstance(stop, str) else tuple(stop or ()), tuple(stop_ids or ()), ignore_eos, return_logits,
            logprobs, top_logprobs, {int(k): float(v) for k, v in (logit_bias or {}).items()}, grammar,
            tuple(tools), tool_choice, tool_name, parallel_tool_calls, device_logits,
        )
    except (TypeError, ValueError, KeyError) as e:  # an option of the wrong type: the caller's mistake
        raise BadRequest(f"bad Generate options: {e!r}") from e


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)


def _chat_message(m: Mapping[str, Any] | ChatMessage) -> ChatMessage:
    if isinstance(m, ChatMessage):
        return m
    calls = tuple(c if isinstance(c, ToolCall) else ToolCall(str(c["id"]), str(c["name"]),
                                                             str(c.get("arguments", "{}")))
                  for c in m.get("tool_calls") or ())
    return ChatMessage(str(m["role"]), str(m.get("content") or ""), calls, str(m.get("tool_call_id") or ""),
                       str(m.get("name") or ""))


def expect(reply: ServerMessage, kind: type[T]) -> T:
    """The reply if it is a `kind`; the mapped exception if it is an Error."""
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, Error):
        raise error_from(reply)
    raise EmberError(f"unexpected reply {type(reply).__name__} (wanted {kind.__name__})")


class LogitsReader:
    """A client's readers of its logits rings: shared memory (return_logits) and, opened on first use,
    CUDA IPC on the model's GPU (device_logits, with CuPy)."""

    def __init__(self) -> None:
        self.shm = ShmRingReader()
        self.device = DeviceRingReader()

    def logits(self, tokens: Tokens) -> Any:
        """The frame's logits rows: a numpy view of shared memory, a CuPy view of the GPU's ring, or None."""
        try:
            if tokens.logits:
                views = [self.shm.view(slot) for slot in tokens.logits]
                return views[0] if len(views) == 1 else np.concatenate(views)
            if tokens.device_logits:
                views = [self.device.view(slot) for slot in tokens.device_logits]
                return views[0] if len(views) == 1 else _device_concatenate(views)
        except (OSError, ValueError, RuntimeError) as e:  # a segment gone or not ours, no CuPy: an SDK error
            raise EmberError(f"cannot read the logits the daemon shared: {e}", "logits") from e
        return None

    def releases(self, request_id: int, held: HeldSlots) -> list[Release]:
        """The Release messages for a chunk's slots, once the client is done with them (the GPU's work
        on device views is waited for first: the daemon writes a released slot again)."""
        out = [Release(request_id, tuple(held.host))] if held.host else []
        if held.device:
            self.device.finish()
            out.append(Release(request_id, tuple(held.device), True))
        return out

    def close(self) -> None:
        self.shm.close()
        self.device.close()


@dataclass
class HeldSlots:
    """The logits slots of the chunk a stream handed out last, released when it advances."""
    host: list[int] = field(default_factory=list)
    device: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, tokens: Tokens) -> HeldSlots:
        return cls([s.slot for s in tokens.logits or ()], [s.slot for s in tokens.device_logits or ()])


def _device_concatenate(views: list[Any]) -> Any:
    import cupy  # noqa: PLC0415 - the views are CuPy's: it is there

    return cupy.concatenate(views)


def chunk_from(tokens: Tokens, reader: LogitsReader) -> Chunk:
    logits = reader.logits(tokens)
    top = None
    if tokens.top_logprobs is not None:
        top = [[(t.token, t.logprob) for t in alternatives] for alternatives in tokens.top_logprobs]
    return Chunk(list(tokens.token_ids), tokens.text, list(tokens.logprobs) if tokens.logprobs is not None else None,
                 top, logits)


def end_of_stream(reply: Finished | Error) -> Finished:
    """The Finished of a stream, or the exception that ends it instead."""
    if isinstance(reply, Error):
        raise error_from(reply)
    if reply.reason == FinishReason.ERROR:
        raise GenerationFailed(reply.message or "the generation failed")
    return reply
