"""The decoder-only transformer shared by every supported architecture, written against the ops API.

Per-architecture differences come in as an ArchSpec (architectures.py); the feed-forward part is its
own object, and a block whose file has a router (blk.N.ffn_gate_inp) gets a MoEFFN
(daemon/experts/) in its place. The token mixer is attention, or in hybrid models (qwen35) Gated
DeltaNet linear attention on most layers (linear_attention.py). A Transformer may hold a range of the
model's layers only (a stage of a layer split, runner/split_runner.py): it then loads only their
weights, the embedding if it runs the first layer and the output head if it runs the last, and its
forward pass is cut in three — `embed`, `run_layers`, `head` — that the whole model runs in a row.
The layers run through the backend's layer stack (ops.compile_stack, kernels/layer_stack.py): it
compiles the standard ones where it can and runs the rest, and any step they do not suit, through
these blocks op by op; the model itself has no backend paths. The whole model also runs greedy
decode bursts in one backend call where the backend has one (`greedy_steps`: every step's
embedding, layers, head and argmax).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ember.daemon.experts.expert_manager import ExpertManager, ExpertOptions
from ember.daemon.experts.moe_ffn import MoEFFN, expert_files, load_moe_ffn
from ember.daemon.experts.shared_expert import SharedExpertMoE, has_shared_expert, with_shared_expert
from ember.daemon.models.kv_cache import PagedKVCache
from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.loader.model_file import ModelFile
from ember.daemon.loader.model_file_error import ModelFileError
from ember.daemon.models.architectures import ArchSpec, architecture
from ember.daemon.models.gemma4 import Gemma4Block, load_gemma4_block, load_per_layer_embedding, ones
from ember.daemon.models.linear_attention import GatedDeltaNet, load_gated_delta_net
from ember.daemon.models.recurrent_state import RecurrentState
from ember.daemon.step.step_batch import StepBatch
from ember.daemon.step.window_ring import ring_for
from ember.kernels.layer_stack import StackLayer
from ember.kernels.ops import (Array, LayerShape, LayerWeights, Ops, SandwichModel, SandwichShape, SandwichWeights,
                               Weight)
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.tensor_types import TensorType


@dataclass
class Rope:
    inv_freq: Array
    interleaved: bool  # adjacent rotary pairs (llama GGUF) rather than halves (see Ops.rope)

    @classmethod
    def of(cls, ops: Ops, inv_freq: np.ndarray, interleaved: bool) -> Rope:
        return cls(ops.vector(RawTensor("rope.inv_freq", TensorType.F32, inv_freq.shape, inv_freq)), interleaved)


@dataclass
class Attention:
    wq: Weight
    wk: Weight
    wv: Weight
    wo: Weight
    bq: Array | None
    bk: Array | None
    bv: Array | None
    q_norm: Array | None
    k_norm: Array | None
    kv_layer: int  # which of the KV cache's layers is this one's
    rope: Rope
    n_heads: int  # query heads (laguna's differ between layers)
    window: int = 0  # a sliding-window layer's keys back from each token, itself included (0: all)
    gated: bool = False  # qwen35: wq also gives an output gate per head, [q | gate] per head
    # laguna: the output scaled by softplus(x . out_gate), one value per head ([heads, hidden]) or
    # per element ([heads * head_dim, hidden])
    out_gate: Weight | None = None
    scale: float = 0.0  # the scores' scale (0: head_dim^-1/2)
    bo: Array | None = None  # the output projection's bias (laguna's attention_bias)
    # gemma4: a layer's own head_dim and KV heads (0: the model's), its values RMS-normed unscaled
    # (v_norm, ones), wv None where they are the keys' projection (k_eq_v), and wk None too on a
    # KV-shared layer, which reads kv_layer's keys and values and writes none
    head_dim: int = 0
    kv_heads: int = 0
    v_norm: Array | None = None

    def __call__(self, ops: Ops, cfg: ModelConfig, x: Array, cache: PagedKVCache, batch: StepBatch) -> Array:
        n, rows, heads, hd = x.shape[0], batch.decode_rows, self.n_heads, self.head_dim or cfg.head_dim
        q, gate = self._queries(ops, cfg, x, cache, batch)
        seen = batch.positions if batch.attn_end is None else batch.attn_end  # causal unless told otherwise
        tables = batch.window_tables if cache.windowed[self.kv_layer] else batch.tables
        out = ops.paged_attention(q, cache.k[self.kv_layer], cache.v[self.kv_layer], tables, batch.token_seq,
                                  seen, self.scale or hd**-0.5, self.window).reshape(n, heads * hd)
        if gate is not None:
            out = ops.sigmoid_mul(out, gate)
        if self.out_gate is not None:
            out = ops.softplus_gate(out.reshape(n, heads, hd), ops.matmul(x, self.out_gate, rows)).reshape(n, heads * hd)
        out = ops.matmul(out, self.wo, rows)
        return out if self.bo is None else out + self.bo

    def _queries(self, ops: Ops, cfg: ModelConfig, x: Array, cache: PagedKVCache, batch: StepBatch
                 ) -> tuple[Array, Array | None]:
        """The step's queries [n, heads, hd], normed and rotated, and a gated layer's output gates;
        this layer's keys and values written to the cache on the way (none on a KV-shared layer)."""
        n, rows, heads, hd = x.shape[0], batch.decode_rows, self.n_heads, self.head_dim or cfg.head_dim
        if self.wk is None:
            q = ops.rmsnorm(ops.matmul(x, self.wq, rows).reshape(n, heads, hd), self.q_norm, cfg.norm_eps)
            return ops.rope(q, batch.positions, self.rope.inv_freq, self.rope.interleaved), None
        if self.wv is None:
            q, k = ops.matmul_many(x, (self.wq, self.wk), rows)
            v = k
        else:
            q, k, v = ops.matmul_many(x, (self.wq, self.wk, self.wv), rows)
        if self.bq is not None:
            q, k, v = q + self.bq, k + self.bk, v + self.bv
        gate = None
        if self.gated:
            both = q.reshape(n, heads, 2, hd)
            q, gate = both[:, :, 0], both[:, :, 1].reshape(n, heads * hd)
        kv_heads = self.kv_heads or cfg.n_kv_heads
        k, v = k.reshape(n, kv_heads, hd), v.reshape(n, kv_heads, hd)
        if self.v_norm is not None:  # a new array: v no longer shares k's, which qk_norm_rope may change in place
            v = ops.rmsnorm(v, self.v_norm, cfg.norm_eps)
        q, k = ops.qk_norm_rope(q.reshape(n, heads, hd), k, self.q_norm, self.k_norm, cfg.norm_eps, batch.positions,
                                self.rope.inv_freq, self.rope.interleaved)
        blocks = batch.window_blocks if cache.windowed[self.kv_layer] else batch.kv_blocks
        cache.write(self.kv_layer, blocks, batch.kv_offsets, k, v)
        return q, gate


