"""Lookup: what a runner needs to decode a sequence greedily with n-gram proposals verified inside one
compiled loop (ModelRunner.lookup_steps): how many tokens a round proposes, which n-grams are looked
up, and the sequence's tokens, in an array with room for the ones the loop adds
(daemon/speculative/ngram_proposer.py keeps it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Lookup:
    k: int  # proposals a round at most
    min_n: int
    max_n: int  # the n-grams looked up: the longest that occurred wins
    history: np.ndarray  # int32: the sequence's tokens in [:length], room after them for the loop's
    length: int
