"""The in-process API: `load(path, device)` -> Model, with tokenize, detokenize, logits and generate.

Library users call it directly; the daemon loads its models through it too. Generating runs on the
same engine core as the daemon (engine/engine_core.py), holding one sequence. `load(path,
devices=["cpu:0", "cpu:1"], split=[3, 2])` splits the model's layers across stage worker processes
(runner/split_runner.py); everything else is the same.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ember.daemon.engine.decode_burst import DECODE_BURST, MAX_BURST, BurstClock
from ember.daemon.step.defaults import KV_BLOCK, PREFILL_CHUNK
from ember.daemon.engine.engine_core import EngineCore, StepOutput
from ember.daemon.heap import release_free_heap
from ember.daemon.engine.sequence import Sequence as EngineSequence
from ember.daemon.experts.expert_manager import ExpertManager, ExpertOptions, ExpertStats
from ember.daemon.experts.routing_stats import cache_root
from ember.daemon.loader.hub import Hub, resolve_model
from ember.daemon.loader.model_file import ModelFile, open_model_file
from ember.daemon.loader.model_file_error import ModelFileError
from ember.daemon.models.dflash import DFlashDraft
from ember.daemon.models.transformer import Transformer
from ember.daemon.runner.devices import DeviceName, backend_for, model_ops
from ember.daemon.runner.model_runner import ModelRunner
from ember.daemon.runner.native_decoder import NativeDecoder
from ember.daemon.runner.native_runner import NativeRunner
from ember.daemon.runner.pipeline import Pipeline
from ember.daemon.runner.split_runner import SplitRunner
from ember.daemon.runner.split_spec import (SplitSpecError, cpu_stages, parse_devices, parse_split, plan_stages,
                                            stage_budgets, stage_threads_for)
from ember.daemon.config import DEFAULT_CTX
from ember.daemon.planning.planner import Device, LayerWeights, PlanRequest, headers_of, plan_model, read_model_info
from ember.daemon.planning.precision import DeviceCaps, PrecisionPolicy, PrecisionSettings, resolve_policy
from ember.daemon.loader.dflash_file import is_dflash
from ember.daemon.speculative.draft_proposer import DRAFT_MIN_PROB
from ember.daemon.speculative.feature_proposer import FeatureProposer
from ember.daemon.speculative.ngram_proposer import NGRAM, NgramProposer
from ember.daemon.speculative.spec_stats import SpecStats
from ember.daemon.speculative.spec_switch import SpecSwitch
from ember.daemon.text.grammar import compile_grammar
from ember.daemon.text.text_model import TextModel, sampling_of, tokenizer_of
from ember.daemon.text.tokenizer import Tokenizer
from ember.kernels.convert import DECODE_ACTIVATIONS, DEFAULT_KV_DTYPE, DEFAULT_PROMPT_ACT, KV_DTYPES, prompt_act_for
from ember.kernels.cuda.native_kernels import CUDA_KERNELS
from ember.kernels.cuda.native_launch import NativeOps
from ember.kernels.sampling import SamplingParams
from ember.protocol.messages import Grammar

__all__ = ["Model", "ModelFileError", "load"]

_DFLASH_BESIDE_SPLIT = ("a feature-conditioned (DFlash) draft reads the target's hidden states at its layers, which a "
                        "layer split keeps in its stage processes: load the target on one device, or use a draft model")



class Model(TextModel):
    def __init__(self, mf: ModelFile, tokenizer: Tokenizer, device: str = "cpu", kv_dtype: str = DEFAULT_KV_DTYPE,
                 decode_act: str = "q8_0", pipeline: Pipeline | None = None,
                 experts: ExpertOptions | None = None, draft: ModelFile | None = None, draft_tokens: int = 4,
                 feature_dtype: str = "f32", on_layer: Callable[[int, int], None] | None = None,
                 cuda_kernels: str = "numba", native_ops: NativeOps | None = None,
                 prompt_act: str = DEFAULT_PROMPT_ACT, ngram: bool = False) -> None:
        """On `device`, or split across `pipeline`'s stages (its workers already loaded); a MoE
        model's experts placed by `experts`; `draft` proposes `draft_tokens` tokens a step (a DFlash
        draft reads the target's features, mirrored in `feature_dtype`), or with `ngram` and no draft
        model, a sequence's own context does (prompt lookup); on_layer(placed, in all) as
        each of its layers is placed. On a cuda device, `cuda_kernels` "native" runs it on the CUDA C++
        kernels (NativeRunner) over `native_ops` (default: CuPy's on cuda:0; the tests give the host
        harness's)."""
        super().__init__(mf.path, mf.config, tokenizer, sampling_of(mf))
        name = DeviceName.parse(device)
        self.kv_dtype = kv_dtype
        self.decode_act = decode_act
        self.file_bytes = mf.file_bytes
        self.pipeline = pipeline
        self.device = ",".join(str(s.device) for s in pipeline.specs) if pipeline else str(name)
        self._native = None if cuda_kernels == "numba" else _native_decoder(mf, name, kv_dtype, decode_act, pipeline,
                                                                           draft is not None or ngram, native_ops)
        self.prompt_act = prompt_act
        ops = None if pipeline or self._native else model_ops(name, prompt_act)
        # what binds the loading thread, and each engine's, to the model's device (Ops.device_scope)
        self._device_scope = (self._native.ops.device_scope if self._native else
                              ops.device_scope if ops is not None else nullcontext)
        with self._device_scope():
            self._net = None if ops is None else Transformer(mf, ops, experts=experts, on_layer=on_layer)
        self.draft_path = None if draft is None else draft.path
        self.ngram = ngram and draft is None
        self.draft_tokens = draft_tokens
        self.draft_min_prob = DRAFT_MIN_PROB  # the draft stops after a proposal it is less sure of (0: never)
        # a draft model speculates only where that measures faster than decoding without it (SpecSwitch,
        # shared by this model's engines); False: on every step
        self.adaptive_draft = True
        self._spec_switch = SpecSwitch()
        self.feature_dtype = feature_dtype
        self._draft: Transformer | DFlashDraft | None = None
        if draft is not None and pipeline is not None and is_dflash(draft):
            raise ValueError(_DFLASH_BESIDE_SPLIT)
        if draft is not None:
            # beside a split the draft runs where sampling does: the engine's process, on the host CPU
            at = DeviceName("cpu") if pipeline is not None else name
            with self._device_scope():
                self._draft = (DFlashDraft(draft, self.net) if is_dflash(draft) else
                               Transformer(draft, model_ops(at, prompt_act)))
        self._spec_stats = SpecStats()
        self._burst_clocks: dict[tuple[float, int], BurstClock] = {}

    def __repr__(self) -> str:
        c = self.config
        return f"Model({str(self.path)!r}, arch={c.arch}, layers={c.n_layers}, hidden={c.hidden}, device={self.device})"

    # --- mixture of experts ----------------------------------------------------------------------
    def routing_stats(self) -> np.ndarray:
        """How often each expert was routed to: int64 [n_layers, n_experts] decayed counts (carried
        over from earlier runs of this file); zero rows for dense layers, empty for dense models."""
        m = self._experts
        return np.zeros((self.config.n_layers, 0), np.int64) if m is None else m.stats.as_int64()

    def placement(self) -> list[list[int]]:
        """Per layer, the sorted ids of the hot experts ([] for dense layers and dense models)."""
        m = self._experts
        return [[] for _ in range(self.config.n_layers)] if m is None else m.placement()

    def expert_stats(self) -> ExpertStats | None:
        """Hot experts, routed and cold (token, expert) slots, swaps; None for a dense model."""
        return None if self._experts is None else self._experts.snapshot()

    @property
    def _experts(self) -> ExpertManager | None:
        return None if self._net is None else self._net.experts

    # --- the model ------------------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits of every position, float32 [len(token_ids), vocab]."""
        ids = self._check_ids(token_ids)
        seq = EngineSequence(ids.tolist(), max_tokens=0, prompt_logits=True)
        rows = [out.logits for out in _drive(self.engine(len(ids)), seq) if out.logits is not None]
        return np.concatenate(rows)

    @property
    def net(self) -> Transformer:
        """The model's weights on its device, which runners (each with its own KV cache) share."""
        if self._native is not None:
            raise ValueError("the native CUDA kernels hold this model's weights, in their own layout (no Transformer)")
        if self._net is None:
            raise ValueError("a split model's weights live in its stage processes (Model.pipeline)")
        return self._net

    def engine(self, capacity: int, max_running: int = 1, **options: Any) -> EngineCore:
        """An engine core of its own over this model's weights, with KV cache for `capacity` tokens
        (more sequences: EngineCore's options, e.g. max_running, max_context, prefix_caching)."""
        options.setdefault("prefix_caching", False)
        options.setdefault("decode_burst", DECODE_BURST)
        # one clock per burst setting for this model's engines: each generate() makes an engine, and its
        # bursts start at the size the steps before it measured (a fresh clock starts at one step)
        key = (options["decode_burst"], options.get("max_burst", MAX_BURST))
        options.setdefault("burst_clock", self._burst_clocks.setdefault(key, BurstClock(*key)))
        options.setdefault("grammars", self.grammars)
        options.setdefault("max_step_tokens", self.pipeline.max_tokens if self.pipeline else PREFILL_CHUNK)
        with self._device_scope():  # its KV cache, draft and buffers go to the model's device
            return self._engine(capacity, max_running, options)

    def _engine(self, capacity: int, max_running: int, options: dict[str, Any]) -> EngineCore:
        blocks = -(-capacity // KV_BLOCK)
        if self._native is not None:
            context = min(options.get("max_context") or self.config.context_length, blocks * KV_BLOCK)
            runner = NativeRunner(self._native.with_cache(blocks, KV_BLOCK, self.kv_dtype, context), self.config,
                                  max_running)
        elif self.pipeline is None:
            runner = ModelRunner(self.net, blocks, KV_BLOCK, self.kv_dtype, self.decode_act, max_running,
                                 options["max_step_tokens"])
        elif options["max_step_tokens"] > self.pipeline.max_tokens:
            raise ValueError(f"max_step_tokens {options['max_step_tokens']} is over the {self.pipeline.max_tokens} "
                             f"tokens the split's staging holds (load(..., max_step_tokens=))")
        else:
            runner = SplitRunner(self.pipeline, blocks, KV_BLOCK, self.kv_dtype, self.decode_act)
        if isinstance(self._draft, DFlashDraft):  # its KV cache and feature mirror follow the target's blocks
            options.setdefault("draft", FeatureProposer(self._draft, runner, self.kv_dtype, self.feature_dtype,
                                                        self.draft_min_prob))
        elif self._draft is not None:  # the draft's cache mirrors the target's blocks (daemon/speculative/)
            options.setdefault("draft", ModelRunner(self._draft, blocks, KV_BLOCK, self.kv_dtype, self.decode_act))
        elif self.ngram:
            options.setdefault("draft", NgramProposer(self.config.vocab))
        if self._draft is not None or self.ngram:
            options.setdefault("draft_tokens", self.draft_tokens)
            options.setdefault("draft_min_prob", self.draft_min_prob)
            options.setdefault("adaptive_draft", self.adaptive_draft)
            options.setdefault("spec_switch", self._spec_switch)
            options.setdefault("spec_stats", self._spec_stats)
        return EngineCore(runner, max_running=max_running, **options)

    def spec_stats(self) -> SpecStats:
        """Speculative decoding so far over this model's engines: tokens proposed, accepted, and
        verification steps (all zero without a draft)."""
        return replace(self._spec_stats)

    def close(self) -> None:
        """Stop a split model's stage processes and free its shared memory; stop a MoE model's
        cold-expert workers and save its routing statistics (a no-op otherwise; the processes also
        end when the Model is garbage-collected or the process exits)."""
        if self.pipeline is not None:
            self.pipeline.close()
        if self._experts is not None:
            self._experts.close()

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 256,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        grammar: Grammar | None = None,
        **sampling: Any,
    ) -> Iterator[int]:
        """Yield generated token ids one at a time, as they are produced.

        Stops after max_tokens, at an end-of-sequence token (which is yielded) unless ignore_eos, at
        any of stop_ids (also yielded), or when the context is full. With a `grammar`
        (ember.protocol.messages.Grammar: a JSON schema, any JSON object, a regex, Lark or GBNF) the
        tokens follow it and stop where it is complete (GrammarError, a ValueError, if it is
        invalid). Other keyword arguments are
        SamplingParams fields (top_k, top_p, min_p, repetition_penalty, frequency_penalty,
        presence_penalty, logit_bias, ...); see kernels/sampling.py for their order.
        """
        params = SamplingParams(temperature=temperature, **sampling)  # validates before any work
        params.check_vocab(self.config.vocab)
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        ids = self._check_ids(self.tokenize(prompt) if isinstance(prompt, str) else prompt).tolist()
        stop = frozenset(stop_ids) | (frozenset() if ignore_eos else frozenset(self.tokenizer.eos_ids))
        compiled = None if grammar is None else compile_grammar(grammar.kind, grammar.text)
        return self._generate(EngineSequence(ids, max_tokens, params, seed, stop, grammar=compiled))

    def _generate(self, seq: EngineSequence) -> Iterator[int]:
        capacity = min(len(seq.prompt) + seq.max_tokens, self.config.context_length)
        if seq.max_tokens == 0 or len(seq.prompt) >= capacity:
            return  # nothing to generate: the prompt alone fills what was asked for
        for out in _drive(self.engine(capacity), seq):
            yield from out.new_tokens

    def _check_ids(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("no tokens: the prompt is empty")
        if ids.min() < 0 or ids.max() >= self.config.vocab:
            raise ValueError(f"token ids must be in [0, {self.config.vocab})")
        if ids.size > self.config.context_length:
            raise ValueError(f"prompt of {ids.size} tokens exceeds the context length {self.config.context_length}")
        return ids


def _drive(engine: EngineCore, seq: EngineSequence) -> Iterator[StepOutput]:
    """Run `seq` on `engine` (a private one: dropped at the end, its KV cache with it) until it ends,
    yielding every output. The engine ends a failing sequence quietly (the daemon reports it as
    Finished{error}); in process, the caller gets the error."""
    try:
        engine.add(seq)
        while engine.has_work:
            result = engine.step()
            if result.failed:
                raise RuntimeError(f"generation failed: {result.failed[0][1]}")
            yield from result.outputs
    finally:
        del engine
        release_free_heap()  # the engine's KV cache and its prompt buffers go back to the system


def _expert_room(path: Path, name: DeviceName, policy: PrecisionPolicy, experts: ExpertOptions) -> int:
    """The hot-expert bytes the memory plan leaves on the device: its budget minus the core weights,
    a context's KV cache, activations and reserves, bounded by the expert budget."""
    device = Device(str(name), backend_for(name).available_memory(name))
    request = PlanRequest(devices=(device,), policy=policy, ctx=min(DEFAULT_CTX, read_model_info(path).config.context_length),
                          expert_budget=experts.budget)
    return plan_model(path, request).devices[0].experts_hot


def _native_decoder(mf: ModelFile, name: DeviceName, kv_dtype: str, decode_act: str, pipeline: Pipeline | None,
                    speculative: bool, ops: NativeOps | None) -> NativeDecoder:
    """The model's weights on the native CUDA kernels, or why it cannot run there."""
    if pipeline is not None:
        raise ValueError("the native CUDA kernels run a model on one device, not across a layer split")
    if speculative:
        raise ValueError("speculative decoding does not run on the native CUDA kernels yet (cuda_kernels 'numba')")
    if decode_act != "q8_0":
        raise ValueError("the native CUDA kernels quantize decode activations to q8_1 (decode_act q8_0); "
                         "for f32 decode activations use cuda_kernels 'numba'")
    if ops is None:
        ops = NativeOps.on_gpu(name.index or 0)  # imports CuPy: only here, on a GPU
    with ops.device_scope():
        return NativeDecoder.from_file(mf, ops, n_blocks=1, block_size=KV_BLOCK, kv_dtype=kv_dtype,
                                       max_context=KV_BLOCK)


def load(path: str | Path, device: str = "cpu", kv_dtype: str = DEFAULT_KV_DTYPE, decode_act: str = "q8_0",
         devices: str | Sequence[str] | None = None, split: str | Sequence[int] | None = None,
         act_dtype: str = "auto", max_step_tokens: int = PREFILL_CHUNK, stage_threads: int = 0, shm_owner: str | None = None,
         expert_budget: int | str | None = None, cold_workers: int | None = None, cold_policy: str = "exact",
         draft: str | Path | None = None, draft_tokens: int = 4, feature_dtype: str | None = None,
         env: Mapping[str, str] | None = None, on_layer: Callable[[int, int], None] | None = None,
         cuda_kernels: str = "numba", prompt_act: str | None = None) -> Model:
    """Open a GGUF file or Hugging Face directory (or a model named on the Hugging Face hub, owner/repo
    or owner/repo:QUANT: fetched into its cache first, daemon/loader/hub.py) and place the model on
    `device` ("cpu"); its KV
    cache holds `kv_dtype` (f16, the default, f32, bf16 or q8_0); generated tokens meet quantized weights with
    `decode_act` activations (q8_0, as llama.cpp; or f32, exactly as prompt tokens do), prompt tokens
    with `prompt_act` ones (q8_0, quantized as generated tokens' are, as llama.cpp does: about twice as
    fast a prefill on the CPU; or f32, exactly; None: q8_0, or f32 beside decode_act f32;
    docs/runtime.md).

    devices (["cpu:0", "cpu:1"] or "cpu:0,cpu:1"; plain "cpu" last: that stage on the engine's own
    thread) splits the layers across stage processes: `split`
    layers each ([3, 2] or "3,2"; default: in proportion to each device's memory), hidden states
    staged between them in `act_dtype` (f32, f16, bf16; auto: the precision policy's, EMBER_ACT_DTYPE
    overrides it), steps of up to `max_step_tokens` tokens, `stage_threads` kernel threads per stage
    (0: the CPUs shared out among the stages), shared memory named after `shm_owner` (the daemon's).

    MoE models: `expert_budget` bounds the bytes of hot experts (None: all; bytes; a size such as
    "2GiB"; or "N%" of all experts' bytes); the cold ones are computed by `cold_workers` CPU worker
    processes (default 2 when some are cold) under cold_policy "exact", or dropped under "mask"
    (lossy, opt-in). docs/experts.md. (Not with a layer split: its stages keep every expert hot.)

    `draft`: a smaller model with the same vocabulary that proposes `draft_tokens` tokens a step for
    the target to verify (speculative decoding: the same tokens when greedy, the same distribution
    when sampled; docs/speculative.md), or "ngram": no model, the tokens that followed the latest
    earlier occurrence of a sequence's last 2-4 tokens in its own context (prompt lookup decoding).
    The draft runs on `device`, beside the target (beside a layer split: in this process on the host
    CPU, and the split then runs one step at a time). A draft in
    llama.cpp's `dflash` format (a feature-conditioned draft) is recognised by its architecture: it
    reads the target's hidden states, kept per position in `feature_dtype` (f32, f16, bf16 or q8_0;
    None: EMBER_FEATURE_DTYPE, else f32), and proposes up to min(draft_tokens, its block - 1) a step.

    `cuda_kernels` (on a cuda device): "numba", the numba.cuda kernels behind the ops API (every
    architecture), or "native", the CUDA C++ kernels through CuPy, the decode step replayed as a graph
    (dense models on cuda:0, no draft, no layer split; docs/cuda.md).

    `env`: where the EMBER_* variables (EMBER_ACT_DTYPE, EMBER_FEATURE_DTYPE, EMBER_CACHE_DIR for
    routing statistics) and the hub's (HF_ENDPOINT, HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE) are read,
    once, here (None: this process's environment). `on_layer(placed, in all)`: the load's progress, as
    each layer is placed on its device (not with a layer split: its stages load side by side)."""
    env = os.environ if env is None else env  # read here once: nothing below looks at the environment
    hub = Hub.from_env(env)  # a model (or draft) named owner/repo[:QUANT] comes from the hub's cache
    path = resolve_model(str(path), hub)
    ngram = draft is not None and str(draft) == NGRAM
    draft = None if draft is None or ngram else resolve_model(str(draft), hub)
    experts = ExpertOptions(expert_budget, cold_workers, cold_policy, cache_dir=cache_root(env))
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r} (choose from {', '.join(KV_DTYPES)})")
    if decode_act not in DECODE_ACTIVATIONS:
        raise ValueError(f"unknown decode activation precision {decode_act!r} (choose from {', '.join(DECODE_ACTIVATIONS)})")
    prompt_act = prompt_act_for(prompt_act, decode_act)
    if cuda_kernels not in CUDA_KERNELS:
        raise ValueError(f"unknown cuda_kernels {cuda_kernels!r} (choose from {', '.join(CUDA_KERNELS)})")
    names = parse_devices(devices) if devices is not None else [DeviceName.parse(device)]
    # one plain device is the in-process engine; cpu:N, even alone, is a stage process
    staged = len(names) > 1 or not names[0].in_process or split is not None
    counts = parse_split(split)
    if cuda_kernels == "native" and staged and any(n.kind == "cuda" for n in names):
        raise ValueError("the native CUDA kernels run a model on one device, not across a layer split")
    if draft is not None and draft_tokens < 1:
        raise ValueError(f"draft_tokens must be >= 1, got {draft_tokens}")
    # the engine's process runs the model (one device), or samples on the host (a split; each stage
    # prepares its own backend)
    backend = backend_for(DeviceName("cpu") if staged else names[0])
    policy = resolve_policy([DeviceCaps.of(str(n)) for n in names], env=env,
                            flags=PrecisionSettings(act=None if act_dtype == "auto" else act_dtype, feature=feature_dtype))
    mf = open_model_file(path)
    draft_file = None if draft is None else open_model_file(draft)
    if draft_file is not None and draft_file.config.vocab != mf.config.vocab:
        raise ModelFileError(str(draft_file.path), f"the draft's vocabulary ({draft_file.config.vocab} tokens) "
                             f"differs from the model's ({mf.config.vocab}): a draft must share the tokenizer")
    backend.prepare()
    tokenizer = tokenizer_of(mf)
    if not staged:
        if experts.budget is not None and mf.config.n_experts:
            experts = replace(experts, device_room=_expert_room(mf.path, names[0], replace(policy, kv=kv_dtype), experts))
        return Model(mf, tokenizer, str(names[0]), kv_dtype, decode_act, experts=experts, draft=draft_file,
                     draft_tokens=draft_tokens, feature_dtype=policy.feature, on_layer=on_layer,
                     cuda_kernels=cuda_kernels if names[0].kind == "cuda" else "numba", prompt_act=prompt_act,
                     ngram=ngram)
    if draft_file is not None and is_dflash(draft_file):
        raise ValueError(_DFLASH_BESIDE_SPLIT)
    weights = None if counts is not None else LayerWeights.of(headers_of(mf))  # (an HF model's headers are read again)
    stages = plan_stages(names, counts, mf.config.n_layers, stage_budgets(names), weights)
    if any(n.kind == "ray" for n in names):
        if not all(n.kind == "ray" for n in names):
            raise SplitSpecError(f"devices {','.join(map(str, names))}: a split on Ray runs every stage on Ray "
                                 "(ray:0/cpu,ray:1/cpu,...), none in local processes")
        from ember.daemon.runner.ray_pipeline import RayPipeline

        on_ray = RayPipeline(str(mf.path), mf.config, stages, policy.act, max_step_tokens, stage_threads, prompt_act)
        return Model(mf, tokenizer, str(names[0]), kv_dtype, decode_act, on_ray, draft=draft_file,  # type: ignore[arg-type]
                     draft_tokens=draft_tokens, prompt_act=prompt_act, ngram=ngram)
    threads = stage_threads_for(stage_threads, max(1, cpu_stages(names)), len(os.sched_getaffinity(0)))
    pipeline = Pipeline(str(mf.path), mf.config, stages, policy.act, max_step_tokens, threads, shm_owner, prompt_act)
    return Model(mf, tokenizer, str(names[0]), kv_dtype, decode_act, pipeline, draft=draft_file,
                 draft_tokens=draft_tokens, prompt_act=prompt_act, ngram=ngram)