@dataclass
class DenseFFN:
    gate: Weight
    up: Weight
    down: Weight
    gelu: bool = False  # GELU-tanh gating (gemma4) rather than SiLU

    def __call__(self, ops: Ops, x: Array, rows: Array) -> Array:
        gated = (ops.geglu_matmul if self.gelu else ops.swiglu_matmul)(x, self.gate, self.up, rows)
        return ops.matmul(gated, self.down, rows)


@dataclass
class Block:
    attn_norm: Array
    attn: Attention | GatedDeltaNet
    ffn_norm: Array
    ffn: DenseFFN | MoEFFN | SharedExpertMoE

    def __call__(self, ops: Ops, cfg: ModelConfig, x: Array, cache: PagedKVCache, batch: StepBatch) -> Array:
        return self.finish(ops, cfg, x + self._mix(ops, cfg, ops.rmsnorm(x, self.attn_norm, cfg.norm_eps), cache,
                                                   batch), batch)

    def finish(self, ops: Ops, cfg: ModelConfig, h: Array, batch: StepBatch) -> Array:
        """The layer after its mixer's residual: h + ffn(rmsnorm(h))."""
        return h + self.ffn(ops, ops.rmsnorm(h, self.ffn_norm, cfg.norm_eps), batch.decode_rows)

    def _mix(self, ops: Ops, cfg: ModelConfig, h: Array, cache: PagedKVCache, batch: StepBatch) -> Array:
        # a call of its own, so the normed input is freed before the FFN runs
        return self.attn(ops, cfg, h, cache, batch)


