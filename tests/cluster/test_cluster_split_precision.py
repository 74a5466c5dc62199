"""A layer split on Ray at 16-bit staging, and what a split on Ray refuses: a module of its own, so that
test_cluster_split.py's split has given the two nodes' CPUs back (its module ended) before these place
stages of their own."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import ember
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.runner.split_spec import SplitSpecError

sys.path.insert(0, str(Path(__file__).parents[1]))
from split_checks import assert_narrow_staging_tracks_f32  # noqa: E402

pytestmark = pytest.mark.slow
SNIPPETS = ["def fibonacci(n):", "import os\nimport sys\n\n"]
ON_RAY = ["ray:0/cpu", "ray:1/cpu"]


@pytest.mark.parametrize("act_dtype", ["f16", "bf16"])
def test_narrow_staging_on_the_wire_tracks_f32(ray_nodes: str, act_dtype: str) -> None:
    """Hidden states cross the nodes as 16-bit patterns: the logits move by the rounding (bounded as
    locally, docs/layer_split.md), the greedy tokens do not."""
    whole = ember.load(DEMO_MODEL, decode_act="f32", prompt_act="f32", kv_dtype="f32")
    model = ember.load(DEMO_MODEL, kv_dtype="f32", devices=ON_RAY, act_dtype=act_dtype, decode_act="f32",
                       prompt_act="f32")
    try:
        assert model.pipeline.act_dtype == act_dtype
        assert_narrow_staging_tracks_f32(model, whole, SNIPPETS)
    finally:
        model.close()


@pytest.mark.parametrize(("devices", "message"), [
    (["ray:0/cpu", "cpu:1"], "a split on Ray runs every stage on Ray"),
    (["ray:0/cpu", "ray:2/cpu"], "names its nodes ray:0 to ray:1"),
    (["ray:0/cpu", "ray:0"], "named twice"),
])
def test_what_a_split_on_ray_cannot_run_is_refused(ray_nodes: str, devices: list[str], message: str) -> None:
    with pytest.raises(SplitSpecError, match=message):
        ember.load(DEMO_MODEL, devices=devices)
