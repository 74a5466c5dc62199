"""Reading GGUF files: metadata and tensors as zero-copy views of the mmap'd file (gguf_reader.py)."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ember.daemon.loader.gguf_reader import GGUFError, TensorInfo, read_gguf
from ember.daemon.loader.model_config import config_from_gguf
from ember.daemon.loader.model_file import ModelFile
from ember.daemon.loader.model_file_error import ModelFileError
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.tensor_types import TensorType, UnsupportedTensorType, row_bytes, tensor_type


def open_gguf(path: Path) -> ModelFile:
    source = str(path)
    try:
        contents = read_gguf(path, _tensor_bytes)
    except GGUFError as e:
        raise ModelFileError(source, f"not a readable GGUF file ({e})") from None
    if contents.metadata.get("general.architecture") == "dflash":  # its variants, refused by name first
        from ember.daemon.loader.dflash_file import refuse_variants

        refuse_variants(source, contents.metadata, [t.name for t in contents.tensors])
    tensors = {t.name: _raw_tensor(t, source) for t in contents.tensors}
    config = config_from_gguf(contents.metadata, _vocab_rows(tensors, contents.metadata, source), source)
    return ModelFile(path=path, format="gguf", config=config, tensors=tensors, metadata=contents.metadata)


def _vocab_rows(tensors: dict[str, RawTensor], meta: Mapping[str, Any], source: str) -> int:
    """The vocabulary size: token_embd's rows; a DFlash draft may share the target's embedding and
    carry none, and then its tokenizer (the target's, copied by the converter) says it."""
    if "token_embd.weight" in tensors:
        return tensors["token_embd.weight"].rows
    tokens = meta.get("tokenizer.ggml.tokens")
    if meta.get("general.architecture") == "dflash" and tokens is not None:
        return len(tokens)
    raise ModelFileError(source, "missing tensor token_embd.weight")


def _tensor_bytes(ggml_type: int, dims: tuple[int, ...]) -> int | None:
    """Bytes of a tensor; None for a type ember does not read, or rows that are not whole blocks."""
    try:
        return int(np.prod(dims[1:], dtype=np.int64)) * row_bytes(tensor_type(ggml_type), dims[0])
    except UnsupportedTensorType:
        return None


def _raw_tensor(t: TensorInfo, source: str) -> RawTensor:
    try:
        ttype = tensor_type(t.ggml_type)
    except UnsupportedTensorType:
        raise ModelFileError(source, f"tensor {t.name} has unsupported type {_type_name(t.ggml_type)} "
                             f"(supported: {', '.join(x.name for x in TensorType)})") from None
    shape = tuple(reversed(t.dims))  # ggml order -> numpy order
    expected = _tensor_bytes(t.ggml_type, t.dims)
    if expected is None:
        raise ModelFileError(source, f"tensor {t.name}: rows of {shape[-1]} values are not whole {ttype.name} blocks")
    if t.data.nbytes != expected:
        raise ModelFileError(source, f"truncated file: tensor {t.name} has {t.data.nbytes} of {expected} bytes")
    data = t.data
    if ttype == ttype.F32:
        data = data.view(np.float32)
    elif ttype in (ttype.F16, ttype.BF16):
        data = data.view(np.uint16)
    return RawTensor(name=t.name, ttype=ttype, shape=shape, data=data.reshape(shape[:-1] + (-1,)))


def _type_name(ggml_type: int) -> str:
    try:
        import gguf

        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"#{ggml_type}"
