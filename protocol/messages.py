"""Every message that crosses the daemon's socket, as msgspec Structs.

Shape of the wire (docs/protocol.md has the full story):
- one message per ZMQ frame, msgpack-encoded; each message is an array whose first element is its tag
  (tagged unions with `array_like=True`), so one typed decoder dispatches on the tag;
- every client message's second element is `id`, a client-chosen integer: a reply carries the id of the
  request it answers, a Generate's id names its stream until Finished (or Error);
- fields are positional, so they are only ever appended, with defaults (see VERSIONING below).

These types are frozen values. The daemon never keeps them as state: it validates a message and builds
its own Request from it.
"""
from __future__ import annotations

from typing import Union

import msgspec

PROTOCOL_VERSION = 1

VERSIONING = """\
A peer that receives an array with more elements than it knows ignores the extra trailing ones, and a
missing trailing element takes its default. So, without a version bump, a new version may only:
  - append fields, with a default that keeps the old meaning, to the end of a message;
  - add message types (an older daemon answers an unknown tag with Error{code: "bad_message"});
  - add error codes and finish reasons (clients treat an unknown code as a generic error).
Anything else (removing, reordering or retyping a field, changing a meaning) bumps PROTOCOL_VERSION, and
a daemon answers a Hello with another version with Error{code: "version"}."""


