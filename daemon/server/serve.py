"""`ember serve`: configuration -> socket lock -> memory plan -> models loaded and warmed -> READY ->
serve -> exit 0.

The lock is taken before anything slow, so a second daemon on the same socket fails at once with a
message naming the first. Holding it, the daemon removes the logits segments a killed predecessor on
the same socket left in /dev/shm (protocol/shm_ring.py names them after the socket and their creator's
pid). Each model's memory plan (daemon/planning/planner.py) is computed from its metadata and logged
before a weight is read; a model that does not fit stops the start with the planner's explanation.
Models are loaded once and stay resident for the life of the process. The clients' logits rings are
bounded together by server.max_logits_bytes (RingBudget).
"""
from __future__ import annotations

import grp
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import uvloop

from ember.daemon.engine.engine_core import EngineCore
from ember.daemon.config import Config, ModelSpec
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.runner.devices import DeviceName, backend_for
from ember.daemon.logging_setup import configure_logging, get_logger
from ember.daemon.server.notify import Notifier
from ember.daemon.planning.planner import (Device, DraftModel, LayerWeights, PlanDoesNotFit, PlanRequest, build_plan,
                                          log_plan, read_model_info)
from ember.daemon.planning.precision import ENV_VARS, DeviceCaps, PrecisionPolicy, PrecisionSettings, resolve_policy
from ember.daemon.engine.defaults import KV_BLOCK
from ember.daemon.runtime import Model, load
from ember.daemon.runner.split_spec import parse_devices, parse_split, plan_stages, stage_budgets
from ember.daemon.server.server import Server
from ember.daemon.text.text_worker import Output, TextWorker
from ember.daemon.server.socket_dir import SocketLock, prepare_socket_dir
from ember.protocol.endpoint import daemon_socket_path, ipc_address
from ember.protocol.limits import LimitExceeded
from ember.protocol.shm_ring import ShmRing, owner_id, remove_dead_segments

DEMO_NAME = "ember-demo"
# the planner speaks `ember plan`'s flags; what they are called in the daemon's configuration
_DAEMON_KNOBS = ("In ember serve's configuration: --ctx is engine.ctx, --seqs is engine.max_active, --kv-dtype is "
                 "engine.kv_dtype (or EMBER_KV_DTYPE), --prefill-chunk is engine.max_step_tokens.")


def serve(config: Config) -> int:
    configure_logging(config.server.log_format, config.server.log_level)
    log = get_logger()
    notifier = Notifier()
    path = Path(config.server.socket) if config.server.socket else daemon_socket_path()
    ipc_address(path)  # refuse an unbindable path before anything else
    prepare_socket_dir(path, config.server.socket_group)
    lock = SocketLock(path)
    lock.acquire()
    try:
        _remove_dead_segments(path)
        specs = config.models or (ModelSpec(str(DEMO_MODEL), DEMO_NAME),)
        e = config.engine
        device = DeviceName.parse(e.device)
        backend = backend_for(device)
        devices = parse_devices(e.devices) if e.devices else [device]
        # engine.kv_dtype and act_dtype already merge file < EMBER_*_DTYPE < flag (daemon/config.py);
        # a model's feature_dtype is its config layer, under EMBER_FEATURE_DTYPE (ModelSpec.policy)
        act = None if e.act_dtype in ("", "auto") else e.act_dtype
        policy = resolve_policy([DeviceCaps.of(str(d)) for d in devices], env=_feature_env(),
                                flags=PrecisionSettings(kv=e.kv_dtype or None, act=act))
        try:
            _plan_models(config, specs, policy, devices, notifier)
        except PlanDoesNotFit as e:
            log.error("model does not fit", problem=str(e))
            raise PlanDoesNotFit(e.plan, f"{e}\n{_DAEMON_KNOBS}") from None
        backend.prepare(on_compile=lambda: _compiling(notifier))
        models = _load_models(config, specs, policy, notifier, owner_id(path))
        server = Server(config, models, path, notifier, _engine_factory(config, models, notifier, path))
        try:
            uvloop.run(server.run())
        finally:
            for model in models.values():  # stage and cold-expert workers; MoE routing statistics saved
                model.close()
    finally:
        lock.release()
        notifier.close()
    if server.failed:  # exit 1: systemd's Restart=on-failure starts a fresh daemon
        log.error("exit after an internal failure of the text or engine thread")
        return 1
    log.info("exit")
    return 0


