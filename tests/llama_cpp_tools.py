"""llama.cpp's own tools on a Hugging Face directory: its converter (convert_hf_to_gguf.py, from the
llama-cpp-python sdist, found through EMBER_LLAMA_CPP_SRC) and its quantizer (llama-cpp-python's
llama_model_quantize), so tests compare ember with files llama.cpp made itself."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LLAMA_CPP_SRC = Path(os.environ.get("EMBER_LLAMA_CPP_SRC", "/work/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp"))

# the demo tokenizer's pre-tokenizer is not in the converter's table of known hashes: it is GPT-2's
# byte-level BPE, as for the shared demo models (their README)
_CONVERT = """
import runpy, sys
sys.path.insert(0, {src!r})
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def convert(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """hf_dir converted by llama.cpp's convert_hf_to_gguf.py (skips the test if the script is absent)."""
    script = LLAMA_CPP_SRC / "convert_hf_to_gguf.py"
    if not script.exists():
        pytest.skip(f"llama.cpp's converter not found at {script} (set EMBER_LLAMA_CPP_SRC)")
    code = _CONVERT.format(src=str(LLAMA_CPP_SRC), script=str(script))
    done = subprocess.run([sys.executable, "-c", code, str(hf_dir), "--outfile", str(out), "--outtype", outtype,
                           "--no-mtp"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out


def quantize(src: Path, out: Path, ftype: str = "Q8_0") -> Path:
    """src quantized by llama.cpp (llama_model_quantize, every tensor it quantizes in `ftype`)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {ftype} failed")
    return out
