"""MoEFFN: a mixture-of-experts feed-forward, the object that takes a dense FFN's place in a block.

A router scores the experts per token, each token goes to its top-k, and the outputs are summed with
the routing weights. Which experts are hot (computed where the engine runs) and which cold (computed
by CPU workers, or dropped under the lossy "mask" policy) is the ExpertManager's business; this object
only asks it, per step, for the split and the cold results. Written against the ops API, so other MoE
architectures (a shared expert beside the routed ones, say) can wrap it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.kernels.ops import Array, ExpertWeights, Ops, Routing, Weight
from ember.kernels.raw_tensor import RawTensor

if TYPE_CHECKING:
    from ember.daemon.experts.expert_manager import ExpertManager
    from ember.daemon.loader.model_file import ModelFile


@dataclass(frozen=True)
class ExpertTensors:
    """One expert's tensors as the file stores them (views of the mmap'd file)."""

    gate: RawTensor
    up: RawTensor
    down: RawTensor

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


@dataclass
class MoEFFN:
    layer: int
    router: Weight  # [experts, hidden]
    files: list[ExpertTensors]  # every expert, in the file
    routing: Routing
    manager: ExpertManager
    # the hot experts, on the engine's device (promoted and demoted by the manager between steps)
    hot: dict[int, ExpertWeights] = field(default_factory=dict)
    is_hot: np.ndarray = field(init=False)  # bool [experts]: the keys of `hot`
    table: Any = None  # `hot` as ops.routed_ffn takes it (ops.expert_table), rebuilt as it changes
    # the backend's one-call form of this FFN with its norm (ops.fuse_routed), and the table it was made of
    _compiled: tuple[Any, Any] | None = field(default=None, init=False, repr=False)
    gelu: bool = False  # the experts gate with GELU-tanh (gemma4), not SiLU
    out_scale: np.ndarray | None = None  # per expert, its routed weight's factor (gemma4's per_expert_scale)

    def __post_init__(self) -> None:
        self.is_hot = np.zeros(len(self.files), bool)

    def compiled(self, ops: Ops, norm: Array, eps: float, shared: ExpertWeights | None = None) -> Any | None:
        """h -> h + this FFN of rmsnorm(h, norm) (+ an ungated `shared` expert's), its routing recorded,
        in one backend call (ops.fuse_routed), while every expert is hot; else None (the FFN then runs
        as __call__)."""
        if not self.is_hot.all() or not self._plain:
            return None
        if self._compiled is None or self._compiled[0] is not self.table:
            stats = self.manager.stats
            self._compiled = (self.table, ops.fuse_routed(norm, eps, self.router, self.table, self.routing,
                                                          stats.counts[self.layer], stats.half_life,
                                                          self.manager.routed_slots, shared))
        return self._compiled[1]

    @property
    def _plain(self) -> bool:
        """Whether the backend's routed forms (routed_ffn, fuse_routed) compute this FFN: SiLU experts
        weighted by their routing alone."""
        return not self.gelu and self.out_scale is None

    @property
    def n_experts(self) -> int:
        return len(self.files)

    def promote(self, ops: Ops, experts: list[int]) -> None:
        for e in experts:
            t = self.files[e]
            self.hot[e] = ExpertWeights(ops.weight(t.gate), ops.weight(t.up), ops.weight(t.down), self.gelu)
            self.is_hot[e] = True
        self.table = ops.expert_table(self.hot, self.n_experts)

    def demote(self, ops: Ops, experts: list[int]) -> None:
        for e in experts:
            del self.hot[e]
            self.is_hot[e] = False
        self.table = ops.expert_table(self.hot, self.n_experts)

    def __call__(self, ops: Ops, x: Array, rows: Array, route_x: Array | None = None) -> Array:
        """The experts of x [n, d], routed by x, or by route_x where the router reads another input (gemma4)."""
        n = x.shape[0]
        r = self.routing
        if self.is_hot.all() and self._plain and route_x is None:  # routing and experts in one backend call
            out, ids = ops.routed_ffn(x, self.router, self.table, r, rows)
            self.manager.record(self.layer, ids.reshape(-1), n)
            return out
        ids, weights = ops.route(ops.matmul(x if route_x is None else route_x, self.router, rows), *r)
        if self.out_scale is not None:
            weights = weights * self.out_scale[ids]
        token = np.repeat(np.arange(n), r.k)
        expert, weight = ids.reshape(-1), weights.reshape(-1)
        self.manager.record(self.layer, expert, n)
        hot = self.is_hot[expert]
        if hot.all():
            return ops.expert_ffn(x, self.hot, token, expert, weight, rows)
        cold = ~hot
        pending = self.manager.compute_cold(ops, self.layer, x, rows, token[cold], expert[cold], weight[cold])
        out = ops.expert_ffn(x, self.hot, token[hot], expert[hot], weight[hot], rows)  # meanwhile, the hot ones
        return out if pending is None else out + pending.wait()


def expert_files(mf: ModelFile, layer: int) -> list[ExpertTensors]:
    gates, ups, downs = (mf.experts(layer, p) for p in ("gate", "up", "down"))
    return [ExpertTensors(g, u, d) for g, u, d in zip(gates, ups, downs, strict=True)]


def load_moe_ffn(mf: ModelFile, ops: Ops, layer: int, manager: ExpertManager) -> MoEFFN:
    c = mf.config
    bias = mf.tensors.get(f"blk.{layer}.exp_probs_b.bias")
    routing = Routing(c.n_experts_used, c.expert_norm, c.expert_gating,
                      None if bias is None else ops.to_numpy(ops.vector(bias)), c.router_softcap, c.expert_scale)
    scale = mf.tensors.get(f"blk.{layer}.ffn_down_exps.scale")
    ffn = MoEFFN(layer, ops.weight(mf.tensor(f"blk.{layer}.ffn_gate_inp.weight")), expert_files(mf, layer), routing,
                 manager, gelu=c.ffn_act == "gelu_tanh",
                 out_scale=None if scale is None else ops.to_numpy(ops.vector(scale)).astype(np.float32))
    ffn.promote(ops, manager.hot_experts(layer))
    manager.register(ffn)
    return ffn
