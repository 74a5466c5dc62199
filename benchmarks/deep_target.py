"""A bandwidth-bound target for the speculative benchmark, built from the trained demo model without
training: the demo target deepened to `layers` layers.

Layers 0-4 are the demo's own. Each later layer is a copy of layer i mod 5 whose two residual writes
(attn_output, ffn_down) are zero Q8_0 blocks: it reads its weights and computes its attention and
feed-forward as any layer does (the kernels skip nothing), and adds nothing to the residual stream.
So the deep target's logits are the demo target's, bit for bit, and the demo draft keeps its
measured acceptance against it, while a target step reads `layers` / 5 times the demo's layer
weights: at 60 layers, 100 MB a token, three times this machine's L3, where the demo's 12 MB fit in
it. That is the regime speculative decoding is for (a draft that costs a small share of a target
step), which no target trainable on this machine reaches; what it does not model is a deep target's
own acceptance (it is the demo's, 0.81 at k = 4).

    python benchmarks/deep_target.py [--layers 60]   (prints the path; benchmarks/speculative.py
                                                       --target-layers builds it itself)
"""
from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from ember.daemon.loader.demo_model import DEMO_MODEL

CACHE = Path(__file__).resolve().parent / ".cache"
SILENT = ("attn_output.weight", "ffn_down.weight")  # a copied layer's writes to the residual stream


def deep_target(layers: int, source: Path = Path(DEMO_MODEL)) -> Path:
    """The demo target deepened to `layers` layers (written once into benchmarks/.cache)."""
    path = CACHE / f"ember-demo-dense-{layers}l-q8_0.gguf"
    if path.exists():
        return path
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    depth = int(reader.fields[f"{arch}.block_count"].contents())
    if layers < depth:
        raise ValueError(f"--target-layers {layers}: the demo target has {depth} layers already")
    CACHE.mkdir(exist_ok=True)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    tensors = [(t.name, t) for t in reader.tensors if not t.name.startswith("blk.")]
    for i in range(layers):
        for t in reader.tensors:
            prefix = f"blk.{i % depth}."
            if t.name.startswith(prefix):
                tensors.append((f"blk.{i}." + t.name[len(prefix):], t))
    for name, t in tensors:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, t in tensors:
        copied = name.startswith("blk.") and int(name.split(".")[1]) >= depth
        if copied and name.endswith(SILENT):
            assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0, t.tensor_type
            writer.write_tensor_data(np.zeros_like(t.data))  # scale 0, quants 0: a zero matrix
        else:
            writer.write_tensor_data(t.data)
    writer.close()
    partial.rename(path)
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=60)
    print(deep_target(ap.parse_args().layers))
