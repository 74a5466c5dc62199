"""How many KV blocks a sequence's sliding-window layers hold where they keep only their window (a
ring per sequence slot, models/kv_cache.py): what the cache allocates and the memory plan counts,
from the model's dimensions and the most positions a step runs."""
from __future__ import annotations

from ember.daemon.loader.model_config import ModelConfig


def window_ring(window: int, step_tokens: int, block_size: int) -> int:
    """Blocks a sequence's window layers need: a step writes up to `step_tokens` positions and reads
    from `window` - 1 before the first, so window - 1 + step_tokens consecutive positions are live at
    once; a ring takes position p at slot p mod (ring * block_size), distinct for any such run."""
    return -(-(window - 1 + step_tokens) // block_size)


def ring_for(config: ModelConfig, n_blocks: int, block_size: int, max_sequences: int, step_tokens: int) -> int:
    """The blocks a sequence slot's ring holds in a model's sliding-window layers, or 0 where they
    page over every position: rings where the most positions a step runs are known (step_tokens),
    the model's window layers run op by op (gemma4: the compiled layers read one table) and rings take
    less memory than n_blocks."""
    if not (config.sliding_window and step_tokens and config.arch == "gemma4"):
        return 0
    ring = window_ring(config.sliding_window, step_tokens, block_size)
    return ring if ring * max_sequences < n_blocks else 0
