"""The ops API: every numerical primitive a model needs, one interface, one backend chosen at load.

Model code (ember.daemon.models) calls only these methods and plain array arithmetic (`a + b`,
slicing), which numpy and cupy share, so the same model runs on every backend without `if`s.
Shapes: n = tokens in the step, d = hidden, h = heads, hd = head_dim, f = FFN width. Activations are
float32 at every interface; storage formats live inside the backend.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import numpy as np

from ember.kernels.layer_stack import LayerStack, StackLayer, StepArrays
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.sampling import Choice
from ember.kernels.sampling_batch import SamplingBatch, sample_batch

Array = Any  # numpy.ndarray on cpu, cupy.ndarray on cuda
Weight = Any  # a backend's packed matrix (keeps the file's quantization)


class ExpertWeights(NamedTuple):
    """One MoE expert's gated FFN, as the backend holds it: down(silu(gate x) * up x), or with
    GELU-tanh in silu's place where `gelu` (gemma4)."""

    gate: Weight
    up: Weight
    down: Weight
    gelu: bool = False


class Routing(NamedTuple):
    """How a MoE layer's router picks and weighs its experts (Ops.route's parameters)."""

    k: int  # experts per token
    normalize: bool  # renormalise the top-k weights to sum to 1
    gating: str = "softmax"  # or "sigmoid"
    bias: np.ndarray | None = None  # sigmoid gating's selection bias [experts] (host float32)
    softcap: float = 0.0
    scale: float = 1.0


class LayerWeights(NamedTuple):
    """A standard decoder layer (ops.fuse_layer): h = x + attention(rmsnorm(x)), then h + ffn(rmsnorm(h)),
    the attention with q/k/v (and optional biases), q/k head norms (optional) and rope, its output
    scaled by softplus(rmsnorm(x) . out_gate) (optional: laguna), the FFN down(swiglu(gate x, up x));
    gate, up and down None: a layer whose FFN is not fused (MoE), which the fused form takes up to h."""

    attn_norm: Array
    wq: Weight
    wk: Weight
    wv: Weight
    wo: Weight
    bq: Array | None
    bk: Array | None
    bv: Array | None
    q_norm: Array | None
    k_norm: Array | None
    ffn_norm: Array
    gate: Weight | None
    up: Weight | None
    down: Weight | None
    out_gate: Weight | None = None


class LayerShape(NamedTuple):
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    inv_freq: Array
    interleaved: bool
    window: int = 0  # a sliding-window layer's keys (Ops.paged_attention)
    scale: float = 0.0  # the attention scores' scale (0: head_dim^-1/2)


class SandwichWeights(NamedTuple):
    """Gemma 4's dense layer (ops.fuse_layer), norms on both sides of each part:
    h = x + post_attn_norm(attention(attn_norm(x))), then y = h + post_ffn_norm(ffn(ffn_norm(h))),
    the FFN down(gelu_tanh(gate x) * up x); with a per-layer input p, y + input_norm(input_proj(
    gelu_tanh(input_gate y) * p)); all of it times the layer's scalar. The attention's values are
    RMS-normed (v_norm, no weight of its own), taken from the keys' projection where wv is None; a
    KV-shared layer has neither wk nor wv and reads another layer's keys and values."""

    attn_norm: Array
    wq: Weight
    wk: Weight | None
    wv: Weight | None
    wo: Weight
    q_norm: Array
    k_norm: Array | None
    v_norm: Array | None
    post_attn_norm: Array
    ffn_norm: Array
    gate: Weight
    up: Weight
    down: Weight
    post_ffn_norm: Array
    input_gate: Weight | None  # the per-layer input's (None: the model has none)
    input_proj: Weight | None
    input_norm: Array | None


class SandwichShape(NamedTuple):
    n_heads: int
    kv_heads: int
    head_dim: int
    eps: float
    inv_freq: Array
    interleaved: bool
    window: int  # a sliding-window layer's keys (0: all); a ring's tables where the step has them
    scale: float  # the scores' scale
    out_scale: float  # the layer's scalar
    layer: int  # the model's layer index: its column of the step's per-layer inputs


class SandwichModel(NamedTuple):
    """What a Gemma 4 model's greedy decode step adds around its sandwich-normed layers (greedy_plan):
    the embedding's scale, the logits' soft cap, the per-layer inputs' weights (PerLayerEmbedding's;
    None where the model has none) and whether the KV cache keeps the sliding layers in rings."""

    embed_scale: float
    logit_softcap: float  # 0: none
    input_table: Weight | None  # [vocab, layers * width]
    input_proj: Weight | None  # [layers * width, hidden]
    input_norm: Array | None  # [width]
    rings: bool


