"""llama.cpp's own tools on a Hugging Face directory: its converter (convert_hf_to_gguf.py, from the
sdist of the llama-cpp-python that is installed, fetched from the package index once, or found through
EMBER_LLAMA_CPP_SRC) and its quantizer (llama-cpp-python's llama_model_quantize), so tests compare
ember with files llama.cpp made itself."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
from functools import cache
from pathlib import Path

import pytest

from ember.daemon.loader.llama_cpp_converter import convert_hf

CACHE = Path(os.environ.get("EMBER_TOOL_CACHE", Path.home() / ".cache" / "ember" / "tools"))
# what the tests need of the sdist's vendor/llama.cpp: the converter (it imports its own gguf-py), and
# Gemma 4's vocabulary with llama.cpp's test vectors for it and its chat template
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-gemma-4.gguf",
                    "models/templates/google-gemma-4-31B-it.jinja")
_DONE = "done-2"  # the marker of an unpacked sdist holding all of _CONVERTER_PARTS


def converter_script() -> Path:
    """llama.cpp's convert_hf_to_gguf.py (skips the test where it cannot be had)."""
    src = llama_cpp_src()
    script = None if src is None else src / "convert_hf_to_gguf.py"
    if script is None or not script.exists():
        pytest.skip(f"llama.cpp's converter not found ({script or 'no llama-cpp-python sdist to fetch'}; "
                    "set EMBER_LLAMA_CPP_SRC to an unpacked vendor/llama.cpp)")
    return script


@cache
def llama_cpp_src() -> Path | None:
    """vendor/llama.cpp of the installed llama-cpp-python's sdist (its converter's part), unpacked
    under CACHE the first time; EMBER_LLAMA_CPP_SRC where set. None where there is no llama-cpp-python
    or pip cannot fetch its sdist."""
    if "EMBER_LLAMA_CPP_SRC" in os.environ:
        return Path(os.environ["EMBER_LLAMA_CPP_SRC"])
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None
    root = CACHE / f"llama-cpp-python-{version}"
    src = root / "vendor" / "llama.cpp"
    if (root / _DONE).exists():
        return src
    root.mkdir(parents=True, exist_ok=True)
    fetched = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                              f"llama_cpp_python=={version}", "-d", str(root)], capture_output=True, text=True,
                             timeout=900)
    sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if fetched.returncode != 0 or not sdists:
        return None
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(sdists[0]) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and m.name[len(prefix):].startswith(_CONVERTER_PARTS):
                m.name = m.name[len(prefix):]
                members.append(m)
        tar.extractall(src, members, filter="data")
    sdists[0].unlink()  # 77 MB, of which the converter needs 6
    (root / _DONE).touch()
    return src


def llama_cpp_file(relative: str) -> Path:
    """A file of the sdist's vendor/llama.cpp (one of _CONVERTER_PARTS); skips the test where it cannot be had."""
    src = llama_cpp_src()
    path = None if src is None else src / relative
    if path is None or not path.exists():
        pytest.skip(f"llama.cpp's {relative} not found ({path or 'no llama-cpp-python sdist to fetch'})")
    return path


def convert(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """hf_dir converted by llama.cpp's convert_hf_to_gguf.py (skips the test if the script is absent),
    without MTP layers: --no-mtp, which the converter needs for architectures that have them (qwen35)
    and refuses for the others, which then convert without it."""
    script = converter_script()
    try:
        return convert_hf(script, hf_dir, out, outtype, "--no-mtp")
    except RuntimeError as e:
        if "--mtp / --no-nextn are not supported" not in str(e):
            raise
    return convert_hf(script, hf_dir, out, outtype)


def quantize(src: Path, out: Path, ftype: str = "Q8_0") -> Path:
    """src quantized by llama.cpp (llama_model_quantize, every tensor it quantizes in `ftype`)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {ftype} failed")
    return out