class Wire(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """Base of all wire types: immutable, positional (msgpack arrays), never part of a reference cycle."""


# --- error codes and finish reasons: short stable strings (an unknown one decodes fine) ----------
class ErrorCode:
    BAD_MESSAGE = "bad_message"  # not decodable: bytes, msgpack, types, unknown tag, extra frames
    BAD_REQUEST = "bad_request"  # decodable but meaningless: no prompt, bad sampling value, token id out of range
    LIMIT = "limit"  # over a hard limit: prompt length, max_tokens, stop strings, requests per client
    CONTEXT_LENGTH = "context_length_exceeded"  # a prompt longer than the model's context (OpenAI's code)
    BUSY = "busy"  # the daemon's queue is full: retry later
    UNKNOWN_MODEL = "unknown_model"  # no such model loaded (or several loaded and none named)
    DUPLICATE_ID = "duplicate_id"  # a Generate reused the id of this client's request still running
    VERSION = "version"  # Hello with a protocol version this daemon does not speak
    SHUTTING_DOWN = "shutting_down"  # the daemon is draining and takes no new work
    INTERNAL = "internal"  # a bug in the daemon; the request is gone, the daemon goes on


class FinishReason:
    STOP = "stop"  # end-of-sequence token, a stop id or a stop string
    LENGTH = "length"  # max_tokens reached or the context is full
    CANCELLED = "cancelled"  # Cancel, a client that went away, or the daemon shutting down
    ERROR = "error"  # the request failed after it started (message says why)


# --- pieces ----------------------------------------------------------------------------------------
class ToolCall(Wire):
    """A function call the assistant made (in a chat's history): arguments as JSON text."""
    id: str
    name: str
    arguments: str = "{}"


class ChatMessage(Wire):
    role: str  # system, user, assistant or tool
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str = ""  # a tool message: the call it answers
    name: str = ""  # a tool message: the function that answered


class Tool(Wire):
    """A function the model may call: rendered by the model's chat template (its `tools`)."""
    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'  # a JSON schema, as JSON text


class ToolChoice:
    AUTO = "auto"  # the model decides; its calls are parsed from its text
    NONE = "none"  # no tools in the prompt, no calls
    REQUIRED = "required"  # at least one call (of Generate.tool_name where given), enforced by a grammar


class Grammar(Wire):
    """What a generation's text must follow (constrained decoding): the kind, and its text."""
    # "json_schema", "json" (any JSON object; text unused), "regex", "choice" (a JSON list of strings),
    # "lark" or "gbnf"
    kind: str
    text: str = ""


class ModelInfo(Wire):
    name: str
    arch: str
    vocab: int
    context_length: int
    chat_template: bool = False
    # how its chat template has it write tool calls ("hermes", "llama3", "mistral", "gemma4"; client/tool_calls.py
    # parses them); "" where the template renders no tools
    tool_format: str = ""


class TopLogprob(Wire):
    token: int
    logprob: float


class ShmSlot(Wire):
    """Where one block of logits lies: `offset` bytes into POSIX shared-memory `segment` (a name under
    /dev/shm), an array of `shape` and `dtype` (little-endian "f32"). The slot stays valid until the
    client sends Release for it."""

    segment: str
    slot: int
    offset: int
    shape: tuple[int, ...]
    dtype: str = "f32"


class DeviceSlot(Wire):
    """Where one block of logits lies on a GPU (protocol/device_ring.py): `offset` bytes into the CUDA
    allocation of `ring_bytes` whose IPC handle is `memory` (a cudaIpcMemHandle_t, 64 bytes), on the
    device with PCI bus id `bus_id`; an array of `shape` and `dtype`. `event` is the slot's interprocess
    event (a cudaIpcEventHandle_t), recorded after the write: the reader's stream waits on it before
    reading. The slot stays valid until the client sends Release (device=True) for it."""

    memory: bytes
    ring_bytes: int
    bus_id: str
    slot: int
    offset: int
    shape: tuple[int, ...]
    event: bytes
    dtype: str = "f32"


class Usage(Wire):
    prompt_tokens: int
    completion_tokens: int


class Timings(Wire):
    queued_ms: float = 0.0  # admitted -> first forward pass
    prefill_ms: float = 0.0  # first forward pass -> first token
    decode_ms: float = 0.0  # first token -> finished
    total_ms: float = 0.0  # admitted -> finished


# --- client -> daemon ------------------------------------------------------------------------------
class Hello(Wire, tag="hello"):
    id: int
    protocol: int
    client: str = ""  # free text for the daemon's log, e.g. "ember-sdk/0.1.0"


class Generate(Wire, tag="generate"):
    id: int
    model: str = ""  # "" = the only loaded model
    prompt: str | None = None  # exactly one of prompt, token_ids, messages
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None  # rendered with the model's chat template
    max_tokens: int = 256
    # None: the model's recommended value (its file's, else llama.cpp's: daemon/text/sampling_defaults.py)
    temperature: float | None = 0.0  # 0 = greedy
    top_k: int | None = 0
    top_p: float | None = 1.0
    min_p: float | None = 0.0
    repetition_penalty: float | None = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text stops before the first one found
    stop_ids: tuple[int, ...] = ()  # stop token ids (the token is reported)
    ignore_eos: bool = False
    return_logits: bool = False  # each step's logits through the client's shared-memory ring
    logprobs: bool = False  # the chosen token's log-probability with each token
    top_logprobs: int = 0  # and that many alternatives
    logit_bias: dict[int, float] = {}
    grammar: Grammar | None = None  # the text follows it; the end comes where it is complete
    tools: tuple[Tool, ...] = ()  # for a chat (messages): rendered by its template, for the model to call
    tool_choice: str = ToolChoice.AUTO  # ToolChoice
    tool_name: str = ""  # with tool_choice required: the one function to call
    parallel_tool_calls: bool = True  # with tool_choice required: more than one call may come
    # each step's logits in a CUDA IPC ring on the model's GPU (Tokens.device_logits), instead of
    # return_logits' shared memory: for a client on the same machine with CuPy; a model on a GPU only
    device_logits: bool = False


class Cancel(Wire, tag="cancel"):
    id: int  # the Generate to stop; cancelling an unknown or finished id does nothing


class Hold(Wire, tag="hold"):
    """The client cannot take this Generate's output now (held) or can again: the daemon stops running it
    and lets others have its place, keeping what it has (a stream held longer than the daemon's stall
    timeout ends with an error). For a client serving many streams on one connection (the gateway),
    where pausing the whole connection would stop the others."""
    id: int
    held: bool = True


class Release(Wire, tag="release"):
    id: int  # the Generate whose logits these were
    slots: tuple[int, ...]
    device: bool = False  # slots of the client's CUDA IPC ring (device_logits), not of its shared memory


class Tokenize(Wire, tag="tokenize"):
    id: int
    text: str
    model: str = ""
    add_special: bool = True


class Detokenize(Wire, tag="detokenize"):
    id: int
    token_ids: tuple[int, ...]
    model: str = ""


class ListModels(Wire, tag="list_models"):
    id: int


class Health(Wire, tag="health"):
    id: int


class Stats(Wire, tag="stats"):
    id: int


ClientMessage = Union[Hello, Generate, Cancel, Hold, Release, Tokenize, Detokenize, ListModels, Health, Stats]


# --- daemon -> client ------------------------------------------------------------------------------
class Welcome(Wire, tag="welcome"):
    id: int
    protocol: int
    server: str  # "ember/<version>"
    models: tuple[ModelInfo, ...] = ()
    max_message_bytes: int = 0  # the daemon's limit on one message (0: not announced, older daemons)


class Tokens(Wire, tag="tokens"):
    """New tokens of a Generate and the text they add (possibly "" while a UTF-8 character or a
    possible stop string is held back; a last Tokens may carry only text)."""

    id: int
    token_ids: tuple[int, ...]
    text: str = ""
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[TopLogprob, ...], ...] | None = None
    logits: tuple[ShmSlot, ...] | None = None  # one per token, shape [1, vocab]
    device_logits: tuple[DeviceSlot, ...] | None = None  # the same, on the GPU (Generate.device_logits)


