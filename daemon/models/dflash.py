"""DFlashDraft: a feature-conditioned draft network (llama.cpp's `dflash` architecture,
src/models/dflash.cpp), written against the ops API like the Transformer, whose blocks it reuses.

Two passes, both over the draft's own paged KV cache (addressed by the target's block tables):
  inject  target features [n, len(target_layers) x hidden] -> g = enc_norm(fc x); per layer
          K = rope(k_norm(wk g)), V = wv g, written at the features' positions (dflash.cpp's embd
          batch: no attention, no layer feeds the next, so every layer reads the same g).
  block   a noise block [last verified token, mask, ..., mask] at positions n .. n + k: the decoder
          layers (attn_norm, attention with q/k norms, SwiGLU FFN) with attention that is NOT causal
          inside the block — every block token sees the injected context 0 .. n - 1 and the whole
          block (StepBatch.attn_end) — then the final norm and the output head.
The token embedding and output head are the file's own when it carries them, else the target's
(shared, not copied).
"""
from __future__ import annotations

import numpy as np

from ember.daemon.loader.model_file import ModelFile
from ember.daemon.loader.model_file_error import ModelFileError
from ember.daemon.models.architectures import ArchSpec
from ember.daemon.models.transformer import Attention, Block, Rope, Transformer, load_block
from ember.daemon.models.kv_cache import PagedKVCache
from ember.daemon.step.step_batch import StepBatch
from ember.daemon.loader.dflash_file import DFlashSpec, check_fits, read_dflash
from ember.kernels.ops import Array

_LAYER = ArchSpec(qk_norm=True)  # a DFlash layer is a Qwen3 layer


class DFlashDraft:
    def __init__(self, mf: ModelFile, target: Transformer) -> None:
        """The draft in `mf` on the target's device, sharing the target's embedding and output head
        where the file has none. Refuses a draft that does not fit the target (dflash_file.check_fits)."""
        self.spec: DFlashSpec = read_dflash(mf)
        check_fits(self.spec, mf.config, target.config, str(mf.path))
        if target.embed is None or target.output is None:
            raise ValueError("a DFlash draft needs the whole target model on one device (its embedding and head)")
        ops = self.ops = target.ops
        self.config = cfg = mf.config
        self.width = len(self.spec.target_layers) * target.config.hidden
        fc = mf.tensor("fc.weight")
        if tuple(fc.shape) != (cfg.hidden, self.width):
            raise ModelFileError(str(mf.path), f"fc.weight has shape {list(fc.shape)}, not [{cfg.hidden}, {self.width}] "
                                 f"({len(self.spec.target_layers)} target layers x hidden {target.config.hidden})")
        self.fc = ops.weight(fc)
        self.enc_norm = ops.vector(mf.tensor("enc.output_norm.weight"))
        factors = mf.tensors.get("rope_freqs.weight")
        # llama.cpp ropes DFlash backbones NeoX-style: rotary halves, as the Hugging Face layout
        self.rope = Rope.of(ops, cfg.inv_freq(None if factors is None else ops.to_numpy(ops.vector(factors))), False)
        self.blocks: list[Block] = [load_block(mf, ops, _LAYER, i, 0, None, self.rope) for i in range(cfg.n_layers)]
        self.norm = ops.vector(mf.tensor("output_norm.weight"))
        self.embed = ops.weight(mf.tensors["token_embd.weight"]) if self.spec.own_embedding else target.embed
        self.output = (ops.weight(mf.tensors["output.weight"]) if self.spec.own_output
                       else self.embed if self.spec.own_embedding else target.output)

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.spec.target_layers

    def new_cache(self, n_blocks: int, block_size: int = 16, dtype: str = "f32") -> PagedKVCache:
        c = self.config
        return PagedKVCache(self.ops, c.n_layers, c.n_kv_heads, c.head_dim, n_blocks, block_size, dtype)

    def inject(self, features: Array, batch: StepBatch, cache: PagedKVCache) -> None:
        """Write the K/V of target features [n, width] (f32, on the device) at batch's positions and KV
        slots into `cache`: the context the noise blocks attend to."""
        ops, cfg, n = self.ops, self.config, features.shape[0]
        rows = batch.decode_rows
        g = ops.rmsnorm(ops.matmul(features, self.fc, rows), self.enc_norm, cfg.norm_eps)
        for block in self.blocks:
            attn: Attention = block.attn  # type: ignore[assignment]
            k, v = ops.matmul_many(g, (attn.wk, attn.wv), rows)
            k = ops.rmsnorm(k.reshape(n, cfg.n_kv_heads, cfg.head_dim), attn.k_norm, cfg.norm_eps)
            k = ops.rope(k, batch.positions, self.rope.inv_freq, self.rope.interleaved)
            cache.write(attn.kv_layer, batch.kv_blocks, batch.kv_offsets, k, v.reshape(n, cfg.n_kv_heads, cfg.head_dim))

    def block_logits(self, batch: StepBatch, cache: PagedKVCache) -> Array:
        """Logits [batch.n_logits, vocab] of noise blocks: batch holds each sequence's block as one
        chunk, with attn_end the block's last position for each of its tokens."""
        ops, cfg = self.ops, self.config
        x = ops.embedding(self.embed, batch.ids)
        if self.spec.embedding_scale:
            x = x * np.float32(self.spec.embedding_scale)
        for block in self.blocks:
            x = block(ops, cfg, x, cache, batch)
        if batch.n_logits == 0:
            return ops.zeros((0, cfg.vocab))
        x = x[batch.logit_rows]
        return ops.matmul(ops.rmsnorm(x, self.norm, cfg.norm_eps), self.output, batch.decode_rows[batch.logit_rows])