class Transformer:
    def __init__(self, mf: ModelFile, ops: Ops, layers: range | None = None, experts: ExpertOptions | None = None,
                 on_layer: Callable[[int, int], None] | None = None) -> None:
        """The model's layers `layers` (default: all of them) on `ops`' device; a MoE model's experts
        placed by `experts` (default: every expert hot); on_layer(layers placed, layers in all) as
        each is (a GPU's upload takes a while: its progress)."""
        self.ops, self.config = ops, mf.config
        self.layers = range(mf.config.n_layers) if layers is None else layers
        if not 0 <= self.layers.start < self.layers.stop <= mf.config.n_layers or self.layers.step != 1:
            raise ValueError(f"layers {self.layers.start}-{self.layers.stop - 1} are not a range of the model's "
                             f"{mf.config.n_layers} layers")
        spec = architecture(mf.config.arch, str(mf.path))
        self.experts = _expert_manager(mf, experts or ExpertOptions(), ops.prompt_act)
        tied = "output.weight" not in mf.tensors
        embed = self.runs_first or (self.runs_last and tied)
        self.embed = ops.weight(mf.tensor("token_embd.weight")) if embed else None
        self.per_layer = load_per_layer_embedding(mf, ops) if self.runs_first else None  # gemma4's PLE
        factors = mf.tensors.get("rope_freqs.weight")
        rope = Rope.of(ops, mf.config.inv_freq(None if factors is None else ops.to_numpy(ops.vector(factors))),
                       mf.rope_interleaved)
        sliding = Rope.of(ops, mf.config.inv_freq(sliding=True), mf.rope_interleaved) if mf.config.sliding_window else None
        self.blocks = []
        for i in self.layers:
            self.blocks.append(load_block(mf, ops, spec, i, self.layers.start, self.experts, rope, sliding))
            if on_layer is not None:
                on_layer(len(self.blocks), len(self.layers))
        # the layers as the backend runs them: compiled where it can, these blocks op by op where not
        self.stack = ops.compile_stack([stack_layer(b, ops, mf.config) for b in self.blocks])
        self.norm = _norm(mf, ops, "output_norm.weight") if self.runs_last else None
        # tied embeddings: the output projection is the embedding matrix, shared, not loaded twice
        self.output = None if not self.runs_last else self.embed if tied else ops.weight(mf.tensors["output.weight"])
        # per KV cache, the backend's greedy decode step over it (ops.greedy_plan; None: it has none), with
        # the routed FFNs it was made with
        self._greedy_plans: weakref.WeakKeyDictionary[PagedKVCache, Any] = weakref.WeakKeyDictionary()

    @property
    def runs_first(self) -> bool:
        return self.layers.start == 0

    @property
    def runs_last(self) -> bool:
        return self.layers.stop == self.config.n_layers

    @property
    def stateful(self) -> bool:
        """Whether sequences carry recurrent state beside their KV blocks (hybrid models)."""
        return self.config.linear is not None

    def new_cache(self, n_blocks: int, block_size: int = 16, dtype: str = "f32", max_sequences: int = 64,
                  step_tokens: int = 0) -> PagedKVCache:
        """A KV cache for the attention layers this object holds (cache layer 0 is the first of them);
        for a hybrid model also the recurrent state of `max_sequences` sequences (slots 0 ..
        max_sequences - 1). The whole model only: a layer split of a hybrid is refused (Pipeline).
        step_tokens > 0: positions a sequence runs in one step at most; sliding-window layers then
        keep only their window, in a ring per sequence slot (step/window_ring.ring_for)."""
        c = self.config
        state = RecurrentState(self.ops, c.linear, max_sequences) if c.linear else None
        owners = [i for i in self.layers if c.owns_kv(i)]
        shapes = [(c.kv_heads(i), c.head_dim_at(i)) for i in owners]
        ring = ring_for(c, n_blocks, block_size, max_sequences, step_tokens)
        return PagedKVCache(self.ops, len(shapes), c.n_kv_heads, c.head_dim, n_blocks, block_size, dtype, state,
                            shapes, [c.window(i) > 0 for i in owners], ring, max_sequences)

    def forward(self, batch: StepBatch, cache: PagedKVCache) -> Array:
        """Run one step's tokens (from any number of sequences) through the model, writing their K/V
        into `cache`. Returns logits [len(batch.logit_rows), vocab]."""
        # the stack takes the embedding itself: no frame of ours keeps it alive through the layers
        batch = self.prepared(batch, cache)
        return self.head(self.stack.run(self.embed_tokens(batch), batch, cache), batch)

    def embed_tokens(self, batch: StepBatch) -> Array:
        """The hidden states [n, hidden] the first layer reads."""
        if not self.runs_first:
            raise ValueError(f"layers {self.layers.start}-{self.layers.stop - 1} do not start the model: no embedding here")
        x = self.ops.embedding(self.embed, batch.ids)
        return x if self.config.embed_scale == 1.0 else x * self.config.embed_scale

    def prepared(self, batch: StepBatch, cache: PagedKVCache) -> StepBatch:
        """The batch with what this model's layers read beside it: gemma4's per-layer inputs
        (StepBatch.layer_inputs), and where the cache keeps windows in rings, their tables and blocks."""
        if self.per_layer is not None and batch.layer_inputs is None:
            batch = replace(batch, layer_inputs=self.per_layer(self.ops, self.config, self.embed_tokens(batch),
                                                               batch.ids, batch.decode_rows))
        return self._ringed(batch, cache)

    def _ringed(self, batch: StepBatch, cache: PagedKVCache) -> StepBatch:
        """The batch with the rings' tables and blocks where the cache keeps windows in rings."""
        if cache.ring and batch.window_tables is None:
            ops, slots = self.ops, self.ops.to_numpy(batch.state_slots).astype(np.int64)
            logical = ops.to_numpy(batch.positions) // cache.block_size
            blocks = slots[ops.to_numpy(batch.token_seq)] * cache.ring + logical % cache.ring
            batch = replace(batch, window_tables=ops.to_device(cache.ring_tables(slots, batch.tables.shape[1])),
                            window_blocks=ops.to_device(blocks))
        return batch

    def forward_with_features(self, batch: StepBatch, cache: PagedKVCache, layers: Sequence[int]
                              ) -> tuple[Array, list[Array]]:
        """forward(), and the hidden states entering each of `layers` (model layer indices; n_layers
        is the last layer's output), every row: f32 [n, hidden] each — llama.cpp's layer inputs (the
        un-normed residual stream), which a DFlash draft reads (its target_layers)."""
        taps: dict[int, Array] = {}

        def tap(i: int, x: Array) -> None:
            if self.layers.start + i in layers:
                taps[self.layers.start + i] = x  # a layer returns a new array: this one stays as it is

        batch = self.prepared(batch, cache)
        x = self.stack.run(self.embed_tokens(batch), batch, cache, tap)
        taps[self.layers.stop] = x
        return self.head(x, batch), [taps[i] for i in layers]

    def run_layers(self, x: Array, batch: StepBatch, cache: PagedKVCache) -> Array:
        """Hidden states through this object's layers (f32 in, f32 out), writing their K/V into `cache`."""
        return self.stack.run(x, batch, cache)

    def greedy_steps(self, batch: StepBatch, cache: PagedKVCache, steps: int, stops: np.ndarray) -> np.ndarray | None:
        """Up to `steps` decode steps from `batch` (one generated token a sequence, each row's logits
        wanted, in order), each row's next token its logits' argmax and the next step's input, until
        every row has met one of its stop ids (stops [n, m], -1 pads) -> host tokens [steps taken, n],
        those forward() and argmax would give step by step; None, having done nothing, where the
        backend has no compiled form of the whole step (ops.greedy_plan) or the batch is not such a step."""
        plan = self._greedy_plan(batch, cache)
        if plan is None:
            return None
        # the rings' tables (the burst computes each step's per-layer inputs itself)
        return self.ops.greedy_burst(plan, steps, self._ringed(batch, cache), cache.block_size, stops)

    def lookup_steps(self, batch: StepBatch, cache: PagedKVCache, budget: int, k: int, min_n: int, max_n: int,
                     history: np.ndarray, length: int, stops: np.ndarray) -> tuple[np.ndarray, int, int, int] | None:
        """Greedy steps of the one sequence of `batch` (a decode step) with n-gram proposals from
        history[:length] verified in the same compiled loop, up to `budget` tokens or a stop id (stops
        [m]) -> (tokens, rounds, proposed, accepted): the tokens greedy_steps would give; None, having
        done nothing, where the backend has no such loop (ops.lookup_burst) or the batch is not a step
        it takes."""
        plan = self._greedy_plan(batch, cache) if len(batch.ids) == 1 else None
        if plan is None:
            return None
        return self.ops.lookup_burst(plan, budget, k, min_n, max_n, history, length, batch, cache.block_size, stops)

    def _greedy_plan(self, batch: StepBatch, cache: PagedKVCache) -> Any:
        """The backend's compiled form of this model's greedy decode step over `cache` (ops.greedy_plan,
        kept per cache until a MoE layer's experts move), where `batch` is a step it takes (every row a
        generated token whose logits are wanted, in order); else None."""
        n = len(batch.ids)
        if (not (self.runs_first and self.runs_last) or batch.attn_end is not None
                or len(batch.logit_rows) != n or not np.array_equal(batch.logit_rows, np.arange(n))
                or not np.all(batch.decode_rows)):
            return None
        routed = self.stack.routed_now()  # a MoE layer's compiled FFN changes as its experts are swapped
        if routed is None:
            return None
        known = self._greedy_plans.get(cache)
        if known is None or len(known[0]) != len(routed) or any(a is not b for a, b in zip(known[0], routed)):
            known = (routed, self.ops.greedy_plan(self.stack, self.embed, self.norm, self.config.norm_eps, self.output,
                                                  cache.k, cache.v, routed, self._sandwich(cache)))
            self._greedy_plans[cache] = known
        return known[1]

    def _sandwich(self, cache: PagedKVCache) -> SandwichModel | None:
        """What a Gemma 4 step adds around its layers, for the backend's greedy step (None: another model)."""
        if self.config.arch != "gemma4":
            return None
        c, extra = self.config, self.per_layer
        return SandwichModel(c.embed_scale, c.logit_softcap, *((extra.table, extra.proj, extra.norm) if extra else (None,) * 3),
                             cache.ring > 0)

    def run_stage(self, hidden: np.ndarray | None, batch: StepBatch, cache: PagedKVCache) -> np.ndarray:
        """A layer split's stage on a step (`batch` already on this model's device): the token ids
        embedded (`hidden` None: the first stage) or the stage before's hidden states (f32, widened
        before the first norm of this stage's first layer), these layers, and the head where they end
        the model -> the logits rows, else the hidden states, on the host."""
        x = self.embed_tokens(batch) if hidden is None else self.ops.to_device(hidden)
        x = self.run_layers(x, batch, cache)
        return self.ops.to_numpy(self.head(x, batch) if self.runs_last else x)

    def head(self, x: Array, batch: StepBatch) -> Array:
        """The final norm and output projection of the rows whose logits are wanted -> [n_logits, vocab]."""
        if not self.runs_last:
            raise ValueError(f"layers {self.layers.start}-{self.layers.stop - 1} do not end the model: no output head here")
        if batch.n_logits == 0:  # prompt chunks only: their K/V is all this step produces
            return self.ops.zeros((0, self.config.vocab))
        x = x[batch.logit_rows]
        logits = self.ops.matmul(self.ops.rmsnorm(x, self.norm, self.config.norm_eps), self.output,
                                 batch.decode_rows[batch.logit_rows])
        return self.ops.softcap(logits, self.config.logit_softcap) if self.config.logit_softcap else logits


