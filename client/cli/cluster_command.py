"""`ember cluster serve [CONFIG]`: replicas of the daemon on a Ray cluster behind one HTTP endpoint
(cluster/, docs/cluster.md). Needs the `cluster` extra (Ray Serve); says so in one line without it.

  ember cluster serve [CONFIG] [--address ADDR] [--listen HOST:PORT] [--api-key KEY | env EMBER_API_KEY]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any

from ember.client.gateway.config import API_KEY_ENV


def add_cluster_parser(sub: Any) -> None:
    p = sub.add_parser("cluster", help="serve replicas of the daemon on a Ray cluster behind one HTTP endpoint",
                       description="ember on Ray (docs/cluster.md): needs the cluster extra, "
                                   "pip install 'ember[cluster]'.")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve = actions.add_parser("serve", help="deploy the replicas (Ray Serve) and serve the OpenAI-compatible API",
                               description="Join the Ray cluster (or start a local one), run the replicas of "
                                           "CONFIG's [replicas] and [daemon], and serve every API the gateway "
                                           "speaks on [ingress] listen, routed by prompt prefix, until SIGTERM; "
                                           "the replicas stop with it.")
    serve.add_argument("config", nargs="?", metavar="CONFIG", help="the cluster's TOML file (default: every default: "
                                                                     "one replica of the demo model, a local Ray)")
    serve.add_argument("--address", help="Ray cluster to join: auto, ray://HOST:PORT, or HOST:PORT (overrides "
                                         "[ray] address; default: start a local one)")
    serve.add_argument("--listen", metavar="HOST:PORT", help="the ingress's address (overrides [ingress] listen)")
    serve.add_argument("--api-key", metavar="KEY", help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    serve.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    import msgspec

    from ember.cluster.config import load_cluster_config

    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise ValueError("ember cluster needs Ray Serve: pip install 'ember[cluster]'")
    config = load_cluster_config(args.config)
    if args.address is not None:
        config = msgspec.structs.replace(config, ray=msgspec.structs.replace(config.ray, address=args.address))
    if args.listen is not None:
        config = msgspec.structs.replace(config, ingress=msgspec.structs.replace(config.ingress, listen=args.listen))
    gateway = config.gateway(args.api_key or os.environ.get(API_KEY_ENV) or None)  # refuses exposure before Ray starts
    from ember.cluster.deployment import serve_cluster

    return serve_cluster(config, gateway, args.log_format)
