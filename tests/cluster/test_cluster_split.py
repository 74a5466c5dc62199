"""A layer split across the two nodes of a real Ray cluster on this machine (conftest.py): each stage a
Ray actor on a node of its own, the hidden states through Ray's object store, against the unsplit model."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import ember
from ember.daemon.engine.sequence import Sequence
from ember.daemon.loader.demo_model import DEMO_MODEL

sys.path.insert(0, str(Path(__file__).parents[1]))
from split_checks import engines_under_way, generated_logits, rel_error  # noqa: E402

pytestmark = pytest.mark.slow
SNIPPETS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
            "for i in range(10):\n    print(", "# read the config file\nwith open("]
ON_RAY = ["ray:0/cpu", "ray:1/cpu"]


@pytest.fixture(scope="module")
def unsplit() -> ember.Model:
    return ember.load(DEMO_MODEL)


@pytest.fixture(scope="module")
def split(ray_nodes: str) -> Iterator[ember.Model]:
    model = ember.load(DEMO_MODEL, devices=ON_RAY, split=[3, 2], act_dtype="f32", max_step_tokens=64)
    yield model
    model.close()


def test_each_stage_runs_on_a_node_of_its_own(split: ember.Model) -> None:
    stages = split.pipeline.stages
    assert [str(s.spec.device) for s in stages] == ON_RAY and [(s.spec.first, s.spec.end) for s in stages] == [(0, 3), (3, 5)]
    assert len({s.node for s in stages}) == 2 and all(s.pid for s in stages)


def test_f32_staging_logits_equal_unsplit(unsplit: ember.Model, split: ember.Model) -> None:
    for text in SNIPPETS[:3]:
        ids = unsplit.tokenize(text)
        assert rel_error(split.logits(ids), unsplit.logits(ids)) <= 1e-6

    ids = unsplit.tokenize(SNIPPETS[2])  # decode rows (int8 activations) cross too
    assert rel_error(generated_logits(split, ids), generated_logits(unsplit, ids)) <= 1e-6


def test_greedy_and_seeded_sampling_give_the_unsplit_tokens(unsplit: ember.Model, split: ember.Model) -> None:
    ids = unsplit.tokenize(SNIPPETS[0])
    assert list(split.generate(ids, 32, ignore_eos=True)) == list(unsplit.generate(ids, 32, ignore_eos=True))
    sampling = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.2,
                    frequency_penalty=0.3, presence_penalty=0.2, logit_bias={10: 2.0}, seed=7)
    assert list(split.generate(ids, 32, ignore_eos=True, **sampling)) == \
        list(unsplit.generate(ids, 32, ignore_eos=True, **sampling))


def test_concurrent_sequences_pipeline_through_the_nodes(unsplit: ember.Model, split: ember.Model) -> None:
    """Four sequences, two micro-batches in flight (one per stage): each gives its unsplit tokens."""
    engine = split.engine(1024, max_running=4)
    seqs = [Sequence(unsplit.tokenize(t), 16) for t in SNIPPETS[:4]]  # no stop ids: 16 tokens each
    for s in seqs:
        engine.add(s)
    while engine.has_work:
        assert not engine.step().failed
    for s, text in zip(seqs, SNIPPETS, strict=False):
        assert s.generated == list(unsplit.generate(unsplit.tokenize(text), 16, ignore_eos=True))


def test_a_stage_actor_killed_fails_its_sequences_and_ray_restarts_it(unsplit: ember.Model, split: ember.Model) -> None:
    import ray

    engine, other, seqs = engines_under_way(split, unsplit, SNIPPETS)
    stage = split.pipeline.stages[1]
    before = stage.pid
    ray.kill(stage.actor, no_restart=False)
    failed = []
    for _ in range(3):
        failed += engine.step().failed
        if len(failed) == len(seqs):
            break
    assert sorted(s.seq_id for s, _ in failed) == sorted(s.seq_id for s in seqs)
    assert all("stage ray:1/cpu (layers 3-4) died" in why for _, why in failed)
    assert all(s.finish_reason == "error" for s in seqs) and not engine.has_work
    assert stage.pid != before and stage.restarts == 1
    lost = other.step()  # another engine over the same stages learns it at its next step
    assert len(lost.failed) == 1 and "KV cache is lost" in lost.failed[0][1]
    ids = unsplit.tokenize(SNIPPETS[4])  # and the model serves on
    assert list(split.generate(ids, 12, ignore_eos=True)) == list(unsplit.generate(ids, 12, ignore_eos=True))