def _expert_manager(mf: ModelFile, options: ExpertOptions, prompt_act: str) -> ExpertManager | None:
    moe = [mf.is_moe_layer(i) for i in range(mf.config.n_layers)]
    if not any(moe):
        return None
    if mf.config.n_experts_used < 1 or mf.config.n_experts < mf.config.n_experts_used:
        raise ModelFileError(str(mf.path), f"MoE model routes to {mf.config.n_experts_used} of "
                                           f"{mf.config.n_experts} experts per token")
    sizes = [expert_files(mf, i)[0].nbytes if is_moe else 0 for i, is_moe in enumerate(moe)]
    return ExpertManager(mf.path, mf.config.hidden, mf.config.n_experts_used, sizes, mf.config.n_experts, options,
                         prompt_act)


def load_block(mf: ModelFile, ops: Ops, spec: ArchSpec, i: int, first: int, experts: ExpertManager | None, rope: Rope,
               sliding_rope: Rope | None = None) -> Block | Gemma4Block:
    """Layer i of a Transformer whose first layer is `first` (its cache's layers count from there),
    rotating by `rope`, or by `sliding_rope` if it is a sliding-window layer."""
    def w(name: str) -> Weight:
        return ops.weight(mf.tensor(f"blk.{i}.{name}.weight"))

    def vec(name: str) -> Array:
        return ops.vector(mf.tensor(f"blk.{i}.{name}"))

    cfg = mf.config
    if cfg.arch == "gemma4":
        return _gemma4_block(mf, ops, i, first, experts, rope, sliding_rope)
    if experts is not None and mf.is_moe_layer(i):
        ffn: DenseFFN | MoEFFN | SharedExpertMoE = load_moe_ffn(mf, ops, i, experts)
        if has_shared_expert(mf, i):  # qwen35moe, laguna
            ffn = with_shared_expert(mf, ops, i, ffn)
    else:
        ffn = DenseFFN(gate=w("ffn_gate"), up=w("ffn_up"), down=w("ffn_down"))
    lin = cfg.linear
    if lin is not None:  # a hybrid: its mixer is linear or gated attention, post_attention_norm before the FFN
        linear_before = sum(lin.recurrent[first:i])
        mixer = (load_gated_delta_net(mf, ops, i, linear_before) if lin.recurrent[i] else
                 _rope_factor(mf, ops, Attention(
                     wq=w("attn_q"), wk=w("attn_k"), wv=w("attn_v"), wo=w("attn_output"), bq=None, bk=None, bv=None,
                     q_norm=_norm(mf, ops, f"blk.{i}.attn_q_norm.weight"),
                     k_norm=_norm(mf, ops, f"blk.{i}.attn_k_norm.weight"), kv_layer=i - first - linear_before,
                     rope=rope, n_heads=cfg.heads(i), gated=True)))
        return Block(_norm(mf, ops, f"blk.{i}.attn_norm.weight"), mixer,
                     _norm(mf, ops, f"blk.{i}.post_attention_norm.weight"), ffn)
    window = cfg.window(i)
    # qwen2's biases, and any other architecture's where its file has them (laguna's attention_bias)
    biased = spec.qkv_bias or f"blk.{i}.attn_q.bias" in mf.tensors
    attn = Attention(
        wq=w("attn_q"), wk=w("attn_k"), wv=w("attn_v"), wo=w("attn_output"),
        bq=vec("attn_q.bias") if biased else None,
        bk=vec("attn_k.bias") if biased else None,
        bv=vec("attn_v.bias") if biased else None,
        q_norm=vec("attn_q_norm.weight") if spec.qk_norm else None,
        k_norm=vec("attn_k_norm.weight") if spec.qk_norm else None,
        kv_layer=i - first,
        rope=sliding_rope if window and sliding_rope is not None else rope,
        n_heads=cfg.heads(i),
        window=window,
        out_gate=w("attn_gate") if spec.output_gate else None,
        bo=vec("attn_output.bias") if f"blk.{i}.attn_output.bias" in mf.tensors else None,
    )
    return Block(vec("attn_norm.weight"), _rope_factor(mf, ops, attn), vec("ffn_norm.weight"), ffn)


