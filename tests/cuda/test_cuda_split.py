"""A layer split with a cuda stage (a worker process that sees its GPU alone), beside a cpu:N stage
or the engine's own thread (`cpu`, last), on the micro model: the unsplit CPU model's logits (f32
staging, f32 decode rows), greedy and seeded tokens, whichever side of the boundary the GPU is on."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import ember

sys.path.insert(0, str(Path(__file__).parent))

from micro_model import write_micro_model  # noqa: E402

pytestmark = pytest.mark.cuda

PROMPT = [1, 17, 300, 45, 9]


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return write_micro_model(tmp_path_factory.mktemp("micro"))


@pytest.mark.parametrize("devices", [["cpu:0", "cuda:0"], ["cuda:0", "cpu:0"], ["cuda:0", "cpu"]])
def test_a_split_with_a_cuda_stage_equals_the_unsplit_model(micro: Path, devices: list[str]) -> None:
    whole = ember.load(micro, decode_act="f32", prompt_act="f32", kv_dtype="f32")
    split = ember.load(micro, devices=devices, act_dtype="f32", decode_act="f32", prompt_act="f32", max_step_tokens=16, kv_dtype="f32")
    try:
        stages = split.pipeline.stages  # the workers: plain cpu is the engine's thread
        assert [str(s.device) for s in stages] == [d for d in devices if d != "cpu"]
        assert (split.pipeline.engine_stage is not None) == ("cpu" in devices)
        gpu = stages[devices.index("cuda:0")]
        assert gpu.binding.startswith(("on GPU", "on numba's CUDA simulator")) and gpu.alive()
        want, got = whole.logits(PROMPT), split.logits(PROMPT)
        assert np.abs(got - want).max() <= 1e-5 * (want.max() - want.min())
        assert list(split.generate(PROMPT[:3], 3, ignore_eos=True)) == list(whole.generate(PROMPT[:3], 3, ignore_eos=True))
        options = dict(max_tokens=2, ignore_eos=True, temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.2,
                       seed=7)
        assert list(split.generate(PROMPT[:3], **options)) == list(whole.generate(PROMPT[:3], **options))
    finally:
        split.close()
