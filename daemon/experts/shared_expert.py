"""SharedExpertMoE: routed experts plus a shared expert that every token goes through, scaled by a
sigmoid gate of its own (Qwen3.5-MoE / Qwen3-Next, transformers' Qwen3_5MoeSparseMoeBlock):

    out = moe(x) + sigmoid(x . g) * swiglu_ffn_shared(x)

or added as it is where the file has no gate for it (Laguna's LagunaSparseMoeBlock).

The routed part is the MoEFFN (hot/cold experts) unchanged; the shared expert is a dense FFN resident
on the engine's device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.daemon.experts.moe_ffn import MoEFFN
from ember.kernels.ops import Array, ExpertWeights, Ops, Weight
from ember.kernels.raw_tensor import RawTensor

if TYPE_CHECKING:
    from ember.daemon.loader.model_file import ModelFile


@dataclass
class SharedExpertMoE:
    routed: MoEFFN
    gate: Weight  # [intermediate, hidden]
    up: Weight
    down: Weight
    gate_inp: Weight | None  # [1, hidden]: the shared expert's gate logit (None: ungated)

    def compiled(self, ops: Ops, norm: Array, eps: float) -> Any | None:
        """MoEFFN.compiled with this shared expert inside, where it is ungated (Laguna's); else None."""
        if self.gate_inp is not None:
            return None
        return self.routed.compiled(ops, norm, eps, ExpertWeights(self.gate, self.up, self.down))

    def __call__(self, ops: Ops, x: Array, rows: Array) -> Array:
        out = self.routed(ops, x, rows)
        shared = ops.matmul(ops.swiglu_matmul(x, self.gate, self.up, rows), self.down, rows)
        if self.gate_inp is None:
            return out + shared
        logit = ops.matmul(x, self.gate_inp, rows)  # [n, 1]
        return out + ops.sigmoid_mul(shared, logit + 0.0 * shared)  # the logit broadcast over the row


def has_shared_expert(mf: ModelFile, layer: int) -> bool:
    return f"blk.{layer}.ffn_gate_shexp.weight" in mf.tensors


def with_shared_expert(mf: ModelFile, ops: Ops, layer: int, routed: MoEFFN) -> SharedExpertMoE:
    def w(name: str) -> Weight:
        return ops.weight(mf.tensor(f"blk.{layer}.{name}.weight"))

    g = mf.tensors.get(f"blk.{layer}.ffn_gate_inp_shexp.weight")  # GGUF: [hidden]; HF: [1, hidden]
    row = None if g is None else ops.weight(RawTensor(g.name, g.ttype, (1, g.shape[-1]), g.data.reshape(1, -1)))
    return SharedExpertMoE(routed, w("ffn_gate_shexp"), w("ffn_up_shexp"), w("ffn_down_shexp"), row)
