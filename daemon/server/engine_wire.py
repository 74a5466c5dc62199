"""The messages between the daemon's front process and its engine process (engine_host.py,
engine_main.py): msgspec Structs, one msgpack frame each over the socketpair the engine inherits
(ember.daemon.channel). Never pickled; never seen by clients (protocol/ is theirs).

A request crosses once, as AddSequence (its prompt already tokenized and checked by the front); what
comes back per step is token ids, the chosen tokens' logprobs and the descriptors of logits rows the
engine wrote into the client's shared-memory ring. Requests are named by the front's sequence id.
"""
from __future__ import annotations

from typing import Union

import msgspec

from ember.daemon.config import Config
from ember.daemon.server.engine_thread import EngineStats
from ember.kernels.sampling import Choice, SamplingParams
from ember.protocol.messages import DeviceSlot, ShmSlot


class EngineWire(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, tag=True, gc=False):
    """Base of the front <-> engine messages."""


# --- front -> engine ---------------------------------------------------------------------------------
class AddSequence(EngineWire):
    """A request to run: its client, the client's id for it, and the engine's Sequence fields."""
    seq_id: int
    client: bytes
    request_id: int
    model: str
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int | None
    stop_ids: list[int]
    wants_logits: bool = False
    wants_logprob: bool = False
    grammar: str | None = None  # llguidance's grammar text, checked by the front
    cache_salt: bytes = b""
    user: int = -1  # the client's Unix user
    device_logits: bool = False  # wants_logits through the client's CUDA IPC ring


class CancelRequest(EngineWire):
    """End a client's request; the engine reports it Finished{cancelled}."""
    client: bytes
    request_id: int


class FinishSequence(EngineWire):
    """The front ended the request itself (a stop string): free its sequence, report nothing."""
    seq_id: int
    reason: str


class DropClient(EngineWire):
    client: bytes


class PauseClient(EngineWire):
    client: bytes
    paused: bool


class HoldRequest(EngineWire):
    """A client's Hold of one of its requests."""
    client: bytes
    request_id: int
    held: bool


class ReleaseSlots(EngineWire):
    client: bytes
    slots: list[int]
    device: bool = False  # of the client's CUDA IPC ring


class Shutdown(EngineWire):
    drain_timeout: float


EngineCommand = Union[AddSequence, CancelRequest, FinishSequence, DropClient, PauseClient, HoldRequest, ReleaseSlots,
                      Shutdown]


# --- engine -> front ---------------------------------------------------------------------------------
class SeqProgress(EngineWire):
    """What one step did to one request (engine_thread.Progress, by sequence id)."""
    seq_id: int
    tokens: list[int] = []
    choices: list[Choice] = []
    logits: tuple[ShmSlot, ...] | None = None
    finish: str | None = None
    error: str | None = None
    message: str = ""
    started: float | None = None  # perf_counter() when it first ran (one clock for both processes)
    device_logits: tuple[DeviceSlot, ...] | None = None


class StepNews(EngineWire):
    progress: list[SeqProgress]
    stats: EngineStats | None = None  # the stats after the step, when a client should see them now


class StatsUpdate(EngineWire):
    stats: EngineStats


class Heartbeat(EngineWire):
    """The engine loop is turning (the front pets systemd's watchdog for it)."""


class StartStatus(EngineWire):
    """Loading progress, for systemd's STATUS=."""
    text: str


class Ready(EngineWire):
    pid: int


class StartFailed(EngineWire):
    """The engine could not load its models; `path` names the file when the file was the problem."""
    message: str
    path: str = ""
    reason: str = ""


class Stopped(EngineWire):
    """The engine loop ended: drained after a Shutdown, or crashed on an internal error."""
    crashed: bool = False


EngineReport = Union[StepNews, StatsUpdate, Heartbeat, StartStatus, Ready, StartFailed, Stopped]


class EngineLaunch(msgspec.Struct, frozen=True):
    """Everything the engine process is started with, resolved once by the front (it reads no
    environment of its own for these): the configuration, the precision the plan used, and how its
    logits rings are made."""
    config: Config
    kv_dtype: str
    act_dtype: str
    feature_dtypes: dict[str, str]  # model name -> its feature mirror's dtype
    shm_owner: str  # names the logits segments after the daemon's socket (protocol/shm_ring.py)
    ring_mode: int = 0o600
    ring_group: int | None = None
    heartbeat_interval: float | None = None  # seconds between Heartbeats (systemd's watchdog), None: none
    cache_dir: str = ""  # ember's cache directory (routing statistics), as the front resolved it; "": the default


command_decoder = msgspec.msgpack.Decoder(EngineCommand)  # what the engine takes
report_decoder = msgspec.msgpack.Decoder(EngineReport)  # what the front takes
