"""The cases the decode-burst tests run one token a step and in bursts (tests/test_engine_core.py in
one process, tests/test_layer_split.py through a pipelined split): greedy, greedy with penalties (over
the burst's own earlier tokens: a penalty that missed them changes the argmax), and seeded sampling
with penalties; sequences whose max_tokens end inside a burst, each with its own seed, the second
one stopping at `stop` when given."""
from __future__ import annotations

from collections.abc import Sequence as Seq

from ember.daemon.engine.sequence import Sequence
from ember.kernels.sampling import SamplingParams

SAMPLING = [{}, {"repetition_penalty": 1.5, "frequency_penalty": 0.5},
            {"temperature": 0.9, "top_k": 40, "repetition_penalty": 1.3, "presence_penalty": 0.4,
             "frequency_penalty": 0.2}]
SAMPLING_IDS = ["greedy", "greedy-penalties", "sampled-penalties"]


def burst_sequences(prompts: Seq[list[int]], params: SamplingParams, stop: int | None = None) -> list[Sequence]:
    return [Sequence(p, max_tokens=9 + 3 * i, params=params, seed=i,
                     stop_ids=frozenset() if stop is None or i != 1 else frozenset({stop}))
            for i, p in enumerate(prompts)]
