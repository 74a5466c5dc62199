"""`ember cluster serve CONFIG`'s configuration: the Ray cluster to join, the replicas (resources, how
many, when to add one), how requests are routed to them, and the ingress that fronts them.

A TOML file; every section and key is optional, and an unknown one is refused by name (a typo in a
deployment file must not pass for a default). Example (docs/cluster.md has all of it):

    [ray]
    address = "auto"            # join the running cluster ("" starts a local one)
    [ingress]
    listen = "127.0.0.1:8000"   # another address needs EMBER_API_KEY
    [replicas]
    min = 1
    max = 4
    cpus = 4                    # CPUs each replica reserves (its daemon's kernel threads)
    target_ongoing_requests = 4 # autoscaling: add a replica when they carry more than this each
    [daemon]
    args = ["--model", "/models/qwen3-8b-q4_k_m.gguf", "--max-active", "8"]
"""
from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec

from ember.client.gateway.config import GatewayConfig, GatewayConfigError, parse_listen


class ClusterConfigError(ValueError):
    """The configuration is refused; the message names the key and what to change."""


class RayOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    address: str = ""  # "auto": the cluster `ray start` made here; "ray://...": a remote one; "": a local one
    namespace: str = "ember"
    app: str = "ember"  # the Serve application's name


class IngressOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    listen: str = "127.0.0.1:8000"
    max_body_bytes: int = 4 << 20
    max_requests: int = 512  # requests carried at once; beyond, 429 at once
    retries: int = 2  # other replicas tried for a request whose replica died before it answered anything


class ReplicaOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    min: int = 1
    max: int = 1
    initial: int | None = None  # default: min
    cpus: float = 1.0  # reserved per replica on its node; its daemon gets --threads max(1, int(cpus))
    gpus: float = 0.0  # a replica with a GPU serves on cuda:0 of the GPUs Ray gave it (add --device to args)
    target_ongoing_requests: float = 4.0  # per replica; Serve adds replicas above, removes below
    upscale_delay_s: float = 30.0  # how long the load must stay above the target before a replica is added
    downscale_delay_s: float = 600.0  # ... below, before one is removed
    max_ongoing_requests: int = 32  # a replica carrying this many gets no more until one ends
    health_check_period_s: float = 5.0
    start_timeout_s: float = 600.0  # the daemon's start: the first one after an install compiles kernels


class RoutingOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    block_chars: int = 64  # prompts are matched in blocks of this many characters
    min_match: float = 0.1  # a replica holding at least this share of a prompt's blocks is preferred
    max_imbalance: int = 8  # ... unless it carries this many more requests than the least loaded
    max_blocks: int = 1 << 16  # blocks remembered per replica (least recently routed forgotten first)


class DaemonOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    args: list[str] = msgspec.field(default_factory=list)  # `ember serve` options (no --socket, --http)
    config: str = ""  # a daemon TOML file readable on every node ("": the daemon's defaults)


class ClusterConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    ray: RayOptions = RayOptions()
    ingress: IngressOptions = IngressOptions()
    replicas: ReplicaOptions = ReplicaOptions()
    routing: RoutingOptions = RoutingOptions()
    daemon: DaemonOptions = DaemonOptions()

    def __post_init__(self) -> None:
        r = self.replicas
        _check(1 <= r.min <= r.max, f"replicas.min and replicas.max need 1 <= min <= max, got {r.min} and {r.max}")
        _check(r.initial is None or r.min <= r.initial <= r.max,
               f"replicas.initial must be in [min, max] = [{r.min}, {r.max}], got {r.initial}")
        _check(r.cpus > 0 and r.gpus >= 0, f"replicas.cpus must be > 0 and gpus >= 0, got {r.cpus} and {r.gpus}")
        _check(r.target_ongoing_requests > 0 and r.max_ongoing_requests >= 1,
               "replicas.target_ongoing_requests must be > 0 and max_ongoing_requests >= 1")
        _check(r.health_check_period_s > 0 and r.start_timeout_s > 0 and r.upscale_delay_s >= 0
               and r.downscale_delay_s >= 0, "replica timeouts and delays must be positive")
        g = self.routing
        _check(g.block_chars >= 1 and g.max_blocks >= 1 and g.max_imbalance >= 0 and 0 <= g.min_match <= 1,
               "routing: block_chars, max_blocks >= 1, max_imbalance >= 0, min_match in [0, 1]")
        i = self.ingress
        _check(i.max_body_bytes >= 1 and i.max_requests >= 1 and i.retries >= 0,
               "ingress: max_body_bytes, max_requests >= 1, retries >= 0")
        owned = {"--socket", "--http", "--threads", "--config"}.intersection(a.split("=")[0] for a in self.daemon.args)
        _check(not owned, f"daemon.args must not set {', '.join(sorted(owned))}: the replica sets them "
                          "(threads from replicas.cpus, the daemon's TOML from daemon.config)")

    def gateway(self, api_key: str | None) -> GatewayConfig:
        """The ingress's address and exposure, checked as the gateway checks its own (GatewayConfigError)."""
        host, port = parse_listen(self.ingress.listen)
        return GatewayConfig(host=host, port=port, api_key=api_key, max_body_bytes=self.ingress.max_body_bytes,
                             max_requests=self.ingress.max_requests)


def load_cluster_config(path: str | Path | None) -> ClusterConfig:
    """The configuration in `path` (None: every default); ClusterConfigError names what is wrong."""
    if path is None:
        return ClusterConfig()
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ClusterConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ClusterConfigError(f"{path} is not TOML: {e}") from None
    try:
        return msgspec.convert(raw, ClusterConfig)
    except (msgspec.ValidationError, GatewayConfigError) as e:
        raise ClusterConfigError(f"{path}: {e}") from None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ClusterConfigError(message)
