"""`ember gateway`: the OpenAI-compatible HTTP API (client/gateway/) in front of a running daemon.

  ember gateway [--listen 127.0.0.1:8000] [--socket PATH] [--api-key KEY | env EMBER_API_KEY]

A non-loopback --listen without an API key is refused (one line, exit 1). Imports nothing of the
daemon's kernels: the gateway is a client.
"""
from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import Any

from ember.client.gateway.config import API_KEY_ENV, DEFAULT_LISTEN, GatewayConfig, parse_listen

_DEFAULTS = GatewayConfig()


def add_gateway_parser(sub: Any) -> None:
    p = sub.add_parser("gateway", help="serve the OpenAI-compatible HTTP API (and /metrics) in front of the daemon",
                       description="Serve OpenAI's /v1/chat/completions, /v1/completions and /v1/models, /health and "
                                   "Prometheus /metrics over HTTP, as a client of a running `ember serve`. "
                                   "docs/gateway.md has the details.")
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                   help=f"address to serve on (default {DEFAULT_LISTEN}; not loopback: an API key is required)")
    p.add_argument("--socket", metavar="PATH", help="the daemon's socket (default: the usual places)")
    p.add_argument("--api-key", metavar="KEY", help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; "
                                                    "the variable keeps the key out of the process list)")
    p.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes, metavar="N",
                   help=f"larger request bodies get 413 (default {_DEFAULTS.max_body_bytes})")
    p.add_argument("--max-requests", type=int, default=_DEFAULTS.max_requests, metavar="N",
                   help=f"generation requests carried at once, more get 429 (default {_DEFAULTS.max_requests})")
    p.add_argument("--requests-per-connection", type=int, default=_DEFAULTS.per_connection, metavar="N",
                   help="streams per daemon connection: at most the daemon's limits.max_requests_per_client "
                        f"(default {_DEFAULTS.per_connection})")
    add_cors_option(p)
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    p.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)  # ember serve --http: a socket bound for us
    p.set_defaults(func=_gateway)


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    host, port = parse_listen(args.listen)
    return GatewayConfig(host=host, port=port, socket=Path(args.socket) if args.socket else None,
                         api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                         max_body_bytes=args.max_body_bytes, max_requests=args.max_requests,
                         per_connection=args.requests_per_connection, cors_origins=tuple(args.cors_origin or ()))


def add_cors_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="let a browser page from ORIGIN (e.g. http://localhost:3000, or * for any) call the API "
                        "(repeatable; default: none)")


def _gateway(args: argparse.Namespace) -> int:
    from ember.client.gateway.server import run_gateway

    config = gateway_config(args)  # GatewayConfigError (a ValueError): main() prints it in one line
    sock = socket.socket(fileno=args.listen_fd) if args.listen_fd is not None else None
    return run_gateway(config, sock, args.log_format)
