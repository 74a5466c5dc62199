"""LayerStack: a model's layers as its backend runs them (ops.compile_stack) — compiled where the
backend has a compiled form of a layer and the step suits it, op by op (the model's own code) where
not. The model hands over its layers once and runs every step through the stack, so it holds no
backend paths of its own.

A layer comes as a StackLayer: its op-by-op run, and where it is a standard decoder layer its
weights (ops.LayerWeights; a dense gemma4 layer's: ops.SandwichWeights), which a backend may
compile (ops.fuse_layer). A compiled layer without its FFN (a MoE layer: the experts run as
ops.expert_ffn) stops at the attention's residual, and the layer's own `finish` does the rest, or
the backend's compiled form of it (ops.fuse_routed) while every expert is hot. When every layer is
compiled with its FFN or such a finish, a step that suits them runs the whole stack in one backend
call (ops.run_fused_layers: no Python between layers), each layer given the K/V stores it reads
(a KV-shared layer: another layer's).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ember.kernels.ops import LayerShape, LayerWeights, Ops, SandwichShape, SandwichWeights

Array = Any  # numpy.ndarray on cpu, cupy.ndarray on cuda


class StepArrays(Protocol):
    """What a stack reads of one step (the daemon's StepBatch, its arrays on the device): [n] rows."""
    ids: Array
    positions: Array
    kv_blocks: Array
    kv_offsets: Array
    tables: Array
    token_seq: Array
    decode_rows: Array
    # where a KV cache keeps sliding layers' windows in rings, their tables and blocks (else None);
    # gemma4's per-layer inputs [n, layers, P] (else None)
    window_tables: Array | None
    window_blocks: Array | None
    layer_inputs: Array | None

    @property
    def attends_to(self) -> Array: ...


class KVStores(Protocol):
    """A paged KV cache's stores, one per attention layer."""
    k: Sequence[Any]
    v: Sequence[Any]


@dataclass(frozen=True)
class StackLayer:
    run: Callable[[Array, StepArrays, KVStores], Array]  # the whole layer, op by op
    # a standard decoder layer's parts, for a backend to compile (None: it always runs op by op)
    weights: LayerWeights | SandwichWeights | None = None
    shape: LayerShape | SandwichShape | None = None
    kv_layer: int = 0  # its keys and values' layer in the cache
    finish: Callable[[Array, StepArrays], Array] | None = None  # h -> h + ffn(rmsnorm(h)), op by op
    # a MoE layer: the backend's one-call form of `finish` (ops.fuse_routed) while it has one (every
    # expert hot), else None
    routed: Callable[[], Any | None] | None = None


class LayerStack:
    def __init__(self, ops: Ops, layers: Sequence[StackLayer], fused: Sequence[Any | None]) -> None:
        """fused: per layer, the backend's compiled form (None: op by op only)."""
        self.ops, self.layers = ops, list(layers)
        self.fused = list(fused)
        # every layer compiled with its FFN or finished by a routed one: the stack in one backend call
        whole = all(f is not None and layer.weights is not None
                    and (layer.weights.gate is not None or layer.routed is not None)
                    for f, layer in zip(self.fused, self.layers, strict=True))
        self.whole: list[Any] | None = list(self.fused) if whole and self.fused else None
        self.kv_layers = [layer.kv_layer for layer in self.layers]  # each layer's cache layer (KV-shared: another's)
        self._routed = [i for i, layer in enumerate(self.layers) if layer.routed is not None]

    def routed_now(self) -> list[Any | None] | None:
        """Per layer, its routed FFN's compiled form as it stands (None for a dense layer), or None
        where a MoE layer has none now (an expert not hot): the stack then runs layer by layer."""
        parts: list[Any | None] = [None] * len(self.layers)
        for i in self._routed:
            parts[i] = self.layers[i].routed()  # type: ignore[misc]
            if parts[i] is None:
                return None
        return parts

    def run(self, x: Array, step: StepArrays, cache: KVStores, tap: Callable[[int, Array], None] | None = None) -> Array:
        """Hidden states x [n, d] through every layer (f32 in, f32 out), their K/V written to `cache`;
        tap(i, x) sees the input of each layer i first (then no layer runs with the next)."""
        routed = self.routed_now() if tap is None and self.whole is not None else None
        if routed is not None:
            out = self.ops.run_fused_layers(self.whole, x, [cache.k[i] for i in self.kv_layers],
                                            [cache.v[i] for i in self.kv_layers], step, routed)
            if out is not None:
                return out
        for i in range(len(self.layers)):  # x is rebound: a layer's input is freed once the next has run
            if tap is not None:
                tap(i, x)
            x = self._layer(i, x, step, cache)
        return x

    def _layer(self, i: int, x: Array, step: StepArrays, cache: KVStores) -> Array:
        layer, fused = self.layers[i], self.fused[i]
        if fused is not None:
            out = self.ops.run_fused_layer(fused, x, cache.k[layer.kv_layer], cache.v[layer.kv_layer], step)
            if out is not None:
                if layer.weights is not None and layer.weights.gate is not None:
                    return out
                assert layer.finish is not None, "a layer compiled without its FFN needs its finish"
                return layer.finish(out, step)
        return layer.run(x, step, cache)
