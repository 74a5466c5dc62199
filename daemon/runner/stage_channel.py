"""The channels of a layer split: msgspec Structs, one length-prefixed msgpack frame each, over Unix
socketpairs. Each stage worker inherits two kinds: its control channel to the engine's process, and
a link to each neighbouring stage, which a micro-batch's Run travels on from the stage that finished
it to the one that runs it next (runner/pipeline.py): the engine hands a step to the first stage and
hears back from the last, and no hop in between waits on it.

Only small things travel here — a step's metadata (token ids, positions, block tables: a few KiB)
and the names of shared-memory segments; hidden states and logits go through shared memory
(runner/staging.py). Nothing is pickled: a worker decodes exactly these types and nothing else.
Blocking reads are the signal (no polling): a worker sleeps until its next command or micro-batch,
and the engine's process waits on every stage's control socket at once.
"""
from __future__ import annotations

import msgspec
import numpy as np

from ember.daemon.step.step_batch import StepBatch
from ember.kernels.convert import DEFAULT_PROMPT_ACT

class _Msg(msgspec.Struct, frozen=True, array_like=True, tag=True):
    pass


class Setup(_Msg):
    """The worker's first message: what to load and where its hidden states come from and go."""
    model: str  # path of the GGUF file or HF directory; the worker maps it itself
    first: int  # [first, end) layers of the model this stage runs
    end: int
    numa_node: int  # cpu:N's N: the worker binds itself to that node's CPUs where the node exists
    threads: int  # kernel threads of this stage
    act_dtype: str  # staging dtype of the hidden states: f32, f16 or bf16
    max_tokens: int  # tokens of one micro-batch at most (a staging slot's rows)
    inbox: str  # shared-memory segment of the boundary before this stage ("" for the first)
    outbox: str  # of the boundary after it, or the logits segment for the last stage
    cpus: list[int] = []  # CPUs to pin the worker to, within its node (runner/stage_worker.stage_cpus); []: the node's
    # "cpu" (the worker binds to numa_node) or "cuda:0": the GPU the engine made the worker's only
    # visible one (CUDA_VISIBLE_DEVICES), so a stage on cuda:N runs its kernels on cuda:0 of its own
    device: str = "cpu"
    prompt_act: str = DEFAULT_PROMPT_ACT  # activations of prompt rows against quantized weights (kernels/convert.py)


class Ready(_Msg):
    pid: int
    numa: str  # how the binding went, in words (logged by the engine's process)


class NewCache(_Msg):
    cache: int  # the runner's id for it: one KV cache per engine over the same weights
    blocks: int
    block_size: int
    dtype: str


class DropCache(_Msg):
    cache: int


class Batch(_Msg):
    """A StepBatch's arrays as raw little-endian bytes in fixed dtypes (BATCH_DTYPES)."""
    ids: bytes
    positions: bytes
    token_seq: bytes
    kv_blocks: bytes
    kv_offsets: bytes
    tables: bytes
    table_width: int
    logit_rows: bytes
    decode_rows: bytes


class Run(_Msg):
    """A micro-batch, from the engine to the first stage and on from each stage to the next."""
    micro_batch: int  # the engine's number for it, echoed in Done / Failed
    cache: int
    batch: Batch
    # its lane (Pipeline.lanes): the staging slot it crosses every boundary in, and the last stage's
    # logits region; a lane is reused only after its micro-batch was collected, so no slot is
    # written while a stage may still read it
    lane: int
    seconds: list[float] = []  # each stage's own time on it so far, in stage order
    error: str = ""  # a stage failed it: the stages after pass it on untouched
    failed_at: int = -1  # which stage


class Done(_Msg):
    micro_batch: int
    seconds: list[float] = []  # per stage, its own time on the micro-batch


class Failed(_Msg):
    micro_batch: int  # -1: not about a micro-batch (setup failed)
    error: str
    stage: int = -1  # the stage that failed the micro-batch (the last one replies for all)


class Stop(_Msg):
    pass


Message = Setup | Ready | NewCache | DropCache | Run | Done | Failed | Stop
DECODER = msgspec.msgpack.Decoder(Message)  # what a stage channel carries (ember.daemon.channel.Channel)

BATCH_DTYPES = {"ids": np.int64, "positions": np.int64, "token_seq": np.int32, "kv_blocks": np.int64,
                "kv_offsets": np.int64, "tables": np.int32, "logit_rows": np.int64, "decode_rows": np.bool_}


def pack_batch(batch: StepBatch) -> Batch:
    raw = {name: np.ascontiguousarray(getattr(batch, name), dtype).tobytes() for name, dtype in BATCH_DTYPES.items()}
    return Batch(table_width=int(np.shape(batch.tables)[1]), **raw)


def unpack_batch(b: Batch) -> StepBatch:
    arrays = {name: np.frombuffer(getattr(b, name), dtype) for name, dtype in BATCH_DTYPES.items()}
    arrays["tables"] = arrays["tables"].reshape(-1, b.table_width)
    return StepBatch(**arrays)
