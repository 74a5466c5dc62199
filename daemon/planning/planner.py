"""The memory planner: from a model's metadata alone — GGUF header or config.json and safetensors
headers, never a weight byte — the bytes each device needs: weights by class, KV cache, activation
reservation, CUDA-graph headroom, layer-split staging, the speculative feature mirror, a draft
model's weights, KV cache and proposals, and what remains for hot MoE experts. `Plan.check()` refuses a plan that does not fit with a message naming
the device, the component to blame and what to change. docs/planner.md has the formulas and the
JSON schema; benchmarks/planner_calibration.py measured the activation safety factor.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.loader.model_file import ModelFile, open_model_file
from ember.daemon.planning.precision import DeviceCaps, PrecisionPolicy, PrecisionSettings, resolve_policy
from ember.kernels.convert import storage_bytes
from ember.daemon.step.defaults import KV_BLOCK, PREFILL_CHUNK
from ember.daemon.step.window_ring import ring_for
from ember.daemon.planning.staging_bytes import boundary_bytes, logits_rows_bytes  # what the split runner allocates

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SCHEMA = "ember.plan/1"
# The safety factor, from measurement (benchmarks/planner_calibration.py, docs/planner.md): the CPU
# runtime's step peaks in the FFN holding, per token, 3 widest-sized buffers (gate, up, their product)
# and 3 hidden-sized ones (the block's input and output, the norm) in f32 — to the KiB on every shape
# measured. Over widest x tokens x bytes that is 3 + 3 hidden/widest: 3.5 (Qwen2.5, hidden/ffn 0.17)
# to 4.125 (Llama 3.2 3B, 0.375), too wide a spread for one constant to stay within 10%, so the
# factor is that structure times a 2% margin. PlanRequest.act_safety overrides it with a number.
ACT_WIDEST_BUFFERS, ACT_HIDDEN_BUFFERS, ACT_MARGIN = 3, 3, 1.02
# numpy sampling of one row (top-k/top-p/min-p, penalties: float64 softmax, a sort, a cumsum)
# peaked at 11.3 vocab-sized f32 rows under tracemalloc; greedy at 5.0
SAMPLER_ROWS = 12
ACT_CAP = {"cpu": 2 * GiB, "cuda": 1 * GiB}  # also the reservation when the dimensions are unknown
GRAPH_HEADROOM = {"cpu": 0, "cuda": 256 * MiB}  # captured decode graphs' private pool (estimate)
WEIGHT_CLASSES = ("embeddings", "attention", "dense_ffn", "experts", "output", "other")


class PlanError(ValueError):
    """The plan cannot be computed (a bad device spec, a context beyond the model's)."""


class PlanDoesNotFit(ValueError):
    """The model does not fit the given devices; the message says where, why and what to change."""

    def __init__(self, plan: Plan, message: str) -> None:
        super().__init__(message)
        self.plan = plan


# --- what the planner reads ---------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    name: str  # a GGUF name, or a Hugging Face one (both are classified)
    shape: tuple[int, ...]
    nbytes: int  # in the file


@dataclass(frozen=True)
class ModelHeaders:
    """What the planner reads of a model: its config and its tensors' names, shapes and types (no data)."""

    path: str
    format: str  # "gguf" or "hf"
    config: ModelConfig
    tensors: tuple[TensorInfo, ...]


def read_model_info(path: str | Path) -> ModelHeaders:
    """Config and tensor sizes from headers. GGUF: gguf-py parses the header and maps the data without
    touching it (RawTensor.nbytes is arithmetic on shape and type); HF: safetensors headers, read
    again here unrenamed so that MoE expert tensors, which the runtime's renaming drops, count."""
    return headers_of(open_model_file(path))


def headers_of(mf: ModelFile) -> ModelHeaders:
    """read_model_info of a model file already open."""
    if mf.format == "hf":
        from ember.daemon.loader.hf_dir import _read_safetensors, _shards  # the loader's own header parser

        raws = [t for shard in _shards(mf.path) for t in _read_safetensors(shard).values()]
    else:
        raws = list(mf.tensors.values())
    tensors = tuple(TensorInfo(t.name, tuple(t.shape), t.nbytes) for t in raws)
    return ModelHeaders(str(mf.path), mf.format, mf.config, tensors)


def weight_class(name: str) -> str:
    if name in ("token_embd.weight", "model.embed_tokens.weight", "per_layer_token_embd.weight",
                "model.embed_tokens_per_layer.weight", "model.language_model.embed_tokens_per_layer.weight"):
        return "embeddings"  # gemma4's per-layer embedding table too
    if name in ("output.weight", "output_norm.weight", "lm_head.weight", "model.norm.weight"):
        return "output"
    if "_exps." in name or ".experts." in name:  # GGUF ffn_*_exps; HF mlp.experts.N / block_sparse_moe.experts.N
        return "experts"
    if layer_of(name) is None:
        return "other"
    if (".attn_" in name or ".self_attn." in name or name.endswith(".input_layernorm.weight")
            or ".ssm_" in name or ".linear_attn." in name):  # hybrids' linear attention: the layer's token mixer
        return "attention"
    if any(k in name for k in (".ffn_", ".mlp.", ".block_sparse_moe.", ".post_attention_layernorm.")):
        return "dense_ffn"  # dense FFNs, MoE routers and shared experts: resident, run for every token
    return "other"


def layer_of(name: str) -> int | None:
    m = re.match(r"(?:blk|model\.layers)\.(\d+)\.", name)
    return int(m.group(1)) if m else None


# --- what the caller asks -----------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    name: str  # "cpu" or "cuda:N"
    budget: int  # bytes the plan may use there
    compute_capability: tuple[int, int] | None = None

    @property
    def kind(self) -> str:
        # cpu, cpu:N (a split's stage process) or cuda:N; ray:N/cpu, a stage on a Ray node, plans as a
        # CPU (its node's memory, which the plan takes to be this host's: docs/cluster.md)
        kind = self.name.split(":")[0]
        return "cpu" if kind == "ray" else kind

    @property
    def caps(self) -> DeviceCaps:
        return DeviceCaps.of(self.name, self.compute_capability)


@dataclass(frozen=True)
class SpeculativeSettings:
    # target hidden states captured per position for a feature-conditioned draft: len(dflash.target_layers)
    feature_layers: int = 3


@dataclass(frozen=True)
class DraftModel:
    """A draft model for speculative decoding (daemon/speculative/): it runs on the target's device,
    with a KV cache of as many blocks as the target's, in the same dtype."""
    headers: ModelHeaders
    tokens: int = 4  # proposals per step (draft_tokens)


@dataclass(frozen=True)
class PlanRequest:
    devices: tuple[Device, ...]
    policy: PrecisionPolicy
    ctx: int | None = None  # tokens per sequence; None: the model's context length
    seqs: int = 1  # sequences resident at once (each holds ctx tokens of KV)
    prefill_chunk: int = PREFILL_CHUNK
    kv_block: int = KV_BLOCK
    split: tuple[int, ...] | None = None  # layers per device; None: proportional to the budgets
    speculative: SpeculativeSettings | None = None
    # tokens proposed a step without a draft model (n-gram lookup, draft "ngram"): their logits rows only
    proposals: int = 0
    expert_offload: bool = False  # CUDA devices keep only the experts that fit; the rest run on CPU workers
    # hot experts' bytes at most, on any device: bytes, a size ("2GiB") or "N%" of the experts; the rest
    # are cold (CPU workers); None: no bound but the device's room (and that only with expert_offload)
    expert_budget: int | str | None = None
    act_safety: float | None = None  # None: act_safety_for(model), measured; a number overrides it
    act_cap: int | None = None  # None: ACT_CAP of each device's kind
    graph_headroom: int | None = None  # None: GRAPH_HEADROOM of each device's kind
    cpu_threads: int | None = None  # the engine's kernel threads; None: one per core

    def __post_init__(self) -> None:
        if not self.devices:
            raise PlanError("no devices")
        for name in ("seqs", "prefill_chunk", "kv_block"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ctx is not None and self.ctx < 1:
            raise PlanError(f"ctx must be >= 1, got {self.ctx}")
        if self.split is not None and len(self.split) != len(self.devices):
            raise PlanError(f"split gives {len(self.split)} layer counts for {len(self.devices)} devices")

    @classmethod
    def create(cls, devices: Sequence[Device], config: PrecisionSettings | None = None,
               flags: PrecisionSettings | None = None, env: Mapping[str, str] | None = None, **options: Any) -> PlanRequest:
        """A request whose precision policy is resolved for `devices` (precision.resolve_policy)."""
        policy = resolve_policy([d.caps for d in devices], config, env, flags)
        return cls(devices=tuple(devices), policy=policy, **options)


# --- the plan -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightBytes:
    embeddings: int = 0
    attention: int = 0
    dense_ffn: int = 0
    experts: int = 0
    output: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class ActivationReservation:
    bytes: int  # what the plan reserves
    rule: str  # "estimate"; "cap": the estimate exceeded the cap; "fallback": dimensions missing
    estimate: int | None  # max(buffers, logits + sampler) + scratch
    cap: int
    widest: int  # values per token of the widest activation buffer
    tokens: int  # tokens per step: max(sequences, prefill chunk)
    elem_bytes: int
    safety: float
    buffers: int  # widest x tokens x elem_bytes x safety: the layers' transient buffers
    logits: int  # sequences x vocab x 4 (on the device that computes the output projection)
    sampler: int  # SAMPLER_ROWS x vocab x 4 beside the logits (CPU, last device)
    scratch: int  # CPU kernels' per-thread scratch: threads x (16 dequantized rows of widest + ctx) x 4


@dataclass(frozen=True)
class DevicePlan:
    device: Device
    layers: tuple[int, int]  # [first, end)
    weights: WeightBytes
    kv_cache: int
    activations: ActivationReservation
    graph_headroom: int
    staging: int
    feature_mirror: int
    offloads_experts: bool  # only the experts that fit stay here (CUDA with expert offload, or a budget)
    expert_bytes: int = 0  # one expert's bytes (all its tensors in one layer); 0 for dense models
    expert_cap: int | None = None  # this device's share of the request's expert_budget, in bytes
    # hybrid models: the linear-attention layers' recurrent state (conv window + DeltaNet state,
    # float32) of every resident sequence; fixed per sequence, whatever the context
    recurrent_state: int = 0
    draft_weights: int = 0  # a draft model's (DraftModel), as the target's are counted
    draft_kv_cache: int = 0  # its KV cache: the target's blocks, its own layers, heads and head size
    draft_proposals: int = 0  # the distributions sampled proposals were drawn from: seqs x tokens x vocab float64

    @property
    def fixed(self) -> int:
        """Everything but the experts."""
        return (self.weights.total - self.weights.experts + self.kv_cache + self.recurrent_state + self.activations.bytes
                + self.graph_headroom + self.staging + self.feature_mirror + self.draft)

    @property
    def draft(self) -> int:
        return self.draft_weights + self.draft_kv_cache + self.draft_proposals

    @property
    def required(self) -> int:
        return self.fixed + (0 if self.offloads_experts else self.weights.experts)

    @property
    def experts_hot(self) -> int:
        """Expert bytes resident here: all of them, or with offload whole experts filling what remains."""
        if not self.offloads_experts:
            return self.weights.experts
        room = max(0, min(self.weights.experts, self.device.budget - self.fixed))
        if self.expert_cap is not None:
            room = min(room, self.expert_cap)
        return room - room % self.expert_bytes if self.expert_bytes else 0

    @property
    def free(self) -> int:
        return self.device.budget - self.fixed - self.experts_hot

    @property
    def fits(self) -> bool:
        return self.required <= self.device.budget

    def components(self) -> dict[str, int]:
        w = self.weights
        return {"weights": w.total - w.experts, "experts": w.experts if not self.offloads_experts else self.experts_hot,
                "kv_cache": self.kv_cache, "recurrent_state": self.recurrent_state, "activations": self.activations.bytes,
                "graph_headroom": self.graph_headroom, "staging": self.staging, "feature_mirror": self.feature_mirror,
                "draft": self.draft}


@dataclass(frozen=True)
class Plan:
    model: ModelHeaders = field(repr=False)
    request: PlanRequest
    ctx: int
    devices: tuple[DevicePlan, ...]
    draft: DraftModel | None = field(default=None, repr=False)

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    def check(self) -> None:
        """Raise PlanDoesNotFit, with the readable message, unless every device fits."""
        if not self.fits:
            raise PlanDoesNotFit(self, explain(self))


def plan_model(path: str | Path, request: PlanRequest, draft: str | Path | None = None, draft_tokens: int = 4) -> Plan:
    """The plan for the model at `path` (GGUF file or HF directory), with the draft model at `draft`
    proposing `draft_tokens` a step if given; reads headers only."""
    return build_plan(read_model_info(path), request,
                      None if draft is None else DraftModel(read_model_info(draft), draft_tokens))


def build_plan(info: ModelHeaders, request: PlanRequest, draft: DraftModel | None = None) -> Plan:
    cfg, devices = info.config, request.devices
    ctx = request.ctx or cfg.context_length
    if ctx > cfg.context_length:
        raise PlanError(f"ctx {ctx} exceeds the model's context length {cfg.context_length}")
    kv_dtype = request.policy.kv
    if kv_dtype == "q8_0" and any(cfg.head_dim_at(i) % 32 for i in range(cfg.n_layers)):
        raise PlanError(f"a q8_0 KV cache needs head_dim divisible by 32; this model's is "
                        f"{cfg.head_dim if not cfg.layer_head_dims else sorted(set(cfg.layer_head_dims))}")
    if draft is not None:
        _check_draft(draft, cfg, request)
    bounds = split_layers(cfg.n_layers, devices, request.split, LayerWeights.of(info))
    weights = _weights_by_device(info, bounds, devices)
    kv_tokens = -(-ctx // request.kv_block) * request.kv_block * request.seqs
    kv = _kv_by_layer(cfg, request, kv_tokens)
    plans = []
    for i, (dev, (first, end)) in enumerate(zip(devices, bounds, strict=True)):
        last = i == len(devices) - 1
        plans.append(DevicePlan(
            device=dev, layers=(first, end), weights=weights[i],
            kv_cache=sum(kv[first:end]),
            recurrent_state=(end - first - _attention_layers(cfg, first, end)) * _state_per_layer(cfg) * request.seqs,
            # with a draft (or n-grams), each sequence's step has logits for its last token and every proposal
            activations=activation_reservation(cfg, request, dev, ctx, logits_rows=(
                request.seqs * (1 + (draft.tokens if draft else request.proposals)) if last else 0)),
            graph_headroom=_per_kind(request.graph_headroom, GRAPH_HEADROOM, dev),
            # a boundary's buffers live on the device that receives the hidden states, a slot per
            # micro-batch in flight (one per stage); a step moves at most prefill_chunk tokens
            # (engine.max_step_tokens): a long prompt crosses in chunks
            staging=(boundary_bytes(cfg.hidden, request.prefill_chunk, request.policy.act, len(devices))
                     if i > 0 else 0)
            # a last stage in a worker hands the step's logits rows back through a segment of its own,
            # one region per micro-batch in flight (one per stage); the engine's own (plain cpu) need not
            + (logits_rows_bytes(cfg.vocab, request.prefill_chunk, len(devices))
               if last and i > 0 and dev.name != "cpu" else 0),
            feature_mirror=_feature_mirror(cfg, request, draft, kv_tokens) if last else 0,
            offloads_experts=(request.expert_offload and dev.kind == "cuda") or request.expert_budget is not None,
            expert_bytes=_expert_bytes(info),
            expert_cap=_expert_cap(request.expert_budget, weights[i].experts, sum(w.experts for w in weights)),
            # the draft sits where the logits are sampled: the one device, or beside a split's last (CPU) stage
            **(_draft_bytes(draft, request, kv_tokens, dev) if draft is not None and last else {}),
        ))
    return Plan(info, request, ctx, tuple(plans), draft)


def _check_draft(draft: DraftModel, cfg: ModelConfig, request: PlanRequest) -> None:
    d = draft.headers.config
    if len(request.devices) > 1:
        if d.arch == "dflash":
            raise PlanError("a feature-conditioned (DFlash) draft reads the target's hidden states, which a layer "
                            "split keeps in its stage processes: plan the target on one device, or use a draft model")
        if request.devices[-1].kind != "cpu":
            raise PlanError(f"a draft beside a layer split runs in the engine's process on the host CPU, counted "
                            f"in the last stage's memory: that stage must be a CPU one, not {request.devices[-1].name}")
    if d.vocab != cfg.vocab:
        raise PlanError(f"the draft's vocabulary ({d.vocab} tokens) differs from the model's ({cfg.vocab})")
    if draft.tokens < 1:
        raise PlanError(f"draft_tokens must be >= 1, got {draft.tokens}")
    if request.policy.kv == "q8_0" and d.head_dim % 32:
        raise PlanError(f"a q8_0 KV cache needs head_dim divisible by 32; the draft's is {d.head_dim}")


def _draft_bytes(draft: DraftModel, request: PlanRequest, kv_tokens: int, device: Device) -> dict[str, int]:
    """The draft's weights, its KV cache (the target's block count and size: the same tokens) and
    the q distributions of its sampled proposals, held until the target verifies them."""
    d = draft.headers.config
    return dict(
        draft_weights=_weights_by_device(draft.headers, [(0, d.n_layers)], [device])[0].total,
        draft_kv_cache=_attention_layers(d, 0, d.n_layers) * 2 * d.n_kv_heads
        * storage_bytes(request.policy.kv, d.head_dim) * kv_tokens,
        draft_proposals=request.seqs * draft.tokens * d.vocab * 8)


def _kv_by_layer(cfg: ModelConfig, request: PlanRequest, kv_tokens: int) -> list[int]:
    """Per layer, its KV cache's bytes as the runtime allocates them (Transformer.new_cache): K and V
    of its own KV heads and head_dim over every sequence's positions; none for a linear-attention
    layer or one that shares another's K/V (gemma4); a sliding-window layer's ring per sequence
    where the cache keeps only the window (step/window_ring.ring_for: the engine's step,
    prefill_chunk positions at most)."""
    ring = ring_for(cfg, kv_tokens // request.kv_block, request.kv_block, request.seqs, request.prefill_chunk)
    window_tokens = ring * request.kv_block * request.seqs
    return [2 * cfg.kv_heads(i) * storage_bytes(request.policy.kv, cfg.head_dim_at(i))
            * (window_tokens if ring and cfg.window(i) else kv_tokens) if cfg.owns_kv(i) else 0
            for i in range(cfg.n_layers)]


def _attention_layers(cfg: ModelConfig, first: int, end: int) -> int:
    """Layers in [first, end) with a KV cache (all, but for a hybrid model's linear-attention layers)."""
    return (end - first) - (sum(cfg.linear.recurrent[first:end]) if cfg.linear else 0)


def _state_per_layer(cfg: ModelConfig) -> int:
    return 4 * cfg.linear.state_floats if cfg.linear else 0


def activation_reservation(cfg: ModelConfig, request: PlanRequest, device: Device, ctx: int,
                           logits_rows: int) -> ActivationReservation:
    """The larger of the layers' buffers (widest per-token buffer x tokens per step x bytes x safety)
    and the logits buffer with the sampler's workspace, plus the CPU kernels' scratch; capped.

    The larger, not the sum: the output projection runs after the last layer has freed its buffers
    (measured: the sum over-reserves up to 1.9x for big vocabularies; docs/planner.md). bytes: 4 on
    the CPU, whose kernels keep activations f32 at every interface (kernels/ops.py) whatever the
    staging dtype; elsewhere the policy's activation dtype. The sampler (numpy, on the host) holds
    about SAMPLER_ROWS vocab-sized f32 rows at its peak. Each numba thread holds 16 dequantized
    weight rows (quant_matmul's tile) and a score row as long as the context: small on 2 cores, not
    on 64.
    """
    cap = _per_kind(request.act_cap, ACT_CAP, device)
    # gemma4: a step's per-layer inputs, every layer's at once (models/gemma4.PerLayerEmbedding)
    widest = max(cfg.hidden, cfg.n_heads * cfg.head_dim, cfg.ffn, expert_ffn(cfg) * cfg.n_experts_used,
                 cfg.n_layers * cfg.layer_input_dim)
    tokens = max(request.seqs, request.prefill_chunk)
    cpu = device.kind == "cpu"
    elem = 4 if cpu else storage_bytes(request.policy.act, 1)
    logits = logits_rows * cfg.vocab * 4
    sampler = SAMPLER_ROWS * cfg.vocab * 4 if cpu and logits_rows else 0
    scratch = _cpu_threads(request) * (16 * widest + ctx) * 4 if cpu else 0
    safety = request.act_safety if request.act_safety is not None else act_safety_for(cfg, widest)
    buffers = math.ceil(widest * tokens * elem * safety)
    common = dict(cap=cap, widest=widest, tokens=tokens, elem_bytes=elem, safety=safety,
                  buffers=buffers, logits=logits, sampler=sampler, scratch=scratch)
    if min(cfg.hidden, cfg.vocab) <= 0 or max(cfg.ffn, expert_ffn(cfg) * cfg.n_experts_used) <= 0:
        return ActivationReservation(bytes=cap, rule="fallback", estimate=None, **common)  # type: ignore[arg-type]
    estimate = max(buffers, logits + sampler) + scratch
    rule = "cap" if estimate > cap else "estimate"
    return ActivationReservation(bytes=min(estimate, cap), rule=rule, estimate=estimate, **common)  # type: ignore[arg-type]


def act_safety_for(cfg: ModelConfig, widest: int) -> float:
    """The measured safety factor: ACT_MARGIN x (3 + 3 hidden / widest), see ACT_MARGIN."""
    return ACT_MARGIN * (ACT_WIDEST_BUFFERS + ACT_HIDDEN_BUFFERS * cfg.hidden / max(widest, 1))


def split_layers(n_layers: int, devices: Sequence[Device], split: Sequence[int] | None = None,
                 weights: LayerWeights | None = None) -> list[tuple[int, int]]:
    """[first, end) layer ranges per device: `split` as given, else proportional to the budgets: in
    bytes of weights where `weights` gives them (the output projection counted on the last device),
    else in layers."""
    if split is not None:
        if sum(split) != n_layers or min(split) < 0:
            raise PlanError(f"split {','.join(map(str, split))} does not add up to the model's {n_layers} layers")
        counts = list(split)
    else:
        budgets = [d.budget for d in devices] if any(d.budget for d in devices) else [1] * len(devices)  # none: equal
        if weights is not None and all(weights.layers) and n_layers >= len(devices) > 1:  # (headers with sizes)
            counts = _split_by_bytes(weights, budgets)
        else:
            counts = _split_by_count(n_layers, budgets)
    ends = [sum(counts[: i + 1]) for i in range(len(counts))]
    return [(e - c, e) for c, e in zip(counts, ends, strict=True)]


@dataclass(frozen=True)
class LayerWeights:
    """Bytes of weights per layer, and of the output projection (which the last device holds and
    reads every step; the embedding, of which a step reads a row per token, counts nowhere)."""
    layers: tuple[int, ...]
    head: int

    @classmethod
    def of(cls, info: ModelHeaders) -> LayerWeights:
        layers = [0] * info.config.n_layers
        head = 0
        for t in info.tensors:
            layer = layer_of(t.name)
            if layer is not None and layer < len(layers):
                layers[layer] += t.nbytes
            elif t.name in ("output.weight", "lm_head.weight"):
                head += t.nbytes
        if not head:  # tied: the output projection is the embedding
            head = sum(t.nbytes for t in info.tensors if weight_class(t.name) == "embeddings")
        return cls(tuple(layers), head)


def _split_by_count(n_layers: int, budgets: Sequence[int]) -> list[int]:
    """A layer each first (a 2-layer model on 128 GB of RAM and an 80 GB GPU gave the GPU none), the
    rest in proportion to the budgets (largest remainders; a tie goes to the earlier device, leaving
    the last, which also holds the output projection and the logits, the lighter share)."""
    each = 1 if n_layers >= len(budgets) else 0
    rest = n_layers - each * len(budgets)
    shares = [divmod(rest * b, sum(budgets)) for b in budgets]
    counts = [each + whole for whole, _ in shares]
    for i in sorted(range(len(budgets)), key=lambda i: (-shares[i][1], i))[:n_layers - sum(counts)]:
        counts[i] += 1
    return counts


def _split_by_bytes(weights: LayerWeights, budgets: Sequence[int]) -> list[int]:
    """Layer counts whose bytes (the head's on the last) come nearest each device's share of the
    budgets, a layer each at least; a tie gives the layer to the earlier device. A stage's time per
    token follows the bytes it reads, and the head is one matrix of vocab x hidden: Qwen3-8B's
    (151936 x 4096) weighs as much as 3.4 of its layers, so counting layers alone overloads the last
    stage."""
    n, parts = len(weights.layers), len(budgets)
    cum = [0]
    for b in weights.layers:
        cum.append(cum[-1] + b)
    total = cum[-1] + weights.head
    cuts, spent, every = [0], 0, sum(budgets)
    for i in range(parts - 1):
        spent += budgets[i]
        options = range(cuts[-1] + 1, n - (parts - 1 - i) + 1)  # a layer for this device and each after it
        # |cum[k] - total * spent / every| in integers: an exact tie stays a tie
        cuts.append(min(options, key=lambda k: (abs(cum[k] * every - total * spent), -k)))
    cuts.append(n)
    return [b - a for a, b in zip(cuts, cuts[1:], strict=False)]


def _weights_by_device(info: ModelHeaders, bounds: Sequence[tuple[int, int]], devices: Sequence[Device]) -> list[WeightBytes]:
    sums = [dict.fromkeys(WEIGHT_CLASSES, 0) for _ in devices]
    names = {t.name for t in info.tensors}
    for t in info.tensors:
        cls, layer = weight_class(t.name), layer_of(t.name)
        if layer is not None:
            owners = [next((i for i, (a, b) in enumerate(bounds) if a <= layer < b), len(devices) - 1)]
        elif cls == "embeddings":
            owners = [0]
        elif cls == "output":
            owners = [len(devices) - 1]
        else:
            owners = list(range(len(devices)))  # small globals (rope_freqs): every device reads them
        for i in owners:
            sums[i][cls] += _resident_bytes(t, devices[i])
    tied = not names & {"output.weight", "lm_head.weight"}
    if tied and len(devices) > 1:  # the output projection is the embedding: the last device needs a copy
        embed = next(t for t in info.tensors if weight_class(t.name) == "embeddings")
        sums[-1]["output"] += _resident_bytes(embed, devices[-1])
    return [WeightBytes(**s) for s in sums]


def _resident_bytes(t: TensorInfo, device: Device) -> int:
    """Matrices stay in the file's format (mmap'd on the CPU, copied as-is to a GPU); vectors (norms,
    biases) are widened to an f32 copy, and on the CPU their mapped file bytes count too."""
    if len(t.shape) > 1:
        return t.nbytes
    return math.prod(t.shape) * 4 + (t.nbytes if device.kind == "cpu" else 0)


def expert_ffn(cfg: ModelConfig) -> int:
    """An expert's FFN width."""
    # Mixtral GGUF files (arch "llama") have no expert_feed_forward_length: an expert is as wide as the FFN
    return cfg.expert_ffn or (cfg.ffn if cfg.n_experts else 0)


def _expert_bytes(info: ModelHeaders) -> int:
    cfg = info.config
    total = sum(t.nbytes for t in info.tensors if weight_class(t.name) == "experts")
    layers = {layer_of(t.name) for t in info.tensors if weight_class(t.name) == "experts"}
    return total // (len(layers) * cfg.n_experts) if total and cfg.n_experts else 0


def _expert_cap(budget: int | str | None, here: int, total: int) -> int | None:
    """A device's share of the expert budget: "N%" of its own experts, or bytes in proportion to them."""
    if budget is None:
        return None
    if isinstance(budget, str) and budget.strip().endswith("%"):
        return parse_expert_budget(budget, here)
    whole = parse_expert_budget(budget, total)
    return whole * here // total if total else 0


def parse_expert_budget(spec: int | str | None, total: int) -> int | None:
    """expert_budget as bytes: None (no bound), a byte count, a size ("512MiB"), or "N%" of `total`
    (all the experts' bytes)."""
    if spec is None:
        return None
    if isinstance(spec, str):
        text = spec.strip()
        if text.endswith("%"):
            try:
                share = float(text[:-1])
            except ValueError:
                raise PlanError(f"expert_budget {spec!r} is not a percentage") from None
            if not 0 <= share <= 100:
                raise PlanError(f"expert_budget {spec!r} must be between 0% and 100%")
            return int(total * share / 100)
        spec = parse_size(text)
    if isinstance(spec, bool) or not isinstance(spec, int) or spec < 0:
        raise PlanError(f"expert_budget must be bytes >= 0, a size or 'N%', got {spec!r}")
    return spec


def _feature_mirror(cfg: ModelConfig, request: PlanRequest, draft: DraftModel | None, kv_tokens: int) -> int:
    """A row of captured features per KV-cache position: the mirror is paged with the KV cache's
    block tables (daemon/speculative/feature_mirror.py allocates exactly this). Its width: the
    request's feature layers, or a DFlash draft's (its fc reads them) x the target's hidden size."""
    layers = request.speculative.feature_layers if request.speculative is not None else _dflash_layers(draft, cfg)
    return kv_tokens * storage_bytes(request.policy.feature, layers * cfg.hidden) if layers else 0


def _dflash_layers(draft: DraftModel | None, cfg: ModelConfig) -> int:
    """Target layers a DFlash draft reads (fc.weight is [hidden, layers x target hidden]); 0 for none."""
    if draft is None or draft.headers.config.arch != "dflash":
        return 0
    fc = next((t for t in draft.headers.tensors if t.name == "fc.weight"), None)
    return fc.shape[-1] // cfg.hidden if fc is not None else 0


def _cpu_threads(request: PlanRequest) -> int:
    return request.cpu_threads or os.cpu_count() or 1


def _per_kind(override: int | None, defaults: Mapping[str, int], device: Device) -> int:
    return defaults[device.kind] if override is None else override


# --- devices from the command line --------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": GiB, "gib": GiB, "t": 1 << 40, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: str) -> int:
    """'24GiB', '24G' (binary), '24GB' (decimal), '512MiB', '1073741824' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise PlanError(f"not a size: {text!r} (examples: 24GiB, 512MiB, 16GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_device(spec: str) -> Device:
    """'cpu', 'cpu=16GiB', 'cuda:0=24GiB', 'cuda:1=11GiB@8.6' (compute capability, for the precision
    policy; without it a CUDA device is assumed to lack native bf16)."""
    m = re.fullmatch(r"(cpu(?::\d+)?|cuda(?::\d+)?)(?:=([^@]+))?(?:@(\d+)\.(\d+))?", spec.strip())
    if not m:
        raise PlanError(f"not a device: {spec!r} (examples: cpu, cpu=16GiB, cuda:0=24GiB, cuda:0=24GiB@8.9)")
    name = "cuda:0" if m.group(1) == "cuda" else m.group(1)
    cc = (int(m.group(3)), int(m.group(4))) if m.group(3) else None
    if m.group(2):
        return Device(name, parse_size(m.group(2)), cc)
    if name.startswith("cpu"):
        return Device(name, available_ram(), cc)
    raise PlanError(f"give the memory budget of {name}, e.g. {name}=24GiB (ember plan does not probe GPUs)")


def available_ram() -> int:
    """MemAvailable: what the kernel could give without swapping (the CPU's default budget)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * KiB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def with_request(plan: Plan, **changes: Any) -> Plan:
    """The same model planned with some request fields changed (what-if questions, suggestions)."""
    return build_plan(plan.model, replace(plan.request, **changes), plan.draft)


# --- saying it ----------------------------------------------------------------------------------
LABELS = {"weights": "weights", "experts": "MoE experts", "kv_cache": "KV cache", "recurrent_state": "recurrent state",
          "activations": "activations",
          "graph_headroom": "CUDA-graph headroom", "staging": "layer-split staging", "feature_mirror": "feature mirror",
          "draft": "draft model"}


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def explain(plan: Plan) -> str:
    """Why the plan does not fit, and changes that would make it fit (each one re-planned to be sure)."""
    name = Path(plan.model.path).name
    lines = []
    for d in (d for d in plan.devices if not d.fits):
        parts = {k: v for k, v in d.components().items() if v}
        worst = max(parts, key=lambda k: parts[k])
        detail = ", ".join(f"{LABELS[k]} {fmt_bytes(v)}" for k, v in parts.items())
        lines.append(f"{name} does not fit {d.device.name}: it needs {fmt_bytes(d.required)} of the "
                     f"{fmt_bytes(d.device.budget)} budget ({fmt_bytes(d.required - d.device.budget)} over): {detail}. "
                     f"Too big: the {LABELS[worst]} ({fmt_bytes(parts[worst])}{_why(plan, worst)}).")
    fixes = suggestions(plan)
    lines.append("To make it fit: " + ("; or ".join(fixes) if fixes else "use a device with more memory") + ".")
    return "\n".join(lines)


def suggestions(plan: Plan) -> list[str]:
    """Single changes that make the plan fit, each checked by planning again (every component grows
    with ctx, sequences, chunk and headroom, so a bisection finds the largest value that fits)."""
    req, cfg, out = plan.request, plan.model.config, []
    narrower = [k for k in ("f16", "q8_0") if storage_bytes(k, 64) < storage_bytes(req.policy.kv, 64)
                and not (k == "q8_0" and cfg.head_dim % 32)]
    for kv in narrower:
        alt = with_request(plan, policy=replace(req.policy, kv=kv))
        if alt.fits:
            out.append(f"the KV cache in {kv} (--kv-dtype {kv}: {fmt_bytes(_kv(plan))} -> {fmt_bytes(_kv(alt))})")
            break
    block = req.kv_block
    for kv in [req.policy.kv] + narrower:
        policy = replace(req.policy, kv=kv)
        blocks = _largest(_fits_with(plan, "ctx", block, policy=policy), (plan.ctx - 1) // block)
        if blocks:
            flag = "" if kv == req.policy.kv else f" --kv-dtype {kv}"
            out.append(f"a smaller context (--ctx {blocks * block}{flag} fits)")
            break
    seqs = _largest(_fits_with(plan, "seqs"), req.seqs - 1)
    if seqs:
        out.append(f"fewer sequences at once (--seqs {seqs})")
    if plan.draft is not None:
        tokens = _largest(lambda n: build_plan(plan.model, req, replace(plan.draft, tokens=n)).fits, plan.draft.tokens - 1)
        if tokens:
            out.append(f"fewer draft tokens (--draft-tokens {tokens})")
        elif build_plan(plan.model, req).fits:
            out.append("no draft model")
    if cfg.n_experts and not req.expert_offload and any(d.device.kind == "cuda" for d in plan.devices):
        if with_request(plan, expert_offload=True).fits:
            out.append("expert offload (--expert-offload: the experts that fit stay on the GPU, CPU workers run the rest)")
    chunk = _largest(_fits_with(plan, "prefill_chunk"), req.prefill_chunk - 1)
    if chunk:
        out.append(f"a smaller prefill chunk (--prefill-chunk {chunk})")
    headroom = max(d.graph_headroom for d in plan.devices) // MiB
    mib = _largest(_fits_with(plan, "graph_headroom", MiB), headroom - 1)
    if mib:
        out.append(f"less CUDA-graph headroom (--graph-headroom {mib}MiB: fewer captured batch sizes)")
    if any(d.weights.total - (d.weights.experts if d.offloads_experts else 0) > d.device.budget for d in plan.devices):
        out.append("a smaller quantization of the model")
    out.append("another device to split the layers across (--device ... --device ...)")
    return out


def _why(plan: Plan, component: str) -> str:
    req = plan.request
    if component == "kv_cache":
        return f" for {req.seqs} x {plan.ctx} tokens in {req.policy.kv}"
    if component == "activations":
        return f" for {max(req.seqs, req.prefill_chunk)} tokens per step"
    if component == "recurrent_state":
        return f" for {req.seqs} sequences, {fmt_bytes(plan.model.config.state_bytes())} each"
    if component == "draft" and plan.draft is not None:
        d = plan.devices[-1]
        return (f": weights {fmt_bytes(d.draft_weights)}, KV cache {fmt_bytes(d.draft_kv_cache)}, proposals "
                f"{fmt_bytes(d.draft_proposals)} for {req.seqs} x {plan.draft.tokens} tokens")
    return ""


def _kv(plan: Plan) -> int:
    return sum(d.kv_cache for d in plan.devices)


def _fits_with(plan: Plan, name: str, unit: int = 1, **fixed: Any) -> Callable[[int], bool]:
    """n -> whether the plan fits with request field `name` = n x unit (and `fixed` changes)."""
    return lambda n: with_request(plan, **{name: n * unit}, **fixed).fits


def _largest(fits: Callable[[int], bool], hi: int) -> int:
    """The largest n in [1, hi] with fits(n), for a monotone `fits`; 0 if none."""
    lo = 0  # invariant: lo == 0 or fits(lo); everything above hi does not fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def log_plan(plan: Plan, log: Any) -> None:
    """The plan as structlog events: one line per device, sizes readable (the daemon logs it at start)."""
    for d in plan.devices:
        log.info("memory plan", model=Path(plan.model.path).name, device=d.device.name,
                 layers=f"{d.layers[0]}-{d.layers[1] - 1}", budget=fmt_bytes(d.device.budget),
                 **{k: fmt_bytes(v) for k, v in d.components().items()},
                 required=fmt_bytes(d.required), free=fmt_bytes(d.free), fits=d.fits,
                 ctx=plan.ctx, seqs=plan.request.seqs, kv_dtype=plan.request.policy.kv)
