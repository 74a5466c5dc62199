"""The DFlash feature-conditioned draft as a torch module, for training it (dflash_training.py) and for
measuring it in torch. It is the network llama.cpp's `dflash` architecture runs (src/models/dflash.cpp
in its sources) and z-lab's reference defines (`DFlashDraftModel`), saved in z-lab's HF layout so that
llama.cpp's own `convert_hf_to_gguf.py --target-model-dir` writes the GGUF ember loads:

  context:  fc(concat of the target's hidden states at target_layer_ids) -> RMSNorm (`hidden_norm`);
            each layer projects that row with its own k_proj / v_proj (k_norm, RoPE at the row's
            position): the K/V llama.cpp injects into the draft's cache.
  block:    the target's embeddings of [last verified token, mask, ..., mask] at positions
            p .. p + block_size - 1 go through Qwen3-style layers whose attention is non-causal over
            the context rows before p and the whole block; then the final norm, and the target's
            lm_head (shared, frozen) turns block row k into the draft's guess for the token at p + k.

The target's embeddings and lm_head are not part of the draft (the GGUF shares them), so the module
takes embedded block rows and returns final hidden rows. Imported only by the training path: torch is
in the oracle extra, never a dependency of the daemon.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn


@dataclass(frozen=True)
class DFlashConfig:
    """The draft's shape; hidden_size, vocab_size and rope_theta must be the target's."""
    hidden_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    num_target_layers: int
    target_layer_ids: tuple[int, ...]  # 0-based target layers whose outputs the draft reads
    mask_token_id: int
    num_hidden_layers: int = 1
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    block_size: int = 8

    @property
    def feature_width(self) -> int:
        """Values per context row: one hidden state per captured target layer."""
        return len(self.target_layer_ids) * self.hidden_size

    def hf_config(self) -> dict:
        """config.json in z-lab's format (what llama.cpp's DFlashModel converter reads)."""
        plain = asdict(self)
        dflash = {"target_layer_ids": list(self.target_layer_ids), "block_size": self.block_size,
                  "mask_token_id": self.mask_token_id}
        for key in ("target_layer_ids", "mask_token_id"):
            plain.pop(key)
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **plain,
                "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
                "max_position_embeddings": 4096, "rope_parameters": {"rope_theta": self.rope_theta,
                                                                     "rope_type": "default"},
                "layer_types": ["full_attention"] * self.num_hidden_layers, "dflash_config": dflash}


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX-style rotary embedding (rotate_half, as HF Qwen3 and llama.cpp's DFlash): x [b, heads, n, d],
    positions [b, n]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.to(torch.float32)[:, None, :, None] * inv  # [b, 1, n, d/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class SelfAttention(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n_heads, self.c.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, context: torch.Tensor, x_pos: torch.Tensor, ctx_pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x [b, q, h] block rows, context [b, s, h] fused target rows; mask [b, q, s + q] (True: attend)."""
        c = self.c
        kv_in = torch.cat([context, x], 1)
        positions = torch.cat([ctx_pos, x_pos], 1)
        q = rope(self.q_norm(self._heads(self.q_proj(x), c.num_attention_heads)), x_pos, c.rope_theta)
        k = rope(self.k_norm(self._heads(self.k_proj(kv_in), c.num_key_value_heads)), positions, c.rope_theta)
        v = self._heads(self.v_proj(kv_in), c.num_key_value_heads)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class MLP(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = SelfAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, context: torch.Tensor, x_pos: torch.Tensor, ctx_pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        # the context rows are not normed here: hidden_norm already normed them once for every layer
        x = x + self.self_attn(self.input_layernorm(x), context, x_pos, ctx_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """Parameter names are z-lab's (`fc`, `hidden_norm`, `layers.N...`, `norm`): save() writes them as is."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.c = c
        self.fc = nn.Linear(c.feature_width, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, block_embeds: torch.Tensor, features: torch.Tensor, block_pos: torch.Tensor,
                ctx_pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """block_embeds [b, q, h]; features [b, s, feature_width] (the target's captured rows);
        positions [b, q] and [b, s]; mask [b, q, s + q]. Returns the final-normed block rows [b, q, h]."""
        context = self.hidden_norm(self.fc(features))
        x = block_embeds
        for layer in self.layers:
            x = layer(x, context, block_pos, ctx_pos, mask)
        return self.norm(x)

    def save(self, out_dir: Path) -> None:
        """z-lab's HF layout: config.json + model.safetensors (float32)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(self.c.hf_config(), indent=1))
        tensors = {name: p.detach().to(torch.float32).contiguous() for name, p in self.state_dict().items()}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
