"""How well a DFlash draft (dflash_torch.py) would do in greedy speculative decoding, measured in torch
against the frozen HF target: the target's greedy continuation of each prompt is the output speculation
must reproduce, so one forward of the target over it gives every context row, and the draft's block at
each anchor depends only on that prefix. All blocks are drafted in one batched pass; then the decode is
walked as the runtime runs it: at anchor p (the last verified token) the draft proposes block_size - 1
tokens, the leading ones equal to the target's are accepted, the target adds its own, and the next
anchor is p + accepted + 1. SpecStats counts it as the runtime does.

The captured rows can first be rounded through a feature-mirror dtype (f16, bf16, q8_0) with ember's
own conversions (kernels/convert.py), to see what each mirror dtype costs in acceptance.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ember.daemon.speculative.dflash_torch import DFlashDraft
from ember.daemon.speculative.spec_stats import SpecStats
from ember.kernels.convert import decode_rows, encode_rows


class FrozenTarget:
    """The HF target, frozen, with forward hooks on the layers whose outputs the draft reads."""

    def __init__(self, model: torch.nn.Module, layer_ids: tuple[int, ...]) -> None:
        self.model = model.eval().requires_grad_(False)
        self.layer_ids = layer_ids
        self._captured: dict[int, torch.Tensor] = {}
        for i in layer_ids:
            self.model.model.layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int):  # type: ignore[no-untyped-def]
        def keep(_module, _inputs, output) -> None:  # type: ignore[no-untyped-def]
            self._captured[i] = output[0] if isinstance(output, tuple) else output
        return keep

    @torch.no_grad()
    def run(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [b, s] -> (features [b, s, len(layer_ids) * hidden]: each layer's output, concatenated
        in layer_ids order; logits [b, s, vocab])."""
        logits = self.model(input_ids=ids).logits
        return torch.cat([self._captured[i] for i in self.layer_ids], -1), logits

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)

    @torch.no_grad()
    def greedy(self, prompt: list[int], n_new: int) -> list[int]:
        out = self.model.generate(torch.tensor([prompt]), max_new_tokens=n_new, min_new_tokens=n_new,
                                  do_sample=False, pad_token_id=0)
        return out[0].tolist()


def block_inputs(n_ctx: int, anchors: torch.Tensor, block_size: int, mask_token_id: int,
                 tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For anchors [b, n] into token rows [b, s]: the block token ids [b, n * block], their positions, and
    the attention mask [b, n * block, n_ctx + n * block] (a block sees the context rows before its
    anchor and its own rows, both ways; never another block)."""
    b, n = anchors.shape
    offsets = torch.arange(block_size)
    positions = (anchors[:, :, None] + offsets).reshape(b, n * block_size)
    ids = torch.full((b, n, block_size), mask_token_id, dtype=torch.long)
    ids[:, :, 0] = torch.gather(tokens, 1, anchors)
    q_anchor = anchors.repeat_interleave(block_size, 1)  # [b, q]
    q_block = torch.arange(n).repeat_interleave(block_size)
    ctx = torch.arange(n_ctx)[None, None, :] < q_anchor[:, :, None]
    own = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)
    return ids.reshape(b, n * block_size), positions, torch.cat([ctx, own], -1)


def round_features(features: torch.Tensor, dtype: str) -> torch.Tensor:
    """The rows as a feature mirror of `dtype` hands them back (f32 in, f32 out)."""
    if dtype == "f32":
        return features
    rows = features.detach().cpu().numpy().astype(np.float32)
    return torch.from_numpy(decode_rows(encode_rows(rows, dtype), dtype, rows.shape[-1]))


@torch.no_grad()
def draft_blocks(draft: DFlashDraft, target: FrozenTarget, tokens: list[int], first_anchor: int,
                 dtype: str = "f32") -> torch.Tensor:
    """The draft's greedy proposals [n_anchors, block_size - 1] at every anchor first_anchor .. end - 1."""
    c = draft.c
    ids = torch.tensor([tokens])
    features, _ = target.run(ids)
    features = round_features(features, dtype)
    anchors = torch.arange(first_anchor, len(tokens))[None]
    block_ids, block_pos, mask = block_inputs(len(tokens), anchors, c.block_size, c.mask_token_id, ids)
    ctx_pos = torch.arange(len(tokens))[None]
    hidden = draft(target.embed(block_ids), features, block_pos, ctx_pos, mask)
    guesses = target.lm_head(hidden).argmax(-1).view(anchors.shape[1], c.block_size)
    return guesses[:, 1:]


def walk(proposals: torch.Tensor, tokens: list[int], first_anchor: int) -> SpecStats:
    """Greedy speculative decoding of `tokens` from first_anchor on, with the draft's proposals at each
    anchor: what the runtime would count."""
    stats = SpecStats()
    p = first_anchor
    while p < len(tokens) - 1:
        k = min(proposals.shape[1], len(tokens) - 1 - p)
        guess = proposals[p - first_anchor, :k].tolist()
        accepted = next((i for i in range(k) if guess[i] != tokens[p + 1 + i]), k)
        stats.add(k, accepted)
        p += accepted + 1
    return stats


@dataclass(frozen=True)
class EvalSet:
    """Greedy target continuations of held-out prompts: (tokens, index of the first generated token)."""
    sequences: list[tuple[list[int], int]]

    @classmethod
    def build(cls, target: FrozenTarget, prompts: list[list[int]], n_new: int) -> "EvalSet":
        return cls([(target.greedy(p, n_new), len(p)) for p in prompts])

    def measure(self, draft: DFlashDraft, target: FrozenTarget, dtype: str = "f32") -> SpecStats:
        was_training = draft.training
        draft.eval()
        total = SpecStats()
        for tokens, start in self.sequences:
            # the first anchor is the first generated token: the runtime drafts from there on
            s = walk(draft_blocks(draft, target, tokens, start, dtype), tokens, start)
            total.proposed, total.accepted, total.steps = (total.proposed + s.proposed,
                                                           total.accepted + s.accepted, total.steps + s.steps)
        draft.train(was_training)
        return total
