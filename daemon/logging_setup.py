"""structlog for the daemon: JSON lines under systemd (or without a terminal), readable lines on a TTY.

Request lines carry `req` (the daemon's request id, `<client>:<id>`): every logger for a request is
bound to it once (Request.log), so no line about a request goes out without it.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def use_json(fmt: str, stream: TextIO, env: dict[str, str] | None = None) -> bool:
    env = dict(os.environ) if env is None else env
    if fmt != "auto":
        return fmt == "json"
    under_systemd = "INVOCATION_ID" in env or "JOURNAL_STREAM" in env
    return under_systemd or not stream.isatty()


def configure_logging(fmt: str = "auto", level: str = "info", stream: TextIO | None = None) -> None:
    stream = sys.stderr if stream is None else stream
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json(fmt, stream) else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger("ember").bind(**bound)