def _remove_dead_segments(socket_path: Path) -> None:
    """A daemon killed on this socket left its logits segments behind (only a clean exit unlinks them):
    each holds slots x vocab floats of memory until reboot. The lock is ours, so they are garbage."""
    removed = remove_dead_segments(owner_id(socket_path))
    if removed:
        get_logger().info("removed the logits segments of a daemon that died", segments=len(removed),
                          bytes=sum(size for _, size in removed), names=[name for name, _ in removed])


def _plan_models(config: Config, specs: tuple[ModelSpec, ...], policy: PrecisionPolicy, devices: list[DeviceName],
                 notifier: Notifier) -> None:
    """Log every model's plan, each within what the ones before it left of the devices; PlanDoesNotFit
    (with what to change) for the first that does not fit, SplitSpecError for a split that cannot
    run it. Reads metadata only."""
    notifier.status("planning memory")
    budgets = stage_budgets(devices) if config.engine.devices else [backend_for(devices[0]).available_memory(devices[0])]
    for spec in specs:
        info = read_model_info(spec.path)
        split = None
        if config.engine.devices:  # the stages' layers, checked against this model
            stages = plan_stages(devices, parse_split(config.engine.split), info.config.n_layers, budgets,
                                 LayerWeights.of(info))
            split = tuple(s.end - s.first for s in stages)
        request = PlanRequest(devices=tuple(Device(str(d), b) for d, b in zip(devices, budgets, strict=True)),
                              policy=_model_policy(policy, spec), ctx=config.engine.context_for(info.config.context_length),
                              seqs=config.engine.max_active, prefill_chunk=config.engine.max_step_tokens, split=split,
                              expert_budget=spec.experts["expert_budget"])
        draft = DraftModel(read_model_info(spec.draft), spec.draft_tokens) if spec.draft else None
        plan = build_plan(info, request, draft)
        log_plan(plan, get_logger())
        plan.check()
        budgets = [b - d.required for b, d in zip(budgets, plan.devices, strict=True)]


def _feature_env() -> dict[str, str]:
    """The one precision variable daemon/config.py does not merge itself: the feature mirror's."""
    return {k: v for k, v in os.environ.items() if k == ENV_VARS["feature"]}


def _model_policy(policy: PrecisionPolicy, spec: ModelSpec) -> PrecisionPolicy:
    """The daemon's policy with this model's feature_dtype key as the config layer (below the variable)."""
    if not spec.feature_dtype or policy.sources.get("feature") == ENV_VARS["feature"]:
        return policy
    return replace(policy, feature=spec.feature_dtype, sources={**policy.sources, "feature": "config"})


def _compiling(notifier: Notifier) -> None:
    notifier.status("compiling the CPU kernels (first start; later starts load them)")
    get_logger().info("compiling the CPU kernels in a child process (first start after an install or upgrade)")


def _load_models(config: Config, specs: tuple[ModelSpec, ...], policy: PrecisionPolicy, notifier: Notifier,
                 shm_owner: str) -> dict[str, Model]:
    log = get_logger()
    models: dict[str, Model] = {}
    for i, spec in enumerate(specs, 1):
        name = spec.display_name
        notifier.status(f"loading {name} ({i}/{len(specs)})")
        t0 = time.perf_counter()
        e = config.engine
        model = load(spec.path, device=e.device, kv_dtype=policy.kv, decode_act=e.decode_act, devices=e.devices or None,
                     split=e.split or None, act_dtype=policy.act, max_step_tokens=e.max_step_tokens,
                     stage_threads=e.stage_threads, shm_owner=shm_owner, draft=spec.draft or None,
                     draft_tokens=spec.draft_tokens, feature_dtype=_model_policy(policy, spec).feature, **spec.experts)
        if model.pipeline is not None:
            model.pipeline.heartbeat = notifier.watchdog  # while its stages restart, on the engine thread
            for stage in model.pipeline.stages:
                log.info("layer-split stage ready", model=name, stage=stage.name, pid=stage.pid, binding=stage.binding,
                         act_dtype=model.pipeline.act_dtype)
            if model.pipeline.engine_stage is not None:
                log.info("layer-split stage ready", model=name, stage=model.pipeline.engine_stage.name, pid=os.getpid(),
                         binding="the engine's own thread", act_dtype=model.pipeline.act_dtype)
        if config.engine.warmup:
            notifier.status(f"warming up {name}")
            # a short prompt and a few sampled tokens: every kernel a request uses is loaded, so the
            # first client does not pay for it and READY means ready
            list(model.generate(list(range(1, 9)), max_tokens=3, temperature=0.5, top_k=5, seed=0, ignore_eos=True))
            model.tokenize("warm up")  # and a GGUF tokenizer's BPE, built by the first encode, is built
        models[name] = model
        log.info("model ready", model=name, path=spec.path, seconds=round(time.perf_counter() - t0, 2))
    return models


