"""The sizes of a layer split's staging segments: one formula for the planner's staging figure and
for what runner/staging.py allocates, so that the plan is what the split holds."""
from __future__ import annotations

from ember.kernels.convert import storage_bytes


def boundary_bytes(hidden: int, max_tokens: int, act_dtype: str, stages: int) -> int:
    """Bytes of one boundary's segment: a slot per stage (micro-batch in flight) of max_tokens x hidden
    in act_dtype."""
    return stages * max_tokens * storage_bytes(act_dtype, hidden)


def logits_rows_bytes(vocab: int, max_tokens: int, lanes: int) -> int:
    """Bytes of the logits segment: a region of max_tokens f32 rows per lane (micro-batch in flight)."""
    return lanes * max_tokens * vocab * 4
