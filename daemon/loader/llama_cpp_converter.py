"""Running llama.cpp's own converter (convert_hf_to_gguf.py, e.g. from the llama-cpp-python sdist) on a
Hugging Face directory, so the GGUF files ember ships or tests against are files llama.cpp made itself.

One patch: the demo tokenizer's pre-tokenizer is not in the converter's table of known hashes; it is
GPT-2's byte-level BPE, so it is named "gpt-2", as for the shared demo models (their README). The
converter imports its own gguf-py (which knows every architecture it writes, `dflash` included), and
needs the packages of its requirements file (sentencepiece among them) installed.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_RUN = """
import runpy, sys
sys.path.insert(0, {src!r})
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def convert_hf(script: Path, hf_dir: Path, out: Path, outtype: str, *extra: str) -> Path:
    """hf_dir -> out with `script` (convert_hf_to_gguf.py); `extra` are more converter arguments."""
    if not script.is_file():
        raise FileNotFoundError(f"llama.cpp's converter not found at {script}")
    code = _RUN.format(src=str(script.parent), script=str(script))
    done = subprocess.run([sys.executable, "-c", code, str(hf_dir), "--outfile", str(out), "--outtype", outtype,
                           *extra], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out
