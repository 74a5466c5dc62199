"""Reading Hugging Face model directories: config.json and *.safetensors (sharded or not), tensors
mmap'd without copies and renamed to GGUF names so the models see one naming scheme.
"""
from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np

from ember.daemon.loader.model_config import config_from_hf
from ember.daemon.loader.model_file import ModelFile
from ember.daemon.loader.model_file_error import ModelFileError
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.tensor_types import TensorType

_DTYPES = {"F32": (TensorType.F32, np.float32), "F16": (TensorType.F16, np.uint16), "BF16": (TensorType.BF16, np.uint16)}

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def open_hf_dir(path: Path) -> ModelFile:
    source = str(path)
    config_path = path / "config.json"
    if not config_path.exists():
        raise ModelFileError(source, "not a model directory: no config.json")
    try:
        cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFileError(str(config_path), f"invalid JSON ({e})") from None
    config = config_from_hf(cfg, source)
    tensors: dict[str, RawTensor] = {}
    for shard in _shards(path):
        for name, t in _read_safetensors(shard).items():
            new_name = gguf_name(name)
            if new_name is not None:
                tensors[new_name] = RawTensor(new_name, t.ttype, t.shape, t.data)
    if "token_embd.weight" not in tensors:
        raise ModelFileError(source, "missing tensor model.embed_tokens.weight")
    return ModelFile(path=path, format="hf", config=config, tensors=tensors, metadata=cfg)


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        shards = [path / name for name in sorted(set(weight_map.values()))]
    else:
        shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelFileError(str(path), "no *.safetensors files")
    for s in shards:
        if not s.exists():
            raise ModelFileError(str(s), "shard named in model.safetensors.index.json is missing")
    return shards


def _read_safetensors(path: Path) -> dict[str, RawTensor]:
    """Parse a safetensors file (8-byte header length, JSON header, data) into mmap'd views.

    Parsed by hand because the safetensors numpy API copies and has no bfloat16.
    """
    source = str(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(source, "truncated safetensors file")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, 100 << 20):
            raise ModelFileError(source, "truncated or corrupt safetensors header")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelFileError(source, "corrupt safetensors header") from None
    mm = np.memmap(path, np.uint8, "r")
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ModelFileError(source, f"tensor {name} has unsupported dtype {info['dtype']} (supported: F32, F16, BF16)")
        ttype, dtype = _DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        if base + end > size or end - begin != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
            raise ModelFileError(source, f"truncated file: tensor {name} extends past the end")
        data = mm[base + begin : base + end].view(dtype).reshape(shape)
        tensors[name] = RawTensor(name, ttype, shape, data)
    return tensors


def gguf_name(hf_name: str) -> str | None:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER.fullmatch(hf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None  # rotary caches and other buffers some checkpoints carry
