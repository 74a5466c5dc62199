"""StepBatch: the tokens of one forward pass, from any number of sequences, and where their keys and
values live in the paged KV cache."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepBatch:
    ids: np.ndarray  # [n] token ids
    positions: np.ndarray  # [n] position of each token in its sequence
    token_seq: np.ndarray  # [n] which sequence (row of tables) each token belongs to
    slots: np.ndarray  # [n] where each token's K/V goes: block * block_size + offset
    tables: np.ndarray  # [sequences, max_blocks] int32 block ids (unused entries 0)
    logit_rows: np.ndarray  # indices of the tokens whose logits are wanted

    @classmethod
    def build(cls, chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]], block_size: int,
              all_logits: bool = False, wants_logits: Sequence[bool] | None = None) -> StepBatch:
        """chunks: (token ids, position of the first, the sequence's block table) per sequence.
        Logits come for the last token of each chunk (of those wants_logits marks, if given), or for
        every token when all_logits."""
        ids, positions, token_seq, slots, last = [], [], [], [], []
        width = max(len(table) for _, _, table in chunks)
        tables = np.zeros((len(chunks), width), np.int32)
        for s, (tokens, start, table) in enumerate(chunks):
            pos = np.arange(start, start + len(tokens))
            tables[s, : len(table)] = table
            ids.append(np.asarray(tokens, np.int64))
            positions.append(pos)
            token_seq.append(np.full(len(tokens), s, np.int32))
            slots.append(tables[s, pos // block_size].astype(np.int64) * block_size + pos % block_size)
            if wants_logits is None or wants_logits[s]:
                last.append(sum(len(t) for t, _, _ in chunks[: s + 1]) - 1)
        n = sum(len(t) for t, _, _ in chunks)
        return cls(
            ids=np.concatenate(ids), positions=np.concatenate(positions), token_seq=np.concatenate(token_seq),
            slots=np.concatenate(slots), tables=tables,
            logit_rows=np.arange(n) if all_logits else np.asarray(last, np.int64),
        )