def _gemma4_block(mf: ModelFile, ops: Ops, i: int, first: int, experts: ExpertManager | None, rope: Rope,
                  sliding_rope: Rope | None) -> Gemma4Block:
    """Gemma 4's layer i (gemma4.py): its attention shares an earlier layer's K/V past the model's
    first KV-shared layer, and takes its values from its keys' projection where it has no attn_v."""
    def w(name: str) -> Weight:
        return ops.weight(mf.tensor(f"blk.{i}.{name}.weight"))

    cfg, source = mf.config, mf.config.kv_source(i)
    own, window, head_dim = source == i, cfg.window(i), cfg.head_dim_at(i)
    attn = Attention(
        wq=w("attn_q"), wk=w("attn_k") if own else None,
        # attention_k_eq_v: no attn_v, the values are the keys' projection (normed apart), as llama.cpp reads it
        wv=w("attn_v") if own and f"blk.{i}.attn_v.weight" in mf.tensors else None, wo=w("attn_output"),
        bq=None, bk=None, bv=None, q_norm=_norm(mf, ops, f"blk.{i}.attn_q_norm.weight"),
        k_norm=_norm(mf, ops, f"blk.{i}.attn_k_norm.weight") if own else None,
        kv_layer=sum(cfg.owns_kv(j) for j in range(first, source)),
        rope=sliding_rope if window and sliding_rope is not None else rope, n_heads=cfg.heads(i), window=window,
        scale=cfg.attn_scale, head_dim=head_dim, kv_heads=cfg.kv_heads(i), v_norm=ones(ops, head_dim) if own else None)
    return load_gemma4_block(mf, ops, i, attn, DenseFFN(w("ffn_gate"), w("ffn_up"), w("ffn_down"), gelu=True), experts)


