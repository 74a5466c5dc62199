"""The model runner's side of a step: device names and backends, StepBatch layout (the decode fast
path against the general one), and sampling where the logits are (the greedy fast path against the
full sampler)."""
from __future__ import annotations

import numpy as np
import pytest

import ember
from ember.daemon.engine.sequence import Sequence
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.runner.devices import DeviceName, backend_for
from ember.daemon.runner.model_runner import ModelRunner
from ember.daemon.step.step_batch import StepBatch
from ember.kernels.sampling import SamplingParams
from ember.kernels.sampling_batch import sample


@pytest.mark.parametrize(("text", "name"), [("cpu", DeviceName("cpu")), ("cuda", DeviceName("cuda", 0)),
                                            ("cuda:3", DeviceName("cuda", 3)), (" cpu ", DeviceName("cpu")),
                                            ("cpu:1", DeviceName("cpu", 1))])
def test_device_names(text: str, name: DeviceName) -> None:
    assert DeviceName.parse(text) == name and DeviceName.parse(str(name)) == name


@pytest.mark.parametrize("text", ["gpu", "cpu:", "cpu:x", "cuda:", "cuda:x", "", "CPU"])
def test_bad_device_names_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a device"):
        DeviceName.parse(text)


def test_a_kind_without_a_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="no tpu backend"):
        backend_for(DeviceName("tpu", 0))  # a kind DeviceName may learn before a backend exists
    assert backend_for("cuda:0").kind == "cuda"  # tests/cuda test the backend itself


def _general(chunks, block_size, wants):  # type: ignore[no-untyped-def]
    """StepBatch.build's general path for the same chunks, written out independently."""
    ids, pos, seq, blocks, offs, rows = [], [], [], [], [], []
    for s, (tokens, start, table) in enumerate(chunks):
        for i, t in enumerate(tokens):
            p = start + i
            ids.append(t), pos.append(p), seq.append(s), blocks.append(table[p // block_size]), offs.append(p % block_size)
        if wants[s]:
            rows.append(len(ids) - 1)
    return ids, pos, seq, blocks, offs, rows


@pytest.mark.parametrize("wants", [[True, True, True], [False, True, False], [False, False, False]])
def test_decode_batches_equal_the_general_layout(wants: list[bool]) -> None:
    chunks = [([5], 17, [3, 9]), ([7], 0, [4]), ([2], 40, [1, 2, 6])]
    b = StepBatch.build(chunks, 16, wants_logits=wants)
    ids, pos, seq, blocks, offs, rows = _general(chunks, 16, wants)
    assert b.ids.tolist() == ids and b.positions.tolist() == pos and b.token_seq.tolist() == seq
    assert b.kv_blocks.tolist() == blocks and b.kv_offsets.tolist() == offs and b.logit_rows.tolist() == rows
    assert b.tables.tolist() == [[3, 9, 0], [4, 0, 0], [1, 2, 6]]


def test_prompt_chunks_and_all_logits_rows() -> None:
    chunks = [([1, 2, 3], 14, [0, 5]), ([4], 3, [2]), ([6, 7], 0, [8])]
    b = StepBatch.build(chunks, 16, all_logits=[True, False, False], wants_logits=[False, True, False])
    ids, pos, seq, blocks, offs, _ = _general(chunks, 16, [False] * 3)
    assert b.ids.tolist() == ids and b.positions.tolist() == pos and b.token_seq.tolist() == seq
    assert b.kv_blocks.tolist() == blocks and b.kv_offsets.tolist() == offs
    assert b.logit_rows.tolist() == [0, 1, 2, 3]  # every token of the first chunk, the last of the second


@pytest.fixture(scope="module")
def model() -> ember.Model:
    return ember.load(DEMO_MODEL)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(repetition_penalty=1.3),
                                    SamplingParams(temperature=0.7, top_k=20), SamplingParams(logit_bias={5: 9.0})])
def test_runner_sampling_equals_the_sampler_on_the_same_logits(model: ember.Model, params: SamplingParams) -> None:
    prompts = [model.tokenize(t) for t in ("def f(x):", "import os\n", "class A:")]
    chunks = [(p, 0, [i]) for i, p in enumerate(prompts)]
    batch = StepBatch.build(chunks, 16)
    seqs = [Sequence(p, 4, params, seed=i) for i, p in enumerate(prompts)]
    twins = [Sequence(p, 4, params, seed=i) for i, p in enumerate(prompts)]  # same generators, for the reference
    runner = ModelRunner(model.net, 3, 16)
    run = runner.execute(batch, [(r, s.sampling) for r, s in enumerate(seqs)], keep=[0, 1, 2])
    assert sorted(run.kept) == [0, 1, 2]
    for r, (choice, twin) in enumerate(zip(run.choices, twins, strict=True)):
        want = sample(run.kept[r], params, twin.rng, twin.prompt, twin.generated)
        assert choice.token == want.token
        if params.plain_greedy:
            assert np.isnan(choice.logprob)  # not asked for: the fast path computes none
