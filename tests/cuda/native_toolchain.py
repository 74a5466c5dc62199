"""The CUDA toolchain the native-kernel tests use without a GPU: nvcc (on these machines), and NVRTC and
cuobjdump, fetched from PyPI's NVIDIA wheels into a cache on first use. A test whose tool is missing and
cannot be fetched (no nvcc, no network) skips with the reason.

Also: ptxas's per-kernel report parsed, cuobjdump's SASS split by function, and the host harness
(tests/cuda/native_harness.cu) built into a shared library.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from ember.kernels.cuda.native_kernels import NVRTC_OPTIONS, SOURCE_DIR, Kernel

CACHE = Path(os.environ.get("EMBER_TOOL_CACHE", Path.home() / ".cache" / "ember" / "cuda-tools"))
HARNESS_SOURCE = Path(__file__).with_name("native_harness.cu")
# wheels that carry the tools CUDA 13.0's nvcc lacks here (../shared/notes/ENVIRONMENT.md)
WHEELS = {"cuobjdump": ("nvidia-cuda-cuobjdump==13.2.*", "nvidia-cuda-nvdisasm==13.2.*"),
          "nvrtc": ("nvidia-cuda-nvrtc==13.0.*",)}


def nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc is not on this machine")
    return path


@cache
def _wheel(tool: str) -> Path | None:
    """The unpacked wheels of `tool` under CACHE, downloaded once; None where pip cannot fetch them."""
    root = CACHE / tool
    if (root / "done").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    fetched = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *WHEELS[tool], "-d",
                              str(root)], capture_output=True, text=True, timeout=600)
    wheels = sorted(root.glob("*.whl"))
    if fetched.returncode != 0 or len(wheels) < len(WHEELS[tool]):
        return None
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root)
    for f in root.glob("nvidia/*/bin/*"):
        f.chmod(0o755)
    (root / "done").touch()
    return root


def cuobjdump() -> str:
    root = _wheel("cuobjdump")
    found = sorted(root.glob("nvidia/*/bin/cuobjdump")) if root else []
    if not found:
        pytest.skip(f"cuobjdump could not be fetched ({', '.join(WHEELS['cuobjdump'])})")
    return str(found[-1])


@cache
def _nvrtc_library() -> ctypes.CDLL | None:
    root = _wheel("nvrtc")
    found = sorted(root.glob("nvidia/*/lib/libnvrtc.so.*")) if root else []
    if not found:
        return None
    # NVRTC opens its builtins library by name from beside itself only through the loader's path
    for builtins in sorted(found[-1].parent.glob("libnvrtc-builtins.so.*")):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(found[-1]))


def nvrtc_compile(kernel: Kernel, arch: str) -> tuple[int, str]:
    """NVRTC's result code and log for the kernel's source, with the options CuPy is given."""
    lib = _nvrtc_library()
    if lib is None:
        pytest.skip(f"NVRTC could not be fetched ({WHEELS['nvrtc'][0]})")
    prog = ctypes.c_void_p()
    code = lib.nvrtcCreateProgram(ctypes.byref(prog), kernel.source().encode(), f"{kernel.name}.cu".encode(), 0,
                                  None, None)
    assert code == 0, f"nvrtcCreateProgram: {code}"
    options = [o.encode() for o in NVRTC_OPTIONS] + [f"--gpu-architecture={arch}".encode()]
    code = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return code, log.value.decode()


@dataclass(frozen=True)
class PtxasStats:
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int


def ptxas_report(log: str) -> dict[str, PtxasStats]:
    """ptxas -v's lines per entry function."""
    out: dict[str, PtxasStats] = {}
    for chunk in re.split(r"Compiling entry function '", log)[1:]:
        name = chunk.split("'", 1)[0]
        stack = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", chunk)
        regs = re.search(r"Used (\d+) registers", chunk)
        assert stack and regs, f"ptxas said nothing of {name}'s frame and registers"
        out[name] = PtxasStats(int(regs.group(1)), *map(int, stack.groups()))
    return out


def compile_cubin(source: str, arch: str, out: Path) -> str:
    """nvcc -cubin of `source` for sm_`arch`; returns ptxas's -v log."""
    src = out.with_suffix(".cu")
    src.write_text(source)
    done = subprocess.run([nvcc(), "-cubin", f"-arch=sm_{arch}", "-std=c++17", f"-I{SOURCE_DIR}", "-Xptxas", "-v",
                           str(src), "-o", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


def sass_functions(cubin: Path) -> dict[str, str]:
    """cuobjdump -sass of a cubin, by function name."""
    tool = cuobjdump()  # it runs nvdisasm, unpacked beside it
    env = {**os.environ, "PATH": f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    return {part.split("\n", 1)[0].strip(): part for part in re.split(r"\n\s*Function : ", text)[1:]}


def build_harness() -> ctypes.CDLL:
    """The host harness as a shared library, rebuilt when it or a header changes."""
    digest = hashlib.sha256(HARNESS_SOURCE.read_bytes())
    for header in sorted(SOURCE_DIR.glob("*.cuh")):
        digest.update(header.read_bytes())
    lib = CACHE / f"native_harness-{digest.hexdigest()[:16]}.so"
    if not lib.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([nvcc(), "-shared", "-Xcompiler", "-fPIC", "-O2", "-std=c++17", f"-I{SOURCE_DIR}",
                               str(HARNESS_SOURCE), "-o", str(tmp)], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))