def _rope_factor(mf: ModelFile, ops: Ops, attn: Attention) -> Attention:
    """The attention with yarn's factor m on cos and sin (ModelConfig.rope_attn_factor; sliding layers
    rotate unscaled): the rotated dimensions of q and k times m. Rope is linear and rotates pairs
    within them, so m goes into the q and k head norms' weights there; a model without head norms
    that rotates every dimension takes m^2 on its scores' scale instead."""
    cfg, m = mf.config, mf.config.rope_attn_factor
    if m == 1.0 or attn.window:
        return attn
    if attn.q_norm is not None and attn.k_norm is not None:
        factor = np.ones(cfg.head_dim, np.float32)
        factor[: cfg.rotary_dim] = m
        attn.q_norm = ops.to_device(ops.to_numpy(attn.q_norm) * factor)
        attn.k_norm = ops.to_device(ops.to_numpy(attn.k_norm) * factor)
    elif cfg.rotary_dim == cfg.head_dim:
        attn.scale = cfg.head_dim**-0.5 * m * m
    else:
        raise ModelFileError(str(mf.path), "yarn's attention factor on a partial rotary without q/k norms is not supported")
    return attn


def stack_layer(block: Block, ops: Ops, cfg: ModelConfig) -> StackLayer:
    """The block as the backend's layer stack takes it: its op-by-op run, and where it is a standard
    decoder layer (softmax attention, a laguna output gate and sliding window included) its weights,
    which the backend may compile — with the FFN where it is a dense one (a MoE layer's experts run
    as ops.expert_ffn after the compiled attention, or, while all are hot, as ops.fuse_routed's form)."""
    def run(x: Array, step: StepBatch, cache: PagedKVCache) -> Array:
        return block(ops, cfg, x, cache, step)

    if isinstance(block, Gemma4Block):
        return _sandwich_layer(block, run, cfg)
    attn = block.attn
    if not isinstance(attn, Attention) or attn.gated or attn.bo is not None:
        return StackLayer(run)
    ffn = block.ffn
    dense = isinstance(ffn, DenseFFN) and not ffn.gelu
    routed = None
    if isinstance(ffn, (MoEFFN, SharedExpertMoE)):
        def routed() -> Any | None:
            return ffn.compiled(ops, block.ffn_norm, cfg.norm_eps)

    weights = LayerWeights(block.attn_norm, attn.wq, attn.wk, attn.wv, attn.wo, attn.bq, attn.bk, attn.bv,
                           attn.q_norm, attn.k_norm, block.ffn_norm,
                           *((ffn.gate, ffn.up, ffn.down) if dense else (None,) * 3),  # type: ignore[union-attr]
                           attn.out_gate)
    shape = LayerShape(attn.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps, attn.rope.inv_freq,
                       attn.rope.interleaved, attn.window, attn.scale)
    return StackLayer(run, weights, shape, attn.kv_layer, lambda h, step: block.finish(ops, cfg, h, step), routed)


