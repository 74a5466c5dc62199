"""llama.cpp's own tools on a Hugging Face directory: its converter (convert_hf_to_gguf.py, from the
llama-cpp-python sdist, found through EMBER_LLAMA_CPP_SRC) and its quantizer (llama-cpp-python's
llama_model_quantize), so tests compare ember with files llama.cpp made itself."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from ember.daemon.loader.llama_cpp_converter import convert_hf

LLAMA_CPP_SRC = Path(os.environ.get("EMBER_LLAMA_CPP_SRC", "/work/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp"))


def converter_script() -> Path:
    """llama.cpp's convert_hf_to_gguf.py (skips the test if the script is absent)."""
    script = LLAMA_CPP_SRC / "convert_hf_to_gguf.py"
    if not script.exists():
        pytest.skip(f"llama.cpp's converter not found at {script} (set EMBER_LLAMA_CPP_SRC)")
    return script


def convert(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """hf_dir converted by llama.cpp's convert_hf_to_gguf.py (skips the test if the script is absent)."""
    return convert_hf(converter_script(), hf_dir, out, outtype, "--no-mtp")


def quantize(src: Path, out: Path, ftype: str = "Q8_0") -> Path:
    """src quantized by llama.cpp (llama_model_quantize, every tensor it quantizes in `ftype`)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {ftype} failed")
    return out
