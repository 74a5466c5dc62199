"""How ember meets the cuda device kind: lazily (CPU work never imports numba.cuda or cupy), with one
clear line where no GPU can run, and through every entry point (ember.load, ember plan)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ember.client.cli.main import main
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.runner.devices import CudaUnavailable, DeviceName, backend_for

pytestmark = pytest.mark.cuda

NEEDS_DEVICE = False  # these run on any machine (conftest.py): most are about not having a GPU


def _need_device() -> None:
    from ember.kernels.cuda.device import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no CUDA device and no simulator ({reason})")


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_cpu_work_never_imports_numba_cuda_or_cupy() -> None:
    code = ("import sys, ember\n"
            "from ember.daemon.runner.devices import backend_for\n"
            "assert backend_for('cuda:0').kind == 'cuda'\n"  # registered, not imported
            f"m = ember.load({str(DEMO_MODEL)!r})\n"
            "list(m.generate('def f', max_tokens=2))\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] == 'cupy' or n.startswith('numba.cuda')))\n")
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has a GPU driver")
def test_no_gpu_and_no_simulator_is_one_clear_line() -> None:
    out = subprocess.run([sys.executable, "-m", "ember.client.cli", "run", "--device", "cuda:0", str(DEMO_MODEL), "hi"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0"})
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember: error: cuda:0: ")
    assert "NUMBA_ENABLE_CUDASIM=1" in lines[0] or "numba-cuda" in lines[0]  # what is missing, and what to do


def test_a_device_index_beyond_the_machines_is_refused() -> None:
    pytest.importorskip("numba.cuda")
    _need_device()
    from numba import cuda

    beyond = DeviceName("cuda", len(cuda.gpus))
    with pytest.raises(CudaUnavailable, match=f"{beyond}: no such device"):
        backend_for(beyond).ops(beyond)


def test_plan_for_a_cuda_budget(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["plan", str(DEMO_MODEL), "--device", "cuda:0=24GiB"]) == 0
    out = capsys.readouterr().out
    assert "cuda:0" in out and "24.00 GiB" in out and "It fits." in out
