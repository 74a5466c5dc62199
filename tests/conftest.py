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


@pytest.fixture(scope="session", autouse=True)
def _llama_cpp_without_amx() -> None:
    """A llama-cpp-python built with its AMX kernels (-march=native on a Xeon with AMX) segfaults on
    these VMs in the first inference after it repacks the weights into its AMX buffers (llama.cpp issue
    20824; .ci/run builds it without them). Where such a build is installed, the oracle loads models
    without extra buffer types, so every weight stays in llama.cpp's plain CPU buffers."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return
    import llama_cpp
    import llama_cpp.llama as llama_module

    if b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info():
        return
    defaults = llama_cpp.llama_model_default_params

    def without_extra_buffers() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_module.llama_cpp.llama_model_default_params = without_extra_buffers


@pytest.fixture
def hf_model(tmp_path: Path) -> Callable[..., tuple[Path, Any]]:
    def make(arch: str, **overrides: Any) -> tuple[Path, Any]:
        return build_hf_model(arch, tmp_path / arch, **overrides)

    return make