def _sandwich_layer(block: Gemma4Block, run: Callable[[Array, StepBatch, PagedKVCache], Array],
                    cfg: ModelConfig) -> StackLayer:
    """A Gemma 4 block as the layer stack takes it: with its weights where it is dense (a MoE
    block's experts beside its FFN always run op by op)."""
    if block.moe is not None:
        return StackLayer(run)
    attn, ffn, extra = block.attn, block.ffn, block.layer_input
    weights = SandwichWeights(block.attn_norm, attn.wq, attn.wk, attn.wv, attn.wo, attn.q_norm, attn.k_norm,
                              attn.v_norm, block.post_attn_norm, block.ffn_norm, ffn.gate, ffn.up, ffn.down,
                              block.post_ffn_norm, *((extra.gate, extra.proj, extra.norm) if extra else (None,) * 3))
    shape = SandwichShape(attn.n_heads, attn.kv_heads or cfg.n_kv_heads, attn.head_dim or cfg.head_dim, cfg.norm_eps,
                          attn.rope.inv_freq, attn.rope.interleaved, attn.window,
                          attn.scale or (attn.head_dim or cfg.head_dim)**-0.5, block.out_scale, block.index)
    return StackLayer(run, weights, shape, attn.kv_layer)


def _norm(mf: ModelFile, ops: Ops, name: str) -> Array:
    """An RMSNorm weight. qwen35 checkpoints store w - 1 (their norm multiplies by 1 + weight); llama.cpp's
    converter adds the 1, so GGUF files hold w itself."""
    w = ops.vector(mf.tensor(name))
    return w + 1.0 if mf.format == "hf" and mf.config.linear is not None else w