class RingBudget:
    """The shared memory all clients' logits rings may hold together (server.max_logits_bytes): one ring
    per client is bounded by logits_slots, but the number of clients is not. A ring gives its bytes back
    when it is closed (its client went away, or the engine stopped)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.rings = 0
        self._lock = threading.Lock()  # rings are made and closed on the engine thread; cheap insurance

    def take(self, nbytes: int) -> None:
        """Count a ring of `nbytes` in, or raise LimitExceeded (the client gets Error{limit})."""
        with self._lock:
            if self.used + nbytes > self.limit:
                raise LimitExceeded(
                    f"server.max_logits_bytes: {self.rings} clients' logits rings hold {self.used} bytes; one more of "
                    f"{nbytes} bytes is over the limit of {self.limit} (retry when a client with logits disconnects)")
            self.used += nbytes
            self.rings += 1

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes
            self.rings -= 1


def _engine_factory(config: Config, models: dict[str, Model], notifier: Notifier, socket_path: Path
                    ) -> Callable[[Callable[[list[Output]], None], Callable[[], None]], TextWorker]:
    vocab = max(m.config.vocab for m in models.values())
    group = grp.getgrnam(config.server.socket_group).gr_gid if config.server.socket_group else None
    mode = 0o640 if group is not None else 0o600  # readable by those who may connect, no more
    e = config.engine
    backend = backend_for(e.device)
    contexts = {name: e.context_for(m.config.context_length) for name, m in models.items()}
    owner = owner_id(socket_path)
    slots = config.server.logits_slots
    ring_bytes = ShmRing.bytes_for(slots, vocab * 4)
    budget = RingBudget(config.server.max_logits_bytes)
    if ring_bytes > budget.limit:
        get_logger().warning("one logits ring is bigger than server.max_logits_bytes: every return_logits request "
                             "will be refused with Error{limit}; raise the bound or lower server.logits_slots",
                             ring_bytes=ring_bytes, max_logits_bytes=budget.limit)

    def new_ring() -> ShmRing:
        budget.take(ring_bytes)
        try:
            return ShmRing.create(slots, vocab * 4, mode=mode, group=group, owner=owner,
                                  on_close=lambda: budget.give(ring_bytes))
        except BaseException:
            budget.give(ring_bytes)
            raise

    def core(name: str, model: Model) -> EngineCore:
        # the KV pool the plan counted: max_active sequences of ctx tokens
        return model.engine(e.max_active * _round_up(contexts[name], KV_BLOCK), max_running=e.max_active, max_context=contexts[name],
                            prefix_caching=e.prefix_caching, max_step_tokens=e.max_step_tokens,
                            decode_burst=e.decode_burst_ms / 1000)

    def make(publish: Callable[[list[Output]], None], on_stopped: Callable[[], None]) -> TextWorker:
        return TextWorker(cores={name: core(name, m) for name, m in models.items()}, limits=config.limits,
                          publish=publish, on_stopped=on_stopped, setup=lambda: backend.use_threads(e.threads),
                          new_ring=new_ring, heartbeat=notifier.watchdog, heartbeat_interval=notifier.watchdog_interval,
                          stall_timeout=config.server.stall_timeout)

    return make


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
