"""ModelConfig: the dimensions and hyper-parameters of a model, read from GGUF metadata or an HF
config.json, and nothing else (no weights) — the runtime builds models from it and the memory planner
sizes memory from it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.daemon.loader.model_file_error import ModelFileError

# HF model_type -> the GGUF architecture name ember uses internally
HF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "mixtral"}


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    context_length: int
    rope_theta: float
    norm_eps: float
    rope_scaling: RopeScaling | None = None
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    # renormalise the top-k routing weights to sum to 1 (HF norm_topk_prob; Mixtral always does)
    expert_norm: bool = True

    def inv_freq(self, freq_factors: np.ndarray | None = None) -> np.ndarray:
        """Rotary inverse frequencies [head_dim / 2] (float32), with any scaling applied.

        GGUF llama3 files carry the scaling as a `rope_freqs` tensor of per-frequency divisors, which
        takes precedence over computing it.
        """
        inv = 1.0 / self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        if freq_factors is not None:
            inv = inv / freq_factors.astype(np.float64)
        elif self.rope_scaling is not None:
            inv = _scaled_inv_freq(inv, self.rope_scaling)
        return inv.astype(np.float32)


def _scaled_inv_freq(inv: np.ndarray, s: RopeScaling) -> np.ndarray:
    if s.kind == "linear":
        return inv / s.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between
    wavelen = 2 * math.pi / inv
    low_wavelen = s.original_context / s.low_freq_factor
    high_wavelen = s.original_context / s.high_freq_factor
    smooth = (s.original_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    return np.where(wavelen > low_wavelen, inv / s.factor, np.where(wavelen < high_wavelen, inv, blended))


def config_from_gguf(meta: Mapping[str, Any], n_vocab_rows: int, source: str) -> ModelConfig:
    arch = _require(meta, "general.architecture", source)

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFileError(source, f"missing metadata key {arch}.{key}")
        return value

    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    scaling = None
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise ModelFileError(source, f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")
        scaling = RopeScaling("linear", float(get("rope.scaling.factor")))
    return ModelConfig(
        arch=arch,
        n_layers=int(get("block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=int(get("attention.key_length", hidden // n_heads)),
        ffn=int(get("feed_forward_length", 0)),
        vocab=int(meta.get(f"{arch}.vocab_size", n_vocab_rows)),
        context_length=int(get("context_length", 4096)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_scaling=scaling,
        n_experts=int(get("expert_count", 0)),
        n_experts_used=int(get("expert_used_count", 0)),
        expert_ffn=int(get("expert_feed_forward_length", 0)),
        # llama.cpp renormalises llama (Mixtral) and qwen3moe experts whatever the file says
        expert_norm=bool(meta.get(f"{arch}.expert_weights_norm", True)),
    )


def config_from_hf(cfg: Mapping[str, Any], source: str) -> ModelConfig:
    model_type = _require(cfg, "model_type", source)
    if model_type not in HF_ARCHITECTURES:
        raise ModelFileError(source, f"unknown architecture {model_type!r} (supported: {', '.join(HF_ARCHITECTURES)})")
    hidden, n_heads = int(_require(cfg, "hidden_size", source)), int(_require(cfg, "num_attention_heads", source))
    # transformers >= 5 nests rope settings in rope_parameters; older configs use rope_theta/rope_scaling
    rope = dict(cfg.get("rope_scaling") or {}) | dict(cfg.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return ModelConfig(
        arch=HF_ARCHITECTURES[model_type],
        n_layers=int(_require(cfg, "num_hidden_layers", source)),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads),
        ffn=int(cfg.get("intermediate_size", 0)),
        vocab=int(_require(cfg, "vocab_size", source)),
        context_length=int(cfg.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_scaling=_hf_rope_scaling(rope, source),
        n_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
        n_experts_used=int(cfg.get("num_experts_per_tok") or 0),
        expert_ffn=int(cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size", 0) if model_type == "mixtral" else 0)),
        expert_norm=bool(cfg.get("norm_topk_prob", False)) if model_type == "qwen3_moe" else True,
    )


def _hf_rope_scaling(rope: Mapping[str, Any], source: str) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(rope["factor"]),
            float(rope.get("low_freq_factor", 1.0)),
            float(rope.get("high_freq_factor", 4.0)),
            int(rope.get("original_max_position_embeddings", 8192)),
        )
    raise ModelFileError(source, f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")


def _require(mapping: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in mapping:
        raise ModelFileError(source, f"missing {key!r}")
    return mapping[key]