class Finished(Wire, tag="finished"):
    """The last frame of a Generate that started; `message` explains reason "error"."""

    id: int
    reason: str
    usage: Usage
    timings: Timings = Timings()
    message: str = ""


class Error(Wire, tag="error"):
    """A request refused or failed before producing anything; for a Generate it ends the stream.
    `id` is None when the message could not be read far enough to find one."""

    id: int | None
    code: str
    message: str


class TokenIds(Wire, tag="token_ids"):
    id: int
    token_ids: tuple[int, ...]


class Text(Wire, tag="text"):
    id: int
    text: str


class Models(Wire, tag="models"):
    id: int
    models: tuple[ModelInfo, ...]


class HealthStatus(Wire, tag="health_status"):
    id: int
    status: str  # "ok" or "draining"
    uptime_s: float


class StatsReport(Wire, tag="stats_report"):
    id: int
    uptime_s: float
    clients: int  # clients with requests or a logits ring
    active: int  # requests being generated (in the running batch)
    queued: int  # admitted, not running yet (waiting for KV blocks, a batch slot or the engine)
    requests_total: int
    tokens_total: int
    cancelled_total: int
    busy_total: int  # Generates refused with "busy"
    errors_total: int  # Error replies of any code
    kv_blocks_used: int = 0  # KV cache blocks held by sequences (or cached, evictable prefixes: free)
    kv_blocks_free: int = 0
    prefix_hit_rate: float = 0.0  # share of full prompt blocks found in the prefix cache
    preemptions: int = 0  # sequences evicted for KV memory and recomputed later
    tokens_per_s: float = 0.0  # generated tokens per second over the last 10 s
    # MoE models (all of them together; 0 without any): experts hot of all, the share of routed
    # (token, expert) slots computed cold (or dropped, under cold_policy "mask"), experts promoted by
    # swaps, and cold-expert workers restarted after dying
    hot_experts: int = 0
    total_experts: int = 0
    cold_share: float = 0.0
    expert_swaps: int = 0
    cold_worker_restarts: int = 0
    spec_acceptance_rate: float = 0.0  # speculative decoding: share of draft tokens the models kept
    spec_mean_accepted_length: float = 0.0  # tokens per verification pass, the target's own one included (0: none)
    spec_plain_tokens: int = 0  # tokens decoded without speculating although a draft was loaded (it measured slower)
    spec_saved_s_per_token: float = 0.0  # what speculating saves a token, as last measured (negative: costs; 0: unknown)
    prefix_hits: int = 0  # full prompt blocks found in the prefix cache (not computed again), since the start
    held: int = 0  # requests held now because their clients take no output (a full backlog, Hold, a full ring)
    spec_mean_proposals: float = 0.0  # the k speculation chose: draft tokens a verification pass checked (0: none)


class Ping(Wire, tag="ping"):
    """Sent to a client with requests in flight when nothing else was sent to it for a while: a
    liveness probe for the daemon (a vanished client makes the send fail) and a keep-alive for the
    client's timeouts. Clients ignore it."""


ServerMessage = Union[Welcome, Tokens, Finished, Error, TokenIds, Text, Models, HealthStatus, StatsReport, Ping]
