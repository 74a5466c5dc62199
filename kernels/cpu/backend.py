"""CpuOps: the ops API on the CPU, numba kernels over numpy arrays."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ember.kernels.cpu import (decoder_layer, dense, expert_ffn, greedy_decode, kernel_tiers, linear_attention, quant_matmul,
                               sandwich_stack, sandwich_layer)
from ember.kernels.cpu.paged_attention import KVLayerStore, paged_attention
from ember.kernels.cpu.routing import route as compiled_route
from ember.kernels.layer_stack import LayerStack, StepArrays
from ember.kernels.ops import (Array, ExpertWeights, LayerShape, LayerWeights, Ops, Routing, SandwichModel, SandwichShape,
                               SandwichWeights)
from ember.kernels.reference.quant import dequantize
from ember.kernels.raw_tensor import RawTensor


class CpuOps(Ops):
    name = "cpu"
    host_memory = True

    def __init__(self) -> None:
        self._last_rows: tuple[Array | None, bool | np.ndarray] = (None, False)

    def weight(self, t: RawTensor) -> quant_matmul.CpuWeight:
        return quant_matmul.pack(t)

    def vector(self, t: RawTensor) -> np.ndarray:
        return np.ascontiguousarray(dequantize(t.ttype, t.rows2d(), t.cols).reshape(-1))

    def weight_rows(self, w: quant_matmul.CpuWeight) -> int:
        return w.rows

    def matmul(self, x: Array, w: quant_matmul.CpuWeight, decode_rows: Array | None = None) -> np.ndarray:
        return quant_matmul.matmul(x, w, self._flags(decode_rows), self.prompt_act == "q8_0")

    def matmul_many(self, x: Array, ws: tuple[quant_matmul.CpuWeight, ...], decode_rows: Array | None = None) -> list[np.ndarray]:
        return quant_matmul.matmul_many(x, ws, self._flags(decode_rows), self.prompt_act == "q8_0")

    def swiglu_matmul(self, x: Array, gate: quant_matmul.CpuWeight, up: quant_matmul.CpuWeight,
                      decode_rows: Array | None = None) -> np.ndarray:
        return quant_matmul.swiglu_matmul(x, gate, up, self._flags(decode_rows), int8_prompts=self.prompt_act == "q8_0")

    def geglu_matmul(self, x: Array, gate: quant_matmul.CpuWeight, up: quant_matmul.CpuWeight,
                     decode_rows: Array | None = None) -> np.ndarray:
        return quant_matmul.swiglu_matmul(x, gate, up, self._flags(decode_rows), gelu=True,
                                          int8_prompts=self.prompt_act == "q8_0")

    def _flags(self, decode_rows: Array | None) -> bool | np.ndarray:
        """decode_flags of a step's mask, computed once per step: every layer passes the same array.
        One tuple, read and replaced whole, so threads stepping other runners of the model are safe."""
        seen, flags = self._last_rows
        if seen is not decode_rows:
            flags = quant_matmul.decode_flags(decode_rows)
            self._last_rows = (decode_rows, flags)
        return flags

    def fuse_layer(self, w: LayerWeights | SandwichWeights, shape: LayerShape | SandwichShape
                   ) -> decoder_layer.FusedLayer | sandwich_layer.SandwichLayer | None:
        if isinstance(w, SandwichWeights):
            return sandwich_layer.fuse(*w, *shape)
        return decoder_layer.fuse(*w, *shape)

    def run_fused_layer(self, fused: decoder_layer.FusedLayer | sandwich_layer.SandwichLayer, x: Array,
                        k: KVLayerStore, v: KVLayerStore, step: StepArrays) -> np.ndarray | None:
        # prompt rows take the float kernels: op by op; so does every row while the fused layers compile
        if kernel_tiers.first_tier_only() or self._flags(step.decode_rows) is not True:
            return None
        if isinstance(fused, sandwich_layer.SandwichLayer):
            return sandwich_layer.run(fused, x, k, v, step)
        return decoder_layer.run(fused, x, k, v, step.positions, step.attends_to, step.kv_blocks,
                                 step.kv_offsets, step.tables, step.token_seq)

    def run_fused_layers(self, fused: Sequence[decoder_layer.FusedLayer], x: Array, ks: Sequence[KVLayerStore],
                         vs: Sequence[KVLayerStore], step: StepArrays,
                         routed: Sequence[expert_ffn.FusedRouted | None] = ()) -> np.ndarray | None:
        if kernel_tiers.first_tier_only() or self._flags(step.decode_rows) is not True:
            return None
        if isinstance(fused[0], sandwich_layer.SandwichLayer):  # a gemma4 stack
            return sandwich_stack.run_stack(fused, x, ks, vs, step)
        return decoder_layer.run_stack(fused, x, ks, vs, step.positions, step.attends_to,
                                       step.kv_blocks, step.kv_offsets, step.tables, step.token_seq, routed)

    def greedy_plan(self, stack: LayerStack, embed: quant_matmul.CpuWeight, norm: Array, eps: float,
                    output: quant_matmul.CpuWeight, ks: Sequence[KVLayerStore], vs: Sequence[KVLayerStore],
                    routed: Sequence[expert_ffn.FusedRouted | None] = (), sandwich: SandwichModel | None = None
                    ) -> greedy_decode.GreedyPlan | sandwich_stack.SandwichPlan | None:
        if sandwich is not None:
            return sandwich_stack.plan(stack.fused, stack.kv_layers, embed, np.asarray(norm), eps, output, ks, vs,
                                       *sandwich)
        if stack.whole is None or not all(isinstance(f, decoder_layer.FusedLayer) for f in stack.whole):
            return None
        return greedy_decode.plan(stack.whole, embed, np.asarray(norm), eps, output, [ks[i] for i in stack.kv_layers],
                                  [vs[i] for i in stack.kv_layers], routed)

    def greedy_burst(self, plan: greedy_decode.GreedyPlan | sandwich_stack.SandwichPlan, steps: int, step: StepArrays,
                     block_size: int, stops: np.ndarray) -> np.ndarray | None:
        if kernel_tiers.first_tier_only():  # the burst's loop is compiled in the second tier
            return None
        if isinstance(plan, sandwich_stack.SandwichPlan):
            return sandwich_stack.burst(plan, steps, step, block_size, stops)
        return greedy_decode.burst(plan, steps, step.ids, step.positions, step.kv_blocks, step.kv_offsets, step.tables,
                                   step.token_seq, block_size, stops)

    def lookup_burst(self, plan: greedy_decode.GreedyPlan | sandwich_stack.SandwichPlan, budget: int, k: int, min_n: int,
                     max_n: int, history: np.ndarray, length: int, step: StepArrays, block_size: int,
                     stops: np.ndarray) -> tuple[np.ndarray, int, int, int] | None:
        if kernel_tiers.first_tier_only() or not isinstance(plan, greedy_decode.GreedyPlan):
            return None
        return greedy_decode.lookup_burst(plan, budget, k, min_n, max_n, history, length, int(step.positions[0]),
                                          step.tables, step.token_seq, block_size, stops)

    def route(self, logits: Array, k: int, normalize: bool, gating: str = "softmax", bias: np.ndarray | None = None,
              softcap: float = 0.0, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        return compiled_route(logits, k, normalize, gating, bias, softcap, scale)

    def expert_table(self, experts: Mapping[int, ExpertWeights], n_experts: int) -> expert_ffn.ExpertTable:
        return expert_ffn.expert_table(experts, n_experts)

    def routed_ffn(self, x: Array, router: quant_matmul.CpuWeight, table: expert_ffn.ExpertTable, routing: Routing,
                   decode_rows: Array | None = None) -> tuple[np.ndarray, np.ndarray]:
        if table.complete and (router.int8 or router.f32 is not None) and self._flags(decode_rows) is True:
            return expert_ffn.routed_ffn(x, router, table, routing)  # router, routing, experts: one compiled call
        return super().routed_ffn(x, router, table, routing, decode_rows)

    def fuse_routed(self, norm: Array, eps: float, router: quant_matmul.CpuWeight, table: expert_ffn.ExpertTable,
                    routing: Routing, counts: np.ndarray, half_life: float, routed: np.ndarray,
                    shared: ExpertWeights | None = None) -> expert_ffn.FusedRouted | None:
        return expert_ffn.fuse_routed(np.asarray(norm), eps, router, table, routing, counts, half_life, routed, shared)

    def expert_ffn(self, x: Array, experts: Mapping[int, ExpertWeights], token: np.ndarray, expert: np.ndarray,
                   weight: np.ndarray, decode_rows: Array | None = None) -> np.ndarray:
        out = None
        # decode steps: every expert group in one compiled call
        if self._flags(decode_rows) is True:
            out = expert_ffn.expert_ffn(x, experts, token, expert, weight)
        return super().expert_ffn(x, experts, token, expert, weight, decode_rows) if out is None else out

    def embedding(self, w: quant_matmul.CpuWeight, ids: np.ndarray) -> np.ndarray:
        return quant_matmul.embedding(w, np.asarray(ids, dtype=np.int64))

    def rmsnorm(self, x: Array, w: Array, eps: float) -> np.ndarray:
        return dense.rmsnorm(x, w, eps)

    def add_rmsnorm(self, x: Array, y: Array, w: Array, eps: float, scale: float = 1.0) -> np.ndarray:
        return dense.add_rmsnorm(x, y, w, eps, scale)

    def rope(self, x: Array, positions: np.ndarray, inv_freq: Array, interleaved: bool) -> np.ndarray:
        return dense.rope(x, positions, inv_freq, interleaved)

    def qk_norm_rope(self, q: Array, k: Array, q_norm: Array | None, k_norm: Array | None, eps: float,
                     positions: np.ndarray, inv_freq: Array, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
        return dense.qk_norm_rope(q, k, q_norm, k_norm, eps, positions, inv_freq, interleaved)

    def kv_store(self, dtype: str, n_blocks: int, block_size: int, kv_heads: int, head_dim: int, *,
                 keys: bool) -> KVLayerStore:
        return KVLayerStore.allocate(dtype, n_blocks, block_size, kv_heads, head_dim, keys=keys)

    def kv_write(self, store: KVLayerStore, blocks: np.ndarray, offsets: np.ndarray, rows: Array) -> None:
        store.write(blocks, offsets, rows)

    def paged_attention(self, q: Array, k: KVLayerStore, v: KVLayerStore, tables: np.ndarray, token_seq: np.ndarray,
                        positions: np.ndarray, scale: float, window: int = 0) -> np.ndarray:
        return paged_attention(np.ascontiguousarray(q), k, v, tables, token_seq, positions, scale, window)

    def sigmoid_mul(self, x: Array, gate: Array) -> np.ndarray:
        return dense.sigmoid_mul(x, gate)

    def geglu(self, gate: Array, up: Array) -> np.ndarray:
        return dense.geglu(gate, up)

    def softcap(self, x: Array, cap: float) -> np.ndarray:
        return dense.softcap(x, cap)

    def softplus_gate(self, x: Array, gate: Array) -> np.ndarray:
        return dense.softplus_gate(x, gate)

    def causal_conv1d(self, x: Array, w: Array, states: Array, seq_starts: Array, state_slots: Array,
                      positions: Array) -> np.ndarray:
        return linear_attention.causal_conv1d(x, w, states, seq_starts, state_slots, positions)

    def gated_delta_net(self, qkv: Array, a: Array, b: Array, A: Array, dt_bias: Array, states: Array,
                        seq_starts: Array, state_slots: Array, positions: Array, k_heads: int, k_dim: int,
                        tiled: bool) -> np.ndarray:
        return linear_attention.gated_delta_net(qkv, a, b, A, dt_bias, states, seq_starts, state_slots, positions,
                                                k_heads, k_dim, tiled)

    def swiglu(self, gate: Array, up: Array) -> np.ndarray:
        return dense.swiglu(gate, up)

    def softmax(self, x: Array) -> np.ndarray:
        return dense.softmax(x)

    def argmax_rows(self, x: Array, rows: np.ndarray) -> np.ndarray:
        if len(rows) == len(x):  # every row sampled (decode steps): no copy of the rows first (15 -> 7 us at 4 x 8192)
            return np.argmax(x, axis=1)[rows]
        return np.argmax(x[rows], axis=1)

    def to_device(self, x: np.ndarray) -> np.ndarray:
        return x  # host memory is this backend's memory

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def to_numpy(self, x: Array) -> np.ndarray:
        return np.asarray(x)
