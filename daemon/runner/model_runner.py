"""ModelRunner: one model on one device — its weights, its KV cache and what a step moves there.

The executor (daemon/executor/) hands it a host StepBatch and the sampling rows of the step, never
a Sequence; the runner moves the batch's metadata to the device once (`prepare`), runs the model,
and samples where the logits are (RowSampler). Only token ids leave the device, and logits rows
when a sequence asks for them: on a GPU the full [tokens, vocab] logits never cross to the host.
Everything device-specific lives behind the ops API of the backend the runner was built with
(runner/devices.py chooses it), so the engine, the scheduler and the model code are the same for
every device. A layer split's runner (split_runner.py) has the same step API over the stage
processes, and the same RowSampler.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import numpy as np

from ember.daemon.models.transformer import Transformer
from ember.daemon.models.kv_cache import PagedKVCache
from ember.daemon.runner.row_sampler import RowSampler, plain_greedy
from ember.daemon.runner.step_run import PendingStep, StepRun
from ember.daemon.step.lookup import Lookup
from ember.daemon.step.row_sampling import RowSampling
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.convert import DECODE_ACTIVATIONS, DEFAULT_KV_DTYPE
from ember.kernels.ops import Array
from ember.kernels.sampling import Choice


def check_decode_act(decode_act: str) -> None:
    if decode_act not in DECODE_ACTIVATIONS:
        raise ValueError(f"unknown decode activation precision {decode_act!r} (choose from {', '.join(DECODE_ACTIVATIONS)})")


class ModelRunner:
    def __init__(self, net: Transformer, kv_blocks: int, block_size: int = 16, kv_dtype: str = DEFAULT_KV_DTYPE,
                 decode_act: str = "q8_0", max_sequences: int = 64, step_tokens: int = 0) -> None:
        """max_sequences: sequences running at once at most (a hybrid model's recurrent state slots);
        step_tokens: positions a sequence runs in one step at most, where known (sliding-window
        layers then keep only their window: Transformer.new_cache)."""
        check_decode_act(decode_act)
        self.net = net
        self.ops = net.ops
        self.config = net.config
        self.decode_act = decode_act
        self.cache: PagedKVCache = net.new_cache(kv_blocks, block_size, kv_dtype, max_sequences, step_tokens)
        self.max_sequences = max_sequences
        self.sampler = RowSampler(self.ops)
        # model layers whose input hidden states each step hands back (StepRun.features): what a
        # feature-conditioned draft reads (daemon/speculative/feature_proposer.py)
        self.capture: tuple[int, ...] = ()

    def device_scope(self) -> AbstractContextManager[Any]:
        return self.ops.device_scope()

    @property
    def logits_on_device(self) -> bool:
        return not self.ops.host_memory

    @property
    def stateful(self) -> bool:
        """Sequences carry recurrent state (hybrid models): a step cannot be run twice, and a cached
        prefix's blocks do not bring back the state after it."""
        return self.net.stateful

    @property
    def prefix_reuse(self) -> bool:
        """Whether a cached prefix's blocks bring back all a sequence needs of it: not where sequences
        carry recurrent state, nor where window layers keep only the window (no block holds theirs)."""
        return not self.stateful and not self.cache.ring

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

    def revive(self) -> bool:
        if self.net.experts is not None:
            self.net.experts.revive_workers()
        return False  # the KV cache is this process's own: no worker holds it

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

    def greedy_steps(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], steps: int) -> np.ndarray | None:
        """A decode burst (executor/burst.py) in one backend call: the tokens [steps taken, n] of the
        model's compiled greedy steps (Transformer.greedy_steps), each step's tokens the next one's
        input, where each row is a sequence sampling greedily with nothing else asked (no penalties,
        no logprobs: what the sampler's fast path takes), else None (the executor then runs the
        burst one step at a time)."""
        if self.capture or [r for r, _ in samplers] != list(range(len(batch.ids))) or not plain_greedy(samplers):
            return None
        stops = np.full((len(samplers), max([1] + [len(s.stop_ids) for _, s in samplers])), -1, np.int64)
        for k, (_, s) in enumerate(samplers):
            stops[k, :len(s.stop_ids)] = sorted(s.stop_ids)
        return self.net.greedy_steps(self.prepare(batch), self.cache, steps, stops)

    def lookup_steps(self, batch: StepBatch, samplers: Seq[tuple[int, RowSampling]], budget: int, lookup: Lookup
                     ) -> tuple[np.ndarray, int, int, int] | None:
        """Up to `budget` greedy tokens of the one sequence of a decode step, n-gram proposals from
        `lookup` verified in the same compiled loop (Transformer.lookup_steps) -> (tokens, rounds,
        proposed, accepted): the tokens greedy_steps would give; None where the sequence asks for more
        than its argmax (as greedy_steps) or the model has no such loop."""
        if self.capture or len(samplers) != 1 or samplers[0][0] != 0 or not plain_greedy(samplers):
            return None
        stops = np.array(sorted(samplers[0][1].stop_ids) or [-1], np.int64)
        return self.net.lookup_steps(self.prepare(batch), self.cache, budget, lookup.k, lookup.min_n, lookup.max_n,
                                     lookup.history, lookup.length, stops)

    def collect(self, step: PendingStep, pending: Seq[Seq[Choice]] = ()) -> StepRun:
        """The sampled tokens (and kept logits rows) of a submitted step; pending: as RowSampler.sample's
        (a decode burst's tokens so far)."""
        return self.sampler.finish(step.work, step, pending)

    def forward(self, batch: StepBatch) -> Array:
        """The logits [batch.n_logits, vocab] of the host batch's logit rows, where the runner keeps them."""
        return self.net.forward(self.prepare(batch), self.cache)
