"""Models that cannot be loaded fail with one clear line naming the file and the reason."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import ember
from ember.daemon.loader.demo_model import DEMO_MODEL


def load_error(path: Path) -> str:
    with pytest.raises(ember.ModelFileError) as info:
        ember.load(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    return message


def test_missing_file(tmp_path: Path) -> None:
    assert "no such file" in load_error(tmp_path / "nope.gguf")


def test_not_a_model(tmp_path: Path) -> None:
    p = tmp_path / "x.bin"
    p.write_bytes(b"hello world, not a model")
    assert "not a GGUF file" in load_error(p)


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.999])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    data = DEMO_MODEL.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * keep)])
    message = load_error(p)
    assert "truncated" in message or "not a readable GGUF" in message


def write_small_gguf(path: Path, arch: str = "qwen3", ttype: gguf.GGMLQuantizationType | None = None,
                     tokenizer: bool = True) -> Path:
    """A copy of the demo model with its architecture, one tensor's type or its tokenizer changed."""
    reader = gguf.GGUFReader(DEMO_MODEL)
    writer = gguf.GGUFWriter(str(path), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if not tokenizer and field.name.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name.replace("qwen3.", f"{arch}."), field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        if ttype is not None and t.name == "blk.0.ffn_up.weight":
            block, size = gguf.GGML_QUANT_SIZES[ttype]  # zero bytes: valid blocks of any type
            rows, cols = t.data.shape[0], int(t.shape[0])
            writer.add_tensor(t.name, np.zeros((rows, cols // block * size), np.uint8), raw_dtype=ttype)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unknown_architecture(tmp_path: Path) -> None:
    assert "unsupported architecture 'mamba'" in load_error(write_small_gguf(tmp_path / "a.gguf", arch="mamba"))


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    p = write_small_gguf(tmp_path / "a.gguf", ttype=gguf.GGMLQuantizationType.IQ2_XXS)
    message = load_error(p)
    assert "blk.0.ffn_up.weight" in message and "IQ2_XXS" in message and "IQ4_XS" in message  # and what is read


def test_missing_tokenizer(tmp_path: Path) -> None:
    assert "token" in load_error(write_small_gguf(tmp_path / "a.gguf", tokenizer=False)).lower()


def test_hf_dir_without_tokenizer(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    load_error(d)


def test_hf_dir_unknown_architecture(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    assert "gpt_neox" in load_error(d)


def test_hf_dir_two_tensors_with_one_gguf_name(tmp_path: Path) -> None:
    """gguf's name table knows several spellings of each tensor; a checkpoint holding two of them is refused
    rather than one silently replacing the other."""
    from safetensors.numpy import save_file

    d = tmp_path / "m"
    d.mkdir()
    cfg = {"model_type": "qwen3", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    w = np.zeros((8, 8), np.float32)
    save_file({"model.embed_tokens.weight": np.zeros((4, 8), np.float32), "model.layers.0.self_attn.q_proj.weight": w,
               "layers.0.attention.wq.weight": w}, str(d / "model.safetensors"))
    message = load_error(d)
    assert "both map to blk.0.attn_q.weight" in message and "model.layers.0.self_attn.q_proj.weight" in message


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ember.client.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_error_is_one_line_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    shutil.copy(DEMO_MODEL, bad)
    with open(bad, "r+b") as f:
        f.truncate(1000)
    result = run_cli("run", str(bad), "hi")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0]


def test_cli_streams_demo_model_text() -> None:
    result = run_cli("run", "def fibonacci(n):", "--max-tokens", "24", "--temperature", "0")  # greedy: one flag away
    assert result.returncode == 0, result.stderr
    model = ember.load(DEMO_MODEL)
    # greedy over the penalty the demo recommends (1.2), as llama.cpp applies a file's penalty_repeat at --temp 0
    penalty = model.sampling.repetition_penalty
    expected = model.detokenize(model.generate("def fibonacci(n):", max_tokens=24, repetition_penalty=penalty))
    assert result.stdout == "def fibonacci(n):" + expected + "\n"
