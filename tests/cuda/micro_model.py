"""The micro model of the CUDA tests: hidden 64, 2 layers, every weight type ember reads, and a small
vocabulary (512), since under the simulator the output matmul's cost grows with it. K-quants need
256-value rows, so they sit where the inputs are 256 wide: ffn_down (intermediate 256) and
attn_output (4 heads x 64)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ember.kernels.tensor_types import TensorType as T
from gguf_writer import write_gguf
from tiny_models import build_hf_model

MICRO = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             vocab_size=512)
TYPES = {"blk.0.attn_q.weight": T.Q8_0, "blk.0.attn_k.weight": T.F16, "blk.0.attn_v.weight": T.BF16,
         "blk.0.attn_output.weight": T.Q6_K, "blk.0.ffn_gate.weight": T.F32, "blk.0.ffn_up.weight": T.Q8_0,
         "blk.0.ffn_down.weight": T.Q4_K,
         "blk.1.attn_q.weight": T.BF16, "blk.1.attn_k.weight": T.Q8_0, "blk.1.attn_v.weight": T.F16,
         "blk.1.attn_output.weight": T.Q4_K, "blk.1.ffn_gate.weight": T.F16, "blk.1.ffn_up.weight": T.BF16,
         "blk.1.ffn_down.weight": T.Q5_K,
         "token_embd.weight": T.Q8_0, "output.weight": T.Q8_0, "*": T.F32}
WEIGHT_TYPES = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K}


def write_micro_model(directory: Path, arch: str = "qwen3") -> Path:
    _, ref = build_hf_model(arch, directory / "hf", **MICRO)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in ref.state_dict().items()}
    return write_gguf(directory / f"micro-{arch}.gguf", ref.config, state, TYPES)
