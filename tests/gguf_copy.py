"""A copy of a GGUF file with some metadata keys left out and others added; the tensors as they are,
or dequantized to float32 (the same weights, for an engine that quantizes its activations to run
them at float32)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np


def copy_gguf(source: Path, path: Path, drop: Iterable[str] = (),
              add: Mapping[str, tuple[Any, gguf.GGUFValueType]] | None = None,
              element: gguf.GGUFValueType | None = None, dequantize: bool = False) -> Path:
    """`element`: the element type of the ARRAY values in `add`."""
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(path), arch)
    skipped = {"general.architecture", *drop}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in skipped:
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for key, (value, vtype) in (add or {}).items():
        writer.add_key_value(key, value, vtype, sub_type=element if vtype == gguf.GGUFValueType.ARRAY else None)
    if dequantize:
        for t in reader.tensors:
            writer.add_tensor(t.name, np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    writer.close()
    return path