class Ops(ABC):
    name: str
    # tokens per chunk of gated_delta_net's chunked form, counted from each run's first token (the
    # engine cuts prompt runs at multiples of it, so a hybrid's rounding does not depend on the steps)
    linear_attention_chunk: int = 64
    # the kernels read host memory: to_device is the identity (a step's metadata is not moved at all)
    host_memory: bool = False
    # activations of prompt rows against quantized weights (convert.PROMPT_ACTIVATIONS): "f32" exact,
    # "q8_0" each 32 values quantized to int8 for integer products, where a backend has them (the CPU)
    prompt_act: str = "f32"

    def device_scope(self) -> AbstractContextManager[Any]:
        """Inside it, the calling thread allocates and launches on this ops' device. A GPU runtime binds
        its current device per thread, so whoever loads weights or runs a step enters it (Model's
        load, EngineCore.step); the CPU has nothing to bind."""
        return nullcontext()

    # --- placing weights ------------------------------------------------------------------------
    @abstractmethod
    def weight(self, t: RawTensor) -> Weight:
        """A 2-D matrix [rows, cols] for matmul/embedding, in the kernels' layout, still quantized."""

    @abstractmethod
    def vector(self, t: RawTensor) -> Array:
        """A small 1-D tensor (norm weight, bias) as float32 on the device."""

    @abstractmethod
    def weight_rows(self, w: Weight) -> int: ...

    # --- kernels --------------------------------------------------------------------------------
    @abstractmethod
    def matmul(self, x: Array, w: Weight, decode_rows: Array | None = None) -> Array:
        """x [n, cols] f32 times w^T -> [n, rows] f32 (a matvec when n == 1).

        decode_rows (bool [n], StepBatch.decode_rows) marks generated tokens: a backend may multiply
        those with quantized activations, as llama.cpp does; every other row exactly, in float32. A
        row's result must depend only on its own values and flag, never on the other rows."""

    def matmul_many(self, x: Array, ws: tuple[Weight, ...], decode_rows: Array | None = None) -> list[Array]:
        """[matmul(x, w, decode_rows) for w in ws]: one input by several weights (q, k and v), which a
        backend may run as one kernel."""
        return [self.matmul(x, w, decode_rows) for w in ws]

    def swiglu_matmul(self, x: Array, gate: Weight, up: Weight, decode_rows: Array | None = None) -> Array:
        """swiglu(matmul(x, gate), matmul(x, up)): a gated FFN's first half, which a backend may fuse."""
        return self.swiglu(self.matmul(x, gate, decode_rows), self.matmul(x, up, decode_rows))

    def geglu_matmul(self, x: Array, gate: Weight, up: Weight, decode_rows: Array | None = None) -> Array:
        """geglu(matmul(x, gate), matmul(x, up)): swiglu_matmul with GELU-tanh (gemma4's FFN)."""
        return self.geglu(self.matmul(x, gate, decode_rows), self.matmul(x, up, decode_rows))

    def route(self, logits: Array, k: int, normalize: bool, gating: str = "softmax", bias: np.ndarray | None = None,
              softcap: float = 0.0, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """Top-k routing of router logits [n, experts] -> (expert ids int64 [n, k], their weights
        float32 [n, k]). `gating` "softmax": a softmax over the experts, each token's k most probable;
        "sigmoid": each expert's sigmoid, the k whose sigmoid + bias[e] (a selection bias; None: 0)
        is highest, weighted by their sigmoids. Logits are soft-capped first where softcap > 0
        (softcap * tanh(logits / softcap)); the weights renormalised to sum to 1 when `normalize`,
        then times `scale`. On the host: the step's grouping by expert (and the split between hot
        and cold experts) is host work."""
        if gating == "softmax" and not softcap:
            probs = self.to_numpy(self.softmax(logits))
        else:
            z = self.to_numpy(logits).astype(np.float32)
            if softcap:
                z = np.float32(softcap) * np.tanh(z / np.float32(softcap))
            probs = self.to_numpy(self.softmax(self.to_device(z))) if gating == "softmax" else 1 / (1 + np.exp(-z))
        selection = probs if bias is None else probs + bias
        ids = np.argsort(-selection, axis=1, kind="stable")[:, :k]
        top = np.take_along_axis(probs, ids, axis=1)
        if normalize:
            top = top / top.sum(axis=1, keepdims=True, dtype=np.float32)
        if scale != 1.0:
            top = top * np.float32(scale)
        return ids, top.astype(np.float32, copy=False)

    def expert_table(self, experts: Mapping[int, ExpertWeights], n_experts: int) -> Any:
        """A layer's hot experts (expert id -> weights, of n_experts in all) as routed_ffn takes them,
        built once each time the hot set changes. Default: the mapping itself."""
        return dict(experts)

    def routed_ffn(self, x: Array, router: Weight, table: Any, routing: Routing,
                   decode_rows: Array | None = None) -> tuple[Array, np.ndarray]:
        """A MoE layer's routed experts where every one of them is hot (`table`: expert_table's):
        route(matmul(x, router)) and expert_ffn over every (token, expert) pair -> (out [n, d], the
        chosen expert ids int64 [n, k]), which a backend may run as one call. This default makes the
        three calls."""
        ids, weights = self.route(self.matmul(x, router, decode_rows), *routing)
        token = np.repeat(np.arange(x.shape[0]), routing.k)
        return self.expert_ffn(x, table, token, ids.reshape(-1), weights.reshape(-1), decode_rows), ids

    def fuse_routed(self, norm: Array, eps: float, router: Weight, table: Any, routing: Routing, counts: np.ndarray,
                    half_life: float, routed: np.ndarray, shared: ExpertWeights | None = None) -> Any | None:
        """A backend's compiled form of a MoE layer's FFN after its fused attention: h + routed_ffn(
        rmsnorm(h, norm)) (+ the ungated `shared` expert's SwiGLU of it) with every expert hot
        (`table`: expert_table's), each step's chosen experts recorded as RoutingStats.record does into
        `counts` (the layer's float64 row, in place, halving every `half_life` tokens) and counted into
        `routed` (int64 [1]); for run_fused_layers and greedy_plan. None (this default) where it has
        none: the layer then finishes op by op."""
        return None

    def expert_ffn(self, x: Array, experts: Mapping[int, ExpertWeights], token: np.ndarray, expert: np.ndarray,
                   weight: np.ndarray, decode_rows: Array | None = None) -> Array:
        """The routed experts of one MoE layer: out[t] = sum over pairs p with token[p] == t of
        weight[p] * experts[expert[p]](x[t]) -> [n, d] (rows no pair names are 0).

        The pairs (host arrays [pairs]) are grouped by expert, and each expert multiplies all its
        tokens in one call, so its weights are read once per step; groups run in expert order, so the
        sum is the same whichever subset of pairs a call is given. A token's result depends only on
        its own row and decode flag (as in matmul)."""
        out = self.zeros(tuple(x.shape))  # an expert maps the hidden width to itself
        order = np.argsort(expert, kind="stable")
        bounds = np.flatnonzero(np.diff(expert[order])) + 1
        for group in np.split(order, bounds) if order.size else ():
            w = experts[int(expert[group[0]])]
            t = token[group]  # distinct: a token's top-k experts are distinct
            rows = None if decode_rows is None else decode_rows[self.to_device(t)]
            xt = x[self.to_device(t)]
            y = self.matmul((self.geglu_matmul if w.gelu else self.swiglu_matmul)(xt, w.gate, w.up, rows), w.down, rows)
            out[self.to_device(t)] += y * self.to_device(weight[group])[:, None]
        return out

    # --- the layer stack ---------------------------------------------------------------------------
    def compile_stack(self, layers: Sequence[StackLayer]) -> LayerStack:
        """A model's layers as this backend runs them: each standard layer in its compiled form
        (fuse_layer) where the backend has one, the rest op by op (kernels/layer_stack.py)."""
        return LayerStack(self, layers, [None if layer.weights is None or layer.shape is None
                                         else self.fuse_layer(layer.weights, layer.shape) for layer in layers])

    def fuse_layer(self, w: LayerWeights | SandwichWeights, shape: LayerShape | SandwichShape) -> Any | None:
        """A backend's compiled form of a standard layer (or a sandwich-normed one: gemma4), for
        run_fused_layer; None (this default) where it has none: the layer then always runs op by op."""
        return None

    def run_fused_layer(self, fused: Any, x: Array, k: Any, v: Any, step: StepArrays) -> Array | None:
        """The layer `fused` on x [n, d] -> its output [n, d] (h, after the attention, if it was fused
        without its FFN), its K/V written to the stores k and v as kv_write does and read as
        paged_attention does (rope at step.positions, each token seeing its sequence's keys 0 ..
        step.attends_to[i]); or None, having done nothing, for a step the fused form does not take
        (the stack then runs the layer op by op). Bit for bit what the ops compute one by one, so a
        row's result never depends on which of the two ran it."""
        raise NotImplementedError(f"{self.name} fuses no layers")

    def run_fused_layers(self, fused: Sequence[Any], x: Array, ks: Sequence[Any], vs: Sequence[Any],
                         step: StepArrays, routed: Sequence[Any | None] = ()) -> Array | None:
        """Layers fused with their FFNs, or without them where routed[i] (fuse_routed's) finishes
        layer i, one after another (layer i's K/V in the stores ks[i] and vs[i]): run_fused_layer on
        each, asked in one call so that a backend can keep Python off the way between them; None,
        having done nothing, for a step the fused form does not take. Whether it takes one depends on
        the step alone, so the first layer decides for all of them. This default has no routed
        layers (fuse_routed gives none)."""
        if any(r is not None for r in routed):
            return None
        for i, (layer, k, v) in enumerate(zip(fused, ks, vs, strict=True)):
            out = self.run_fused_layer(layer, x, k, v, step)
            if out is None:
                if i:
                    raise RuntimeError(f"fused layer {i} refused a step that layer 0 ran (a bug)")
                return None
            x = out
        return x

    # --- a greedy decode burst at once -----------------------------------------------------------
    def greedy_plan(self, stack: LayerStack, embed: Weight, norm: Array, eps: float, output: Weight,
                    ks: Sequence[Any], vs: Sequence[Any], routed: Sequence[Any | None] = (),
                    sandwich: SandwichModel | None = None) -> Any | None:
        """A backend's compiled form of a whole model's greedy decode step (a stack whose layers are
        all compiled with their FFNs, or finished by routed[i], fuse_routed's; layer i's K/V in ks[i]
        and vs[i]; the embedding, final norm and output projection), for greedy_burst; None (this
        default) where it has none: decode bursts then step from Python. sandwich: a Gemma 4 model's
        (its layers all fused sandwich layers, each reading cache layer stack.layers[i].kv_layer of
        ks and vs)."""
        return None

    def greedy_burst(self, plan: Any, steps: int, step: StepArrays, block_size: int,
                     stops: np.ndarray) -> np.ndarray | None:
        """Up to `steps` greedy decode steps of one generated token per sequence (`step` the first of
        them), each row's next input its logits' argmax, until every row has met one of its stop ids
        (stops [n, m], -1 pads; a row that has keeps its stop token as its input) -> host int64
        tokens [steps taken, n]: bit for bit what the fused layers, rmsnorm, matmul and argmax_rows
        give step by step; None, having done nothing, where the backend cannot run it now (its
        compiled loop not yet compiled: kernels/cpu/kernel_tiers.py)."""
        raise NotImplementedError(f"{self.name} has no greedy decode bursts")

    def lookup_burst(self, plan: Any, budget: int, k: int, min_n: int, max_n: int, history: np.ndarray, length: int,
                     step: StepArrays, block_size: int, stops: np.ndarray) -> tuple[np.ndarray, int, int, int] | None:
        """Greedy decoding of one sequence (`step` its first decode step, stops [m]) with n-gram
        proposals from history[:length] verified in the same loop, up to `budget` tokens
        (greedy_decode.lookup_burst) -> (tokens, rounds, proposed, accepted); None (this default),
        having done nothing, where the backend has no such loop for `plan`."""
        return None

    @abstractmethod
    def embedding(self, w: Weight, ids: np.ndarray) -> Array:
        """Rows `ids` of w, dequantized -> [len(ids), cols] f32."""

    @abstractmethod
    def rmsnorm(self, x: Array, w: Array, eps: float) -> Array:
        """RMS-normalise over the last axis and scale by w; x is [..., d]."""

    def add_rmsnorm(self, x: Array, y: Array, w: Array, eps: float, scale: float = 1.0) -> Array:
        """(x + rmsnorm(y, w)) * scale: a residual stream x taking a normed branch y (Gemma's post-norms),
        which a backend may fuse."""
        out = x + self.rmsnorm(y, w, eps)
        return out if scale == 1.0 else out * scale

    @abstractmethod
    def rope(self, x: Array, positions: np.ndarray, inv_freq: Array, interleaved: bool) -> Array:
        """Rotary embedding of x [n, h, hd] at positions [n] (in place, returns x).

        interleaved=True rotates adjacent pairs (x[2i], x[2i+1]), the layout of llama-arch GGUF files
        whose q/k rows llama.cpp's converter permuted; False rotates halves (x[i], x[i+hd/2]), the
        Hugging Face layout (and qwen2/qwen3 GGUF, which the converter leaves alone).
        """

    def qk_norm_rope(self, q: Array, k: Array, q_norm: Array | None, k_norm: Array | None, eps: float,
                     positions: np.ndarray, inv_freq: Array, interleaved: bool) -> tuple[Array, Array]:
        """rmsnorm of each head of q and k [n, heads, hd] by q_norm / k_norm (skipped when None), then
        rope on both: what attention does to its queries and keys, which a backend may fuse."""
        if q_norm is not None:
            q, k = self.rmsnorm(q, q_norm, eps), self.rmsnorm(k, k_norm, eps)
        return self.rope(q, positions, inv_freq, interleaved), self.rope(k, positions, inv_freq, interleaved)

    @abstractmethod
    def kv_store(self, dtype: str, n_blocks: int, block_size: int, kv_heads: int, head_dim: int, *, keys: bool) -> Any:
        """One layer's K (keys=True) or V storage: n_blocks blocks of block_size rows [kv_heads,
        head_dim], held as `dtype` (f32, f16, bf16 or q8_0). A backend may lay K and V out
        differently (the CPU's K is transposed): paged_attention takes them in their places."""

    @abstractmethod
    def kv_write(self, store: Any, blocks: np.ndarray, offsets: np.ndarray, rows: Array) -> None:
        """Store rows [n, kv_heads, head_dim] at (blocks[i], offsets[i]), converting to the store's dtype."""

    @abstractmethod
    def paged_attention(self, q: Array, k: Any, v: Any, tables: np.ndarray, token_seq: np.ndarray,
                        positions: np.ndarray, scale: float, window: int = 0) -> Array:
        """Causal GQA attention of q [n, hq, hd] over paged K/V stores.

        Token i belongs to sequence token_seq[i], sits at positions[i] and sees that sequence's keys
        0..positions[i], located through tables[token_seq[i]] (block ids, one per block_size positions);
        with window > 0 (a sliding-window layer) only the last `window` of them,
        positions[i] - window + 1 .. positions[i]. Returns [n, hq, hd].
        """

    def sigmoid_mul(self, x: Array, gate: Array) -> Array:
        """x * sigmoid(gate), elementwise (gated attention's output gate). Default: the numpy reference."""
        from ember.kernels.reference.dense import sigmoid_mul

        return self.to_device(sigmoid_mul(self.to_numpy(x), self.to_numpy(gate)))

    def softplus_gate(self, x: Array, gate: Array) -> Array:
        """x [n, heads, hd] times softplus(gate) (log(1 + e^g), g itself past 20), one value a head
        (gate [n, heads]) or an element (gate [n, heads * hd]): laguna's attention output gate.
        Default: the numpy reference."""
        from ember.kernels.reference.dense import softplus_gate

        return self.to_device(softplus_gate(self.to_numpy(x), self.to_numpy(gate)))

    # --- linear attention (hybrid models) ---------------------------------------------------------
    # A step's tokens come from several sequences, each a contiguous run from seq_starts[s] to
    # seq_starts[s + 1]; sequence s keeps its recurrent state at index state_slots[s] of a layer's
    # state array (ops.zeros), which these ops update in place. A run whose first position is 0 starts
    # from a zero state. The defaults run the numpy references on the host: correct everywhere, slow.
    def causal_conv1d(self, x: Array, w: Array, states: Array, seq_starts: Array, state_slots: Array,
                      positions: Array) -> Array:
        """silu of the depthwise causal conv1d of x [n, C] by w [C, K], each run continuing from its
        window states[slot] [K-1, C] (the inputs before it, oldest first), which it then advances."""
        from ember.kernels.reference.linear_attention import causal_conv1d

        host, xs, out = self.to_numpy(states), self.to_numpy(x), np.empty(x.shape, np.float32)
        for s, (first, last) in enumerate(_runs(self.to_numpy(seq_starts))):
            slot = int(self.to_numpy(state_slots)[s])
            window = 0 * host[slot] if int(self.to_numpy(positions)[first]) == 0 else host[slot]
            out[first:last], host[slot] = causal_conv1d(xs[first:last], self.to_numpy(w), window)
        self._store_back(states, host)
        return self.to_device(out)

    def gated_delta_net(self, qkv: Array, a: Array, b: Array, A: Array, dt_bias: Array, states: Array,
                        seq_starts: Array, state_slots: Array, positions: Array, k_heads: int, k_dim: int,
                        tiled: bool) -> Array:
        """The gated delta rule over each run. qkv [n, C] holds q and k [k_heads, k_dim] and v
        [v_heads, v_dim] (after the conv); a, b [n, v_heads] give the decay A * softplus(a + dt_bias)
        and the write strength sigmoid(b); states [slots, v_heads, k_dim, v_dim]. Value head j reads key
        head j % k_heads if `tiled` (llama.cpp's GGUF order), else j // (v_heads / k_heads) (Hugging
        Face's). q and k are L2-normalised and q scaled by k_dim^-1/2 here. Returns [n, v_heads, v_dim]."""
        from ember.kernels.reference import linear_attention as ref

        host, xs = self.to_numpy(states), self.to_numpy(qkv)
        v_heads, v_dim = host.shape[1], host.shape[3]
        out = np.empty((xs.shape[0], v_heads, v_dim), np.float32)
        key = k_heads * k_dim
        for s, (first, last) in enumerate(_runs(self.to_numpy(seq_starts))):
            slot = int(self.to_numpy(state_slots)[s])
            run = xs[first:last]
            q, k = ref.normalize_qk(ref.expand_heads(run[:, :key].reshape(-1, k_heads, k_dim), v_heads, tiled),
                                    ref.expand_heads(run[:, key: 2 * key].reshape(-1, k_heads, k_dim), v_heads, tiled))
            g, beta = ref.gates(self.to_numpy(a)[first:last], self.to_numpy(b)[first:last], self.to_numpy(A),
                                self.to_numpy(dt_bias))
            state = 0 * host[slot] if int(self.to_numpy(positions)[first]) == 0 else host[slot]
            out[first:last], host[slot] = ref.delta_rule_chunked(q, k, run[:, 2 * key:].reshape(-1, v_heads, v_dim),
                                                                 g, beta, state)
        self._store_back(states, host)
        return self.to_device(out)

    def _store_back(self, device_array: Array, host: np.ndarray) -> None:
        if host is not device_array:
            device_array[...] = self.to_device(host)

    @abstractmethod
    def swiglu(self, gate: Array, up: Array) -> Array:
        """silu(gate) * up, elementwise."""

    def geglu(self, gate: Array, up: Array) -> Array:
        """gelu_tanh(gate) * up, elementwise. Default: the numpy reference."""
        from ember.kernels.reference.dense import geglu

        return self.to_device(geglu(self.to_numpy(gate), self.to_numpy(up)))

    def softcap(self, x: Array, cap: float) -> Array:
        """cap * tanh(x / cap), elementwise (gemma4's final logits). Default: the numpy reference."""
        from ember.kernels.reference.dense import softcap

        return self.to_device(softcap(self.to_numpy(x), cap))

    @abstractmethod
    def softmax(self, x: Array) -> Array:
        """Softmax over the last axis."""

    @abstractmethod
    def argmax_rows(self, x: Array, rows: np.ndarray) -> Array:
        """The index of the largest value of each of x's `rows` (x is [n, vocab]): greedy sampling
        where the logits are, so only token ids leave the device."""

    def sample_rows(self, logits: Array, batch: SamplingBatch) -> list[Choice | str]:
        """The full sampler (kernels/sampling.py) on the batch's rows of logits [n, vocab]: a Choice per
        row, or why its sampling failed. This default brings the logits to the host; a backend may
        sample where they are, from the same arrays (the batch's uniform numbers are each request's
        draws), so a seeded request gives the same tokens on every device."""
        return sample_batch(self.to_numpy(logits), batch)

    # --- moving data ----------------------------------------------------------------------------
    @abstractmethod
    def to_device(self, x: np.ndarray) -> Array:
        """A host array (a step's token ids, positions, block tables) where the kernels read it."""

    @abstractmethod
    def zeros(self, shape: tuple[int, ...]) -> Array: ...

    @abstractmethod
    def to_numpy(self, x: Array) -> np.ndarray: ...


def _runs(seq_starts: np.ndarray) -> list[tuple[int, int]]:
    return [(int(seq_starts[s]), int(seq_starts[s + 1])) for s in range(len(seq_starts) - 1)]
