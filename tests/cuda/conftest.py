"""tests/cuda run the CUDA kernels on a GPU where there is one, else on numba's CUDA simulator, and
skip (with the reason) where neither can run.

numba decides between the simulator and the driver when numba.cuda is first imported, reading
NUMBA_ENABLE_CUDASIM from numba's config, which `import numba` (any CPU kernel) has already read. So,
before anything imports numba.cuda: set the variable (unless the caller chose: NUMBA_ENABLE_CUDASIM=0
forces the GPU) and reload numba's config. Child processes (the daemon test) inherit the variable.
"""
from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator

import pytest


def _gpu_present() -> bool:
    return os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi") is not None


if "NUMBA_ENABLE_CUDASIM" not in os.environ and not _gpu_present():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
if "numba.cuda" not in sys.modules:
    import numba.core.config

    numba.core.config.reload_config()


def _skip_reason() -> str | None:
    try:
        from ember.kernels.cuda.device import unavailable_reason
    except ImportError as e:
        return f"numba-cuda is not installed: {e}"
    reason = unavailable_reason()
    if reason is not None:
        return f"no CUDA device and no simulator ({reason})"
    return None


_REASON = _skip_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _REASON is None:
        return
    here = os.path.dirname(__file__)
    for item in items:  # a module with NEEDS_DEVICE = False tests the machine without one, and runs
        if str(item.path).startswith(here) and getattr(item.module, "NEEDS_DEVICE", True):
            item.add_marker(pytest.mark.skip(reason=_REASON))


@pytest.fixture(autouse=True, scope="module")
def _simulator_switch_interval() -> Iterator[None]:
    """What CudaBackend.prepare does for a process running the simulator (see there), for the tests
    that call kernels directly; the rest of the suite gets its interval back."""
    before = sys.getswitchinterval()
    if _REASON is None and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(before)


# --- the native kernels' tests: the host harness where there is no GPU, CuPy where there is one ---------
def gpu_ops():  # type: ignore[no-untyped-def]
    """NativeOps on the GPU through CuPy, or the test skips (no CuPy, no device)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as e:  # noqa: BLE001 - any reason there is no GPU skips the GPU half
        pytest.skip(f"no CUDA device through CuPy: {e}")
    from ember.kernels.cuda.native_launch import NativeOps

    return NativeOps.on_gpu()


@pytest.fixture(scope="session")
def lib():  # type: ignore[no-untyped-def]
    """The host harness (tests/cuda/native_harness.cu), built by nvcc once per change of its sources."""
    from tests.cuda import native_toolchain

    return native_toolchain.build_harness()


@pytest.fixture(params=["harness", "gpu"])
def ops(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """The native kernels' NativeOps over numpy with each launch run by the host harness, and on a GPU
    through CuPy (the numba backend's tests define an `ops` of their own, which takes precedence)."""
    if request.param == "gpu":
        return gpu_ops()
    import numpy as np

    from ember.kernels.cuda.native_launch import NativeOps
    from tests.cuda.native_fake_device import HarnessLauncher

    return NativeOps(np, HarnessLauncher(request.getfixturevalue("lib")))
