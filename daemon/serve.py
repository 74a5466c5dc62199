"""`ember serve`: configuration -> socket lock -> models loaded and warmed -> READY -> serve -> exit 0.

The lock is taken before anything slow, so a second daemon on the same socket fails at once with a
message naming the first. Models are loaded once and stay resident for the life of the process.
"""
from __future__ import annotations

import grp
import time
from collections.abc import Callable
from pathlib import Path

import uvloop

from ember.daemon.config import Config, ModelSpec
from ember.daemon.demo_model import DEMO_MODEL
from ember.daemon.engine import Engine, Output
from ember.daemon.logging_setup import configure_logging, get_logger
from ember.daemon.notify import Notifier
from ember.daemon.runtime import Model, load
from ember.daemon.server import Server
from ember.daemon.socket_dir import SocketLock, prepare_socket_dir
from ember.daemon.solo_decode import SoloDecode
from ember.kernels.sampling import SamplingParams
from ember.protocol.endpoint import daemon_socket_path, ipc_address
from ember.protocol.shm_ring import ShmRing

DEMO_NAME = "ember-demo"


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
        models = _load_models(config, notifier)
        server = Server(config, models, path, notifier, _engine_factory(config, models, notifier))
        uvloop.run(server.run())
    finally:
        lock.release()
        notifier.close()
    log.info("exit")
    return 0


def _load_models(config: Config, notifier: Notifier) -> dict[str, Model]:
    log = get_logger()
    specs = config.models or (ModelSpec(str(DEMO_MODEL), DEMO_NAME),)
    models: dict[str, Model] = {}
    for i, spec in enumerate(specs, 1):
        name = spec.display_name
        notifier.status(f"loading {name} ({i}/{len(specs)})")
        t0 = time.perf_counter()
        model = load(spec.path, device=config.engine.device, kv_dtype=config.engine.kv_dtype)
        if config.engine.warmup:
            notifier.status(f"warming up {name}")
            _warm_up(model)
        models[name] = model
        log.info("model ready", model=name, path=spec.path, seconds=round(time.perf_counter() - t0, 2))
    return models


def _warm_up(model: Model) -> None:
    """A short prompt and a few tokens: compiles (or loads from cache) every kernel a request uses, so
    the first client does not pay for it and READY means ready."""
    decode = SoloDecode(model, [1, 2, 3, 4, 5, 6, 7, 8], 3, SamplingParams(temperature=0.5, top_k=5), seed=0,
                        ignore_eos=True)
    while not decode.done:
        decode.step()


def _engine_factory(config: Config, models: dict[str, Model], notifier: Notifier
                    ) -> Callable[[Callable[[list[Output]], None], Callable[[], None]], Engine]:
    vocab = max(m.config.vocab for m in models.values())
    group = grp.getgrnam(config.server.socket_group).gr_gid if config.server.socket_group else None
    mode = 0o640 if group is not None else 0o600  # readable by those who may connect, no more

    def new_ring() -> ShmRing:
        return ShmRing.create(config.server.logits_slots, vocab * 4, mode=mode, group=group)

    def make(publish: Callable[[list[Output]], None], on_stopped: Callable[[], None]) -> Engine:
        return Engine(max_active=config.engine.max_active, limits=config.limits, publish=publish,
                      on_stopped=on_stopped, new_ring=new_ring, heartbeat=notifier.watchdog,
                      heartbeat_interval=notifier.watchdog_interval)

    return make
