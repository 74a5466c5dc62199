"""`ember cluster serve`: the replicas as a Ray Serve application, and the ingress in front of them.

`deploy` joins (or starts) a Ray cluster, starts Serve without its own HTTP proxy (the ingress is
ember's), and runs the application: EmberReplica replicas (cluster/replica.py), each reserving
replicas.cpus CPUs and replicas.gpus GPUs on whichever node has them, routed by PrefixRouter, scaled by
Serve between replicas.min and replicas.max on the requests they carry. `serve_cluster` then serves the
ingress (cluster/ingress.py) on this process until SIGTERM or SIGINT, and deletes the application on
the way out: the replicas live as long as the command that made them.
"""
from __future__ import annotations

import asyncio
from typing import Any

import uvloop

from ember.client.gateway.config import GatewayConfig
from ember.client.gateway.server import serve_app
from ember.cluster.config import ClusterConfig
from ember.cluster.ingress import Ingress, build_ingress_app
from ember.cluster.replica import STOP_GRACE, EmberReplica
from ember.daemon.logging_setup import configure_logging, get_logger

DEPLOYMENT = "EmberReplica"


def deploy(config: ClusterConfig) -> Any:
    """The replicas' DeploymentHandle, once every replica it starts with is serving."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    if not ray.is_initialized():
        ray.init(address=config.ray.address or None, namespace=config.ray.namespace, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    r, g = config.replicas, config.routing
    scaling: dict[str, Any]
    if r.max > r.min:
        scaling = {"autoscaling_config": {"min_replicas": r.min, "max_replicas": r.max,
                                          "initial_replicas": r.initial or r.min,
                                          "target_ongoing_requests": r.target_ongoing_requests,
                                          "upscale_delay_s": r.upscale_delay_s, "downscale_delay_s": r.downscale_delay_s,
                                          "metrics_interval_s": min(10.0, max(0.5, r.upscale_delay_s / 2)),
                                          "look_back_period_s": min(30.0, max(1.0, r.upscale_delay_s))}}
    else:
        scaling = {"num_replicas": r.min}
    router = RequestRouterConfig(request_router_class="ember.cluster.prefix_router:PrefixRouter",
                                 request_router_kwargs={"block_chars": g.block_chars, "min_match": g.min_match,
                                                        "max_imbalance": g.max_imbalance, "max_blocks": g.max_blocks})
    replica = serve.deployment(EmberReplica, name=DEPLOYMENT, ray_actor_options={"num_cpus": r.cpus, "num_gpus": r.gpus},
                               max_ongoing_requests=r.max_ongoing_requests, health_check_period_s=r.health_check_period_s,
                               graceful_shutdown_timeout_s=STOP_GRACE + 5, request_router_config=router, **scaling)
    app = replica.bind(list(config.daemon.args), config.daemon.config, max(1, int(r.cpus)), r.start_timeout_s)
    return serve.run(app, name=config.ray.app, route_prefix=None)


def replica_ids(app: str) -> list[str]:
    """The live replicas' unique ids, from Ray's actor table (their actors are named
    SERVE_REPLICA::<app>#<deployment>#<id>)."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("class_name", "=", f"ServeReplica:{app}:{DEPLOYMENT}"), ("state", "=", "ALIVE")],
                         raise_on_missing_output=False)
    return sorted(a.name.rsplit("#", 1)[-1] for a in actors if a.name)


def serve_cluster(config: ClusterConfig, gateway: GatewayConfig, log_format: str = "auto") -> int:
    """Deploy, then serve the ingress until SIGTERM or SIGINT; 0 on a clean stop."""
    configure_logging(log_format)
    handle = deploy(config)
    try:
        return uvloop.run(serve_ingress(Ingress(handle, gateway, config.ingress.retries,
                                                lambda: replica_ids(config.ray.app))))
    finally:
        from ray import serve

        serve.delete(config.ray.app)


async def serve_ingress(ingress: Ingress, stop: asyncio.Event | None = None,
                        started: asyncio.Future[str] | None = None) -> int:
    """The ingress on this loop until `stop` is set (default: SIGTERM or SIGINT); `started` gets its URL."""
    log = get_logger()

    def listening(url: str) -> None:
        log.info("cluster ingress listening", url=url, api_key=ingress.config.api_key is not None)
        if started is not None:
            started.set_result(url)

    await serve_app(build_ingress_app(ingress), ingress.config, None, stop, listening,
                    lambda: log.info("cluster ingress stopping", in_flight=ingress.in_flight))
    return 0
