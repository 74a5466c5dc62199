"""What distinguishes the supported architectures, as data: the transformer block is shared."""
from __future__ import annotations

from dataclasses import dataclass

from ember.daemon.loader.model_file_error import ModelFileError


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: bool = False  # qwen2: biases on the q, k, v projections
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim of q and k before rope
    output_gate: bool = False  # laguna: the attention output scaled by softplus of a projection (attn_gate)


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(),
    "qwen2": ArchSpec(qkv_bias=True),
    "qwen3": ArchSpec(qk_norm=True),
    # hybrid: linear attention on most layers (ModelConfig.linear), gated attention with q/k norms on the rest
    "qwen35": ArchSpec(qk_norm=True),
    "qwen35moe": ArchSpec(qk_norm=True),  # with routed experts and a gated shared expert (experts/shared_expert.py)
    # mixture-of-experts blocks are found by their router tensor (Transformer), whatever the arch:
    # Mixtral GGUF files are "llama" with experts
    "qwen3moe": ArchSpec(qk_norm=True),
    "mixtral": ArchSpec(),  # Mixtral HF directories (llama.cpp converts them to "llama")
    # sigmoid-routed experts with a shared one, dense lead layers, per-layer heads, sliding-window
    # layers with a rope of their own (ModelConfig)
    "laguna": ArchSpec(qk_norm=True, output_gate=True),
    # sandwich-normed layers, per-layer embeddings, KV sharing, full layers of their own shape (gemma4.py)
    "gemma4": ArchSpec(qk_norm=True),
}


def architecture(name: str, source: str) -> ArchSpec:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ModelFileError(source, f"unsupported architecture {name!r} (supported: {', '.join(ARCHITECTURES)})") from None
