"""Writing tiny random DFlash drafts (llama.cpp's `dflash` GGUF architecture) for a target GGUF, with
gguf-py's GGUFWriter: the keys and tensor names conversion/qwen.py DFlashModel writes (Qwen3 layers,
fc, enc.output_norm, dflash.target_layers, dflash.block_size, tokenizer.ggml.mask_token_id, the
target's tokenizer), random weights. `extra_tensors` / `extra_keys` add what a variant would carry,
`mask` / `layers_key` False leave out the mask token / the target layers, for the refusal tests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ember.daemon.loader.model_file import open_model_file
from gguf_writer import write_out
from ember.kernels.reference.dflash import Draft, Layer
from ember.kernels.reference.quant import dequantize


def write_dflash(path: Path, target: Path, target_layers: tuple[int, ...] = (1, 3), n_layers: int = 1,
                 block_size: int = 8, mask_id: int = 5, seed: int = 0, own_embedding: bool = False,
                 heads: int = 6, kv_heads: int = 2, head_dim: int = 64, ffn: int = 512, hidden: int | None = None,
                 mask: bool = True, layers_key: bool = True, extra_tensors: dict[str, np.ndarray] | None = None,
                 extra_keys: dict[str, Any] | None = None, scale: float = 0.05) -> Path:
    mf = open_model_file(target)
    cfg = mf.config
    hidden = hidden or cfg.hidden
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "dflash")
    w.add_block_count(n_layers)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_vocab_size(cfg.vocab)  # the target's (test targets may pad their tokenizer past it)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_uint32("dflash.block_size", block_size)
    if layers_key:
        w.add_array("dflash.target_layers", list(target_layers))
    for key, value in (extra_keys or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    _copy_tokenizer(w, target)
    if mask:
        w.add_uint32("tokenizer.ggml.mask_token_id", mask_id)
    tensors = {"fc.weight": rand(hidden, len(target_layers) * cfg.hidden), "enc.output_norm.weight": norm(hidden),
               "output_norm.weight": norm(hidden)}
    if own_embedding:
        tensors["token_embd.weight"] = rand(cfg.vocab, hidden)
    for i in range(n_layers):
        tensors |= {f"blk.{i}.attn_norm.weight": norm(hidden), f"blk.{i}.attn_q.weight": rand(heads * head_dim, hidden),
                    f"blk.{i}.attn_k.weight": rand(kv_heads * head_dim, hidden),
                    f"blk.{i}.attn_v.weight": rand(kv_heads * head_dim, hidden),
                    f"blk.{i}.attn_output.weight": rand(hidden, heads * head_dim),
                    f"blk.{i}.attn_q_norm.weight": norm(head_dim), f"blk.{i}.attn_k_norm.weight": norm(head_dim),
                    f"blk.{i}.ffn_norm.weight": norm(hidden), f"blk.{i}.ffn_gate.weight": rand(ffn, hidden),
                    f"blk.{i}.ffn_up.weight": rand(ffn, hidden), f"blk.{i}.ffn_down.weight": rand(hidden, ffn)}
    write_out(w, tensors | (extra_tensors or {}))
    return path


def _copy_tokenizer(writer: gguf.GGUFWriter, target: Path) -> None:
    """The target's tokenizer keys, as the converter copies them (DFlashModel.set_vocab)."""
    reader = gguf.GGUFReader(target)
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer.") or field.name in ("tokenizer.chat_template",):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


def reference_draft(draft: Path, target: Path) -> Draft:
    """The draft's weights as kernels/reference/dflash.py takes them (dequantized to float32), the
    target's embedding and head where the draft has none."""
    mf, tf = open_model_file(draft), open_model_file(target)

    def f32(name: str, source: Any = mf) -> np.ndarray:
        t = source.tensor(name)
        return dequantize(t.ttype, t.rows2d(), t.cols).reshape(t.shape)

    def layer(i: int) -> Layer:
        names = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
        return Layer(*(f32(f"blk.{i}.{n}.weight") for n in names))

    cfg = mf.config
    embed = f32("token_embd.weight") if "token_embd.weight" in mf.tensors else f32("token_embd.weight", tf)
    own_output = "output.weight" in mf.tensors
    output = f32("output.weight") if own_output else embed if "token_embd.weight" in mf.tensors else (
        f32("output.weight", tf) if "output.weight" in tf.tensors else embed)
    return Draft(fc=f32("fc.weight"), enc_norm=f32("enc.output_norm.weight"), layers=[layer(i) for i in range(cfg.n_layers)],
                 norm=f32("output_norm.weight"), embed=embed, output=output, heads=cfg.n_heads,
                 kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, inv_freq=cfg.inv_freq(), eps=cfg.norm_eps)
