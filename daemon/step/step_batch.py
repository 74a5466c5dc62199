"""StepBatch: the tokens of one forward pass, from any number of sequences, and where their keys and
values live in the paged KV cache — built on the host by the engine, moved to the runner's device once
per step (`on`), then read by every layer."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

ChunkSpec = tuple[Sequence[int], int, Sequence[int]]  # (token ids, position of the first, block table)


@dataclass(frozen=True)
class StepBatch:
    ids: Any  # [n] token ids
    positions: Any  # [n] position of each token in its sequence
    token_seq: Any  # [n] which sequence (row of tables) each token belongs to
    kv_blocks: Any  # [n] the KV block each token's K/V goes to
    kv_offsets: Any  # [n] and the row inside that block
    tables: Any  # [sequences, max_blocks] int32 block ids (unused entries 0)
    logit_rows: Any  # indices of the tokens whose logits are wanted
    # [n] bool: the token was generated (a sampled token fed back), not read from the prompt. Backends
    # may compute these rows with quantized activations (ops.matmul): a token's numerics then follow
    # from what it is, never from how the step was batched or chunked.
    decode_rows: Any
    # hybrid models' recurrent state: sequence s's tokens are seq_starts[s] .. seq_starts[s + 1] - 1 and
    # its state sits at index state_slots[s] of each linear-attention layer's state array
    seq_starts: Any = None
    state_slots: Any = None
    # [n] the last position each token attends to; None: its own (causal). A DFlash draft's noise block
    # sees the whole block (daemon/models/dflash.py).
    attn_end: Any = None
    # gemma4's per-layer inputs [n, layers, P] (models/gemma4.py), which the model adds once it has
    # embedded the step's tokens
    layer_inputs: Any = None
    # sliding-window layers that keep their window in a ring per sequence (models/kv_cache.py): their
    # block tables and each token's block, which the model adds (Transformer.prepared)
    window_tables: Any = None
    window_blocks: Any = None

    @property
    def n_logits(self) -> int:
        return len(self.logit_rows)

    @property
    def attends_to(self) -> Any:
        """[n] the last position each token attends to: attn_end where given, else its own."""
        return self.positions if self.attn_end is None else self.attn_end

    @classmethod
    def build(cls, chunks: Sequence[ChunkSpec], block_size: int, all_logits: bool | Sequence[bool] = False,
              wants_logits: Sequence[bool] | None = None, prompt_lengths: Sequence[int] | None = None,
              state_slots: Sequence[int] | None = None, logit_tails: Sequence[int] | None = None) -> StepBatch:
        """Host arrays for `chunks`. Logits come for the last token of each chunk (of those
        `wants_logits` marks, if given); `all_logits` (for every chunk, or per chunk) asks for every
        token of a chunk instead; `logit_tails` (per chunk, overriding both) for its last n tokens
        (speculative verification: the last known token and every proposed one). prompt_lengths (per
        chunk) tells generated tokens from prompt ones: positions from a sequence's prompt length on
        are decode rows (without it, none is). state_slots (per chunk) places each sequence's
        recurrent state (default: the chunk's index)."""
        every = [all_logits] * len(chunks) if isinstance(all_logits, bool) else list(all_logits)
        prompts = np.fromiter((1 << 62,) * len(chunks) if prompt_lengths is None else prompt_lengths, np.int64,
                              len(chunks))
        if logit_tails is None and all(len(tokens) == 1 for tokens, _, _ in chunks):  # every token is its chunk's last
            wants = None if wants_logits is None else [w or a for w, a in zip(wants_logits, every, strict=True)]
            return cls._decodes(chunks, block_size, wants, prompts, _slots(state_slots, len(chunks)))
        ids, positions, token_seq, rows = [], [], [], []
        width = max(len(table) for _, _, table in chunks)
        tables = np.zeros((len(chunks), width), np.int32)
        n = 0
        for s, (tokens, start, table) in enumerate(chunks):
            tables[s, : len(table)] = table
            ids.append(np.asarray(tokens, np.int64))
            positions.append(np.arange(start, start + len(tokens)))
            token_seq.append(np.full(len(tokens), s, np.int32))
            if logit_tails is not None:
                rows.append(np.arange(n + len(tokens) - logit_tails[s], n + len(tokens)))
            elif every[s]:
                rows.append(np.arange(n, n + len(tokens)))
            elif wants_logits is None or wants_logits[s]:
                rows.append(np.array([n + len(tokens) - 1]))
            n += len(tokens)
        pos = np.concatenate(positions)
        seq = np.concatenate(token_seq)
        return cls(ids=np.concatenate(ids), positions=pos, token_seq=seq,
                   kv_blocks=tables[seq, pos // block_size].astype(np.int64), kv_offsets=pos % block_size,
                   tables=tables, logit_rows=np.concatenate(rows) if rows else np.zeros(0, np.int64),
                   decode_rows=pos >= prompts[seq],
                   seq_starts=np.concatenate([[0], np.cumsum([len(tokens) for tokens, _, _ in chunks])]).astype(np.int64),
                   state_slots=_slots(state_slots, len(chunks)))

    @classmethod
    def _decodes(cls, chunks: Sequence[ChunkSpec], block_size: int, wants_logits: Sequence[bool] | None,
                 prompts: np.ndarray, slots: np.ndarray) -> StepBatch:
        """The common decode step, one token per sequence: each field one array made from Python
        values (a numpy call costs microseconds; this step's fields once took 44 us on the demo's
        one-sequence decode, ~15% of its host time per token)."""
        n = len(chunks)
        starts = [start for _, start, _ in chunks]
        tables_in = [table for _, _, table in chunks]
        width = max(map(len, tables_in))
        if all(len(t) == width for t in tables_in):
            tables = np.array(tables_in, np.int32).reshape(n, width)
        else:
            tables = np.zeros((n, width), np.int32)
            for s, table in enumerate(tables_in):
                tables[s, : len(table)] = table
        pos = np.array(starts, np.int64)
        every = wants_logits is None or all(wants_logits)
        steps = np.arange(n + 1, dtype=np.int64)  # seq_starts; its first n are the rows and token_seq
        return cls(ids=np.array([tokens[0] for tokens, _, _ in chunks], np.int64), positions=pos,
                   token_seq=steps[:n].astype(np.int32),
                   kv_blocks=np.array([t[p // block_size] for t, p in zip(tables_in, starts, strict=True)], np.int64),
                   kv_offsets=np.array([p % block_size for p in starts], np.int64), tables=tables,
                   logit_rows=steps[:n] if every else np.flatnonzero(np.asarray(wants_logits, bool)),
                   decode_rows=pos >= prompts, seq_starts=steps, state_slots=slots)

    def following(self, ids: np.ndarray, block_size: int) -> StepBatch:
        """The next decode step of this batch's sequences: one token each (`ids`, generated ones), one
        position further on, in blocks their tables already hold. What a multi-step decode
        (executor/burst.py) runs after sampling from this batch, one logit row per sequence; a
        host batch only."""
        pos = self.positions + 1
        return StepBatch(ids=np.asarray(ids, np.int64), positions=pos, token_seq=self.token_seq,
                         kv_blocks=self.tables[self.token_seq, pos // block_size].astype(np.int64),
                         kv_offsets=pos % block_size, tables=self.tables, logit_rows=self.logit_rows,
                         decode_rows=np.ones(len(pos), bool), seq_starts=self.seq_starts, state_slots=self.state_slots)

    def on(self, ops: Any) -> StepBatch:
        """The same batch with every array moved by the runner's ops.to_device: done once per step, so
        no layer moves metadata again; this very batch where the kernels read host memory."""
        if ops.host_memory:
            return self
        return StepBatch(*(None if getattr(self, f) is None else ops.to_device(getattr(self, f))
                           for f in self.__dataclass_fields__))


def _slots(state_slots: Sequence[int] | None, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64) if state_slots is None else np.asarray(state_slots, np.int64)
