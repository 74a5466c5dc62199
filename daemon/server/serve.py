"""`ember serve`: configuration -> socket lock -> memory plan -> tokenizers (here) and the engine
process (engine_host.py: models loaded and warmed there) -> READY -> serve -> exit 0.

The lock is taken before anything slow, so a second daemon on the same socket fails at once with a
message naming the first. Holding it, the daemon removes the logits segments a killed predecessor on
the same socket left in /dev/shm (protocol/shm_ring.py names them after the socket and their creator's
pid). Each model's memory plan (daemon/planning/planner.py) is computed from its metadata and logged
before a weight is read; a model that does not fit stops the start with the planner's explanation.
Models are loaded once and stay resident for the life of the engine process, which the front starts
again if it dies. The clients' logits rings are bounded together by server.max_logits_bytes
(RingBudget, in the engine process).
"""
from __future__ import annotations

import grp
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import msgspec
import uvloop

from ember.daemon.config import Config, ModelSpec
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.loader.hub import DownloadLines, Hub, resolve_model
from ember.daemon.runner.devices import DeviceName, backend_for
from ember.daemon.logging_setup import configure_logging, get_logger
from ember.daemon.server.notify import Notifier
from ember.daemon.planning.planner import (Device, DraftModel, LayerWeights, PlanDoesNotFit, PlanRequest, build_plan,
                                          log_plan, read_model_info)
from ember.daemon.planning.precision import ENV_VARS, DeviceCaps, PrecisionPolicy, PrecisionSettings, resolve_policy
from ember.daemon.runner.split_spec import parse_devices, parse_split, plan_stages, stage_budgets
from ember.daemon.server.engine_host import EngineHost
from ember.daemon.server.engine_wire import EngineLaunch
from ember.daemon.server.server import Server
from ember.daemon.server.socket_dir import SocketLock, prepare_socket_dir
from ember.daemon.text.text_model import TextModel, open_text_model
from ember.daemon.server.text_worker import Output, TextWorker
from ember.protocol.endpoint import daemon_socket_path, ipc_address
from ember.daemon.experts.routing_stats import cache_root
from ember.daemon.speculative.ngram_proposer import NGRAM
from ember.protocol.shm_ring import owner_id, remove_dead_segments

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
    notifier.on_status = lock.note  # `ember status` reads what a daemon that does not serve yet is doing
    notifier.status("starting")
    engine: EngineHost | None = None
    try:
        _remove_dead_segments(path)
        config = msgspec.structs.replace(config, models=config.models or (ModelSpec(str(DEMO_MODEL), DEMO_NAME),))
        config = _with_local_paths(config, notifier)
        e = config.engine
        device = DeviceName.parse(e.device)
        devices = parse_devices(e.devices) if e.devices else [device]
        # engine.kv_dtype and act_dtype already merge file < EMBER_*_DTYPE < flag (daemon/config.py);
        # a model's feature_dtype is its config layer, under EMBER_FEATURE_DTYPE (ModelSpec.policy)
        act = None if e.act_dtype in ("", "auto") else e.act_dtype
        policy = resolve_policy([DeviceCaps.of(str(d)) for d in devices], env=_feature_env(),
                                flags=PrecisionSettings(kv=e.kv_dtype or None, act=act))
        try:
            _plan_models(config, config.models, policy, devices, notifier)
        except PlanDoesNotFit as e:
            log.error("model does not fit", problem=str(e))
            raise PlanDoesNotFit(e.plan, f"{e}\n{_DAEMON_KNOBS}") from None
        models = _text_models(config)
        engine = EngineHost(_launch(config, policy, path, notifier.watchdog_interval), notifier)
        notifier.status("starting the engine")
        engine.start_engine()
        log.info("engine process ready", pid=engine.pid)
        server = Server(config, models, path, notifier, _text_worker_factory(config, models, engine))
        uvloop.run(server.run())
    finally:
        if engine is not None:
            engine.close()
        notifier.on_status = None
        lock.release()
        notifier.close()
    if server.failed:  # exit 1: systemd's Restart=on-failure starts a fresh daemon
        log.error("exit after an internal failure of the text thread or the engine")
        return 1
    log.info("exit")
    return 0


def _with_local_paths(config: Config, notifier: Notifier) -> Config:
    """Each model (and draft) named on the hub (daemon/loader/hub.py) replaced by its file in the hub's
    cache, downloaded first where it is not there (huggingface_hub's bar on a terminal, else a log line
    and a status line every tenth); the model keeps the name it was given. ModelNameError (one line)
    for a name that cannot be had."""
    hub = Hub.from_env(os.environ)
    lines = None
    if not sys.stderr.isatty():
        def show(line: str) -> None:
            get_logger().info(line)
            notifier.status(line)

        lines = DownloadLines(show)
    specs = []
    for spec in config.models:
        path = resolve_model(spec.path, hub, lines)
        draft = str(resolve_model(spec.draft, hub, lines)) if spec.draft and spec.draft != NGRAM else spec.draft
        if str(path) != spec.path:
            get_logger().info("model by name", name=spec.path, path=str(path))
        specs.append(msgspec.structs.replace(spec, path=str(path), draft=draft, name=spec.display_name))
    return msgspec.structs.replace(config, models=tuple(specs))


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
                              expert_budget=spec.experts["expert_budget"], cpu_threads=config.engine.threads or None,
                              proposals=spec.draft_tokens if spec.draft == NGRAM else 0)
        # (n-gram proposals need no memory but their logits rows, `proposals` above, and the lookahead's
        # KV slots, within each sequence's context)
        draft = DraftModel(read_model_info(spec.draft), spec.draft_tokens) if spec.draft and spec.draft != NGRAM else None
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


def _text_models(config: Config) -> dict[str, TextModel]:
    """Each model's tokenizer and chat template, for the front (the engine process loads the weights).
    A GGUF tokenizer's BPE, built by the first encode, is built now: READY means ready."""
    models = {}
    for spec in config.models:
        model = open_text_model(spec.path)
        model.tokenize("warm up")
        models[spec.display_name] = model
    return models


def _launch(config: Config, policy: PrecisionPolicy, socket_path: Path, watchdog: float | None) -> EngineLaunch:
    group = grp.getgrnam(config.server.socket_group).gr_gid if config.server.socket_group else None
    return EngineLaunch(config=config, kv_dtype=policy.kv, act_dtype=policy.act,
                        feature_dtypes={m.display_name: _model_policy(policy, m).feature for m in config.models},
                        shm_owner=owner_id(socket_path),
                        ring_mode=0o640 if group is not None else 0o600,  # readable by those who may connect, no more
                        ring_group=group, heartbeat_interval=watchdog, cache_dir=str(cache_root(os.environ)))


def _text_worker_factory(config: Config, models: dict[str, TextModel], engine: EngineHost
                         ) -> Callable[[Callable[[list[Output]], None], Callable[[], None]], TextWorker]:
    contexts = {name: config.engine.context_for(m.config.context_length) for name, m in models.items()}

    def make(publish: Callable[[list[Output]], None], on_stopped: Callable[[], None]) -> TextWorker:
        return TextWorker(engine=engine, contexts=contexts, limits=config.limits, publish=publish,
                          on_stopped=on_stopped)

    return make
