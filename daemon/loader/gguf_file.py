"""Reading GGUF files: metadata and tensors as zero-copy views of the mmap'd file (via gguf-py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

from ember.daemon.loader.model_config import config_from_gguf
from ember.daemon.loader.model_file import ModelFile
from ember.daemon.loader.model_file_error import ModelFileError
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.tensor_types import UnsupportedTensorType, row_bytes, tensor_type


def open_gguf(path: Path) -> ModelFile:
    source = str(path)
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, OSError, KeyError) as e:
        # gguf-py reports a truncated or garbled header as whatever numpy raised while parsing it
        raise ModelFileError(source, f"not a readable GGUF file ({type(e).__name__}: {e})") from None
    metadata: dict[str, Any] = {f.name: f.contents() for f in reader.fields.values()}
    tensors = {t.name: _raw_tensor(t, source) for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelFileError(source, "missing tensor token_embd.weight")
    config = config_from_gguf(metadata, tensors["token_embd.weight"].rows, source)
    return ModelFile(path=path, format="gguf", config=config, tensors=tensors, metadata=metadata)


def _raw_tensor(t: Any, source: str) -> RawTensor:
    try:
        ttype = tensor_type(int(t.tensor_type))
    except UnsupportedTensorType:
        raise ModelFileError(source, f"tensor {t.name} has unsupported type {t.tensor_type.name} "
                             "(supported: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K)") from None
    shape = tuple(int(d) for d in reversed(t.shape))  # ggml order -> numpy order
    data = np.asarray(t.data)
    expected = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes(ttype, shape[-1])
    if data.nbytes != expected:
        raise ModelFileError(source, f"truncated file: tensor {t.name} has {data.nbytes} of {expected} bytes")
    if ttype in (ttype.F16, ttype.BF16):
        data = data.view(np.uint16)
    data = data.reshape(shape[:-1] + (-1,))
    return RawTensor(name=t.name, ttype=ttype, shape=shape, data=data)
