"""ModelRunner: one model on one device — its weights, its KV cache and what a step moves there.

The engine core hands it a host StepBatch and the sampling rows of the step; the runner moves the
batch's metadata to the device once (`prepare`), runs the model, and samples where the logits are.
Only token ids leave the device, and logits rows when a sequence asks for them: on a GPU the full
[tokens, vocab] logits never cross to the host. Everything device-specific lives behind the ops
API of the backend the runner was built with (runner/devices.py chooses it), so the engine, the
scheduler and the model code are the same for every device. A layer split (split_runner.py) is a
ModelRunner whose forward pass runs in stages elsewhere: sampling is this class's, on every path.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ember.daemon.models.transformer import Transformer
from ember.daemon.models.kv_cache import PagedKVCache
from ember.daemon.step.burst_blocks import BurstBlocks
from ember.daemon.step.row_sampling import RowSampling
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.convert import DECODE_ACTIVATIONS
from ember.kernels.ops import Array
from ember.kernels.sampling import Choice, SampleRow


@dataclass(frozen=True)
class StepRun:
    choices: list[Choice | None]  # one per sampling row, in order (None where sampling failed)
    kept: dict[int, np.ndarray]  # row index -> host logits, for the rows asked to be kept
    failed: dict[int, str] = field(default_factory=dict)  # sampler index -> why its sampling failed
    # the hidden states entering each layer of ModelRunner.capture, every row of the step (device arrays)
    features: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class PendingStep:
    work: Any  # the logits (this class), or what a pipelined runner collects them by
    n_logits: int
    samplers: list[tuple[int, RowSampling]]
    keep: list[int]
    features: list[Any] = field(default_factory=list)  # ModelRunner.capture's hidden states


class KVStateLost(RuntimeError):
    """The runner lost KV cache contents (a layer-split stage process died and was restarted empty):
    every sequence with keys and values in this runner must end, and no cached prefix may be reused."""


def check_decode_act(decode_act: str) -> None:
    if decode_act not in DECODE_ACTIVATIONS:
        raise ValueError(f"unknown decode activation precision {decode_act!r} (choose from {', '.join(DECODE_ACTIVATIONS)})")


class ModelRunner:
    def __init__(self, net: Transformer, kv_blocks: int, block_size: int = 16, kv_dtype: str = "f32",
                 decode_act: str = "q8_0", max_sequences: int = 64) -> None:
        """max_sequences: sequences running at once at most (a hybrid model's recurrent state slots)."""
        check_decode_act(decode_act)
        self.net = net
        self.ops = net.ops
        self.config = net.config
        self.decode_act = decode_act
        self.cache: PagedKVCache = net.new_cache(kv_blocks, block_size, kv_dtype, max_sequences)
        self.max_sequences = max_sequences
        # model layers whose input hidden states each step hands back (StepRun.features): what a
        # feature-conditioned draft reads (daemon/speculative/feature_proposer.py)
        self.capture: tuple[int, ...] = ()

    @property
    def stateful(self) -> bool:
        """Sequences carry recurrent state (hybrid models): a step cannot be run twice, and a cached
        prefix's blocks do not bring back the state after it."""
        return self.net.stateful

    @property
    def step_alignment(self) -> int:
        """Positions a prompt run stopping short of its end should stop at a multiple of: the delta
        rule's chunk for hybrid models (their rounding then follows the positions, not the steps), 1 else."""
        return self.net.ops.linear_attention_chunk if self.stateful else 1

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def kv_blocks(self) -> int:
        return self.cache.n_blocks

    def between_requests(self) -> None:
        """A new request starts with the next step: a MoE model's experts may follow its routing."""
        if self.net.experts is not None:
            self.net.experts.between_requests(self.net.ops)

    def prepare(self, batch: StepBatch) -> StepBatch:
        """The step's metadata on the device, moved once for every layer to read."""
        if self.decode_act == "f32":
            batch = replace(batch, decode_rows=np.zeros_like(batch.decode_rows))
        return batch.on(self.ops)

    lanes = 1  # steps the engine may keep in flight on this runner (a split's stages: one each)

    def execute(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], keep: Seq[int] = ()) -> StepRun:
        """Run `batch`; sample row r for each (r, sequence) of `samplers` with that sequence's
        parameters and generator; bring the rows in `keep` to the host."""
        return self.collect(self.submit(batch, samplers, keep))

    def submit(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], keep: Seq[int] = ()) -> PendingStep:
        """Start `batch` (here: run it); collect() samples it. A runner with lanes > 1 returns at once."""
        if self.capture:
            logits, features = self.net.forward_with_features(self.prepare(batch), self.cache, self.capture)
            return PendingStep(logits, batch.n_logits, list(samplers), list(keep), features)
        return PendingStep(self.forward(batch), batch.n_logits, list(samplers), list(keep))

    def decode(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], steps: int) -> StepRun:
        """`steps` decode steps in a row from `batch` (one token of each sequence, each sampling: row
        r for each (r, sequence) of `samplers`), each step's sampled tokens the next one's input, in
        positions the sequences' blocks already hold: the engine's per-step host work once for
        `steps` tokens (EngineCore's decode bursts). Each StepRun choice is the block of tokens a
        sequence got, as many as `steps` unless it sampled one of its stop ids first or its sampling
        failed (the rest of a block would be dropped by the scheduler anyway). A token is the one
        the same sequence would get from single steps: the same rows, sampler, penalties over
        everything generated before it, and generator."""
        burst = BurstBlocks(samplers)
        tokens = self._greedy_burst(batch, samplers, steps)
        if tokens is not None:  # every step in one backend call
            for row in tokens:
                burst.take([Choice(int(t), float("nan")) for t in row], {})
        else:
            for step in range(steps):
                if step:
                    batch = batch.following(burst.last_ids(), self.block_size)
                burst.take(*self._sample(self.forward(batch), samplers, burst.blocks))
                if burst.finished:
                    break
        choices, failed = burst.result()
        return StepRun(choices, {}, failed)  # type: ignore[arg-type]

    def _greedy_burst(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], steps: int) -> np.ndarray | None:
        """The burst's tokens [steps taken, n] from the model's compiled greedy steps (Transformer.greedy_steps)
        where each row is a sequence sampling greedily with nothing else asked (no penalties, no
        logprobs: what _sample's fast path takes), else None."""
        if self.capture or [r for r, _ in samplers] != list(range(len(batch.ids))) or not _plain_greedy(samplers):
            return None
        stops = np.full((len(samplers), max([1] + [len(s.stop_ids) for _, s in samplers])), -1, np.int64)
        for k, (_, s) in enumerate(samplers):
            stops[k, :len(s.stop_ids)] = sorted(s.stop_ids)
        return self.net.greedy_steps(self.prepare(batch), self.cache, steps, stops)

    def collect(self, step: PendingStep, pending: Seq[Seq[Choice]] = ()) -> StepRun:
        """The sampled tokens (and kept logits rows) of a submitted step; pending: as _sample's (a
        pipelined decode burst's tokens so far)."""
        logits = self._logits_of(step)
        if step.n_logits == 0:
            return StepRun([], {}, features=step.features)
        choices, failed = self._sample(logits, step.samplers, pending)
        return StepRun(choices, {r: self.ops.to_numpy(logits[r]) for r in step.keep}, failed, step.features)

    def _logits_of(self, step: PendingStep) -> Array:
        return step.work

    def forward(self, batch: StepBatch) -> Array:
        """The logits [batch.n_logits, vocab] of the host batch's logit rows, where the runner keeps them."""
        return self.net.forward(self.prepare(batch), self.cache)

    def _sample(self, logits: Array, samplers: Seq[tuple[int, RowSampling]], pending: Seq[Seq[Choice]] = ()
                ) -> tuple[list[Choice | None], dict[int, str]]:
        """pending: per sampler, tokens sampled for its sequence that it has not appended yet (a decode
        burst's), which penalties count as generated."""
        if not samplers:
            return [], {}
        if _plain_greedy(samplers):  # the greedy fast path: one argmax over the rows, no per-row copy
            rows = np.fromiter((r for r, _ in samplers), np.int64, len(samplers))
            best = self.ops.to_numpy(self.ops.argmax_rows(logits, rows))
            return [Choice(int(t), float("nan")) for t in best], {}
        generated = [s.generated + [c.token for c in pending[k]] if pending and pending[k] else s.generated
                     for k, (_, s) in enumerate(samplers)]
        results = self.ops.sample_rows(logits, [SampleRow(r, s.params, s.rng, s.prompt, generated[k], s.wants_logprob)
                                                for k, (r, s) in enumerate(samplers)])
        failed = {k: why for k, why in enumerate(results) if isinstance(why, str)}
        return [None if isinstance(c, str) else c for c in results], failed


def _plain_greedy(samplers: Seq[tuple[int, RowSampling]]) -> bool:
    """Every sequence takes its logits' argmax and asks for nothing else (no penalties, no logprobs)."""
    return all(s.plain_greedy for _, s in samplers)
