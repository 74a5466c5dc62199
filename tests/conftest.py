"""Shared fixtures, and the CPU kernel cache made complete before the first test (a fresh machine
compiles it once, here, in parallel child processes: ~2.5 minutes on 2 cores; later runs only load
it), so that no test's timeout — a daemon's start above all — pays for the compile."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tiny_models import build_hf_model


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache() -> None:
    from ember.daemon.runner.kernel_cache import ensure_kernel_cache

    ensure_kernel_cache()


@pytest.fixture
def hf_model(tmp_path: Path) -> Callable[..., tuple[Path, Any]]:
    def make(arch: str, **overrides: Any) -> tuple[Path, Any]:
        return build_hf_model(arch, tmp_path / arch, **overrides)

    return make
