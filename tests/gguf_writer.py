"""Writing test GGUF files the way llama.cpp's converter does, from a Hugging Face state dict.

Metadata keys, tensor names and the llama q/k row permutation follow convert_hf_to_gguf.py; tensors
are quantized with ember's numpy reference quantizer (gguf-py cannot write K-quants). The tokenizer is
the demo model's (copied from its GGUF), so the vocabulary must be 8192.
"""
from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.loader.hf_dir import gguf_name
from ember.daemon.loader.model_config import HF_ARCHITECTURES
from ember.kernels.reference.quant import quantize
from ember.kernels.tensor_types import TensorType

# tensor-name pattern -> type, first match wins; 1-D tensors are always F32, as llama.cpp wants
Q4_K_M = {"*attn_v.weight": TensorType.Q6_K, "*ffn_down.weight": TensorType.Q6_K,
          "token_embd.weight": TensorType.Q6_K, "output.weight": TensorType.Q6_K, "*": TensorType.Q4_K}
MIXED = {"*attn_q.weight": TensorType.Q4_K, "*attn_k.weight": TensorType.Q8_0, "*attn_v.weight": TensorType.Q6_K,
         "*attn_output.weight": TensorType.F16, "*ffn_gate.weight": TensorType.Q5_K, "*ffn_up.weight": TensorType.BF16,
         "*ffn_down.weight": TensorType.Q6_K, "token_embd.weight": TensorType.Q8_0, "*": TensorType.F32}
# every newer block type in one file (K-quants need rows of whole 256-value super-blocks)
NEWER = {"*attn_q.weight": TensorType.Q4_0, "*attn_k.weight": TensorType.Q5_1, "*attn_v.weight": TensorType.IQ4_NL,
         "*attn_output.weight": TensorType.Q3_K, "*ffn_gate.weight": TensorType.Q2_K, "*ffn_up.weight": TensorType.IQ4_XS,
         "*ffn_down.weight": TensorType.Q5_0, "token_embd.weight": TensorType.Q4_1, "*": TensorType.F32}


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF half-split rotary rows -> adjacent pairs (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, hf_config: Any, state: dict[str, np.ndarray], types: dict[str, TensorType]) -> Path:
    # the converter writes Mixtral as llama with experts
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama"}[hf_config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    _add_hparams(writer, arch, hf_config)
    _copy_tokenizer(writer, hf_config.vocab_size)
    for hf_name, value in _split_fused_experts(state):
        name = gguf_name(hf_name, HF_ARCHITECTURES[hf_config.model_type], hf_config.num_hidden_layers)
        if name is None:
            continue
        w = np.ascontiguousarray(value, dtype=np.float32)
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = hf_config.num_attention_heads if "attn_q" in name else hf_config.num_key_value_heads
            w = permute_qk(w, heads)
        # 1-D tensors and MoE routers stay F32, as the converter keeps them
        keep = w.ndim == 1 or name.endswith("ffn_gate_inp.weight")
        _add_tensor(writer, name, w, TensorType.F32 if keep else _type_for(name, types))
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":
        _add_tensor(writer, "rope_freqs.weight", _llama3_factors(hf_config, rope), TensorType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_out(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray]) -> None:
    """Add `tensors` as they are and write the file (header, metadata, tensors)."""
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _split_fused_experts(state: dict[str, np.ndarray]) -> Any:
    """transformers keeps a layer's experts fused in memory (mlp.experts.gate_up_proj [experts, 2 x ffn,
    hidden], mlp.experts.down_proj): yield them under the stacked names the converter maps."""
    for name, value in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            f = value.shape[1] // 2
            base = name[: -len("gate_up_proj")]
            yield base + "gate_proj.weight", value[:, :f]
            yield base + "up_proj.weight", value[:, f:]
        elif name.endswith("mlp.experts.down_proj"):
            yield name + ".weight", value
        else:
            yield name, value


def _type_for(name: str, types: dict[str, TensorType]) -> TensorType:
    return next(t for pattern, t in types.items() if fnmatch.fnmatch(name, pattern))


def _add_tensor(writer: gguf.GGUFWriter, name: str, w: np.ndarray, ttype: TensorType) -> None:
    if ttype == TensorType.F32:
        writer.add_tensor(name, w)
    elif ttype == TensorType.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        raw = quantize(ttype, w.reshape(-1, w.shape[-1]))
        writer.add_tensor(name, raw.view(np.uint8).reshape(*w.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType(int(ttype)))


def _add_hparams(writer: gguf.GGUFWriter, arch: str, c: Any) -> None:
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {}
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(c.vocab_size)
    n_experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if n_experts:
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)


def _copy_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The demo model's tokenizer, padded up to vocab_size (for model shapes with a bigger vocabulary;
    the extra ids never come out of tokenization) as llama.cpp's convert_hf_to_gguf.py pads one:
    `[PAD<id>]` tokens of type UNUSED, which no tokenizer treats as special."""
    reader = gguf.GGUFReader(DEMO_MODEL)
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{i}]" for i in range(len(value), vocab_size)]
        elif field.name == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.UNUSED)] * (vocab_size - len(value))
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)


def _llama3_factors(c: Any, rope: dict[str, Any]) -> np.ndarray:
    """The rope_freqs tensor convert_hf_to_gguf.py writes for llama3 rope scaling."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factor, low, high, old = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
