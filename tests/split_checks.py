"""Checks a layer split's tests make on any split, local stage processes or Ray actors (tests/
test_layer_split.py, tests/cluster/): its logits against the unsplit model's, for a prompt's rows and
for generated tokens, what 16-bit staging may move, and engines under way for a stage to die under."""
from __future__ import annotations

import numpy as np

import ember
from ember.daemon.engine.engine_core import EngineCore
from ember.daemon.engine.sequence import Sequence


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def generated_logits(model: ember.Model, ids: list[int], tokens: int = 10) -> np.ndarray:
    """The logits rows of `tokens` greedy tokens after `ids`: decode rows (int8 activations, the fast
    path) cross the boundaries too."""
    engine = model.engine(128)
    engine.add(Sequence(ids, tokens, wants_logits=True))
    rows = []
    while engine.has_work:
        rows += [out.logits[0] for out in engine.step().outputs]
    return np.stack(rows)


def assert_narrow_staging_tracks_f32(model: ember.Model, whole: ember.Model, texts: list[str]) -> None:
    """Hidden states rounded to 16 bits at each boundary, widened back before the next norm: the logits
    move by the rounding (under 1%), the greedy tokens do not."""
    for text in texts:
        ids = whole.tokenize(text)
        got, want = model.logits(ids), whole.logits(ids)
        assert 0 < rel_error(got, want) < 0.01
        assert np.array_equal(got.argmax(1), want.argmax(1))
        assert list(model.generate(ids, 48, ignore_eos=True)) == list(whole.generate(ids, 48, ignore_eos=True))


def engines_under_way(model: ember.Model, unsplit: ember.Model, texts: list[str]) -> tuple[EngineCore, EngineCore,
                                                                                           list[Sequence]]:
    """Two engines over the model's stages, three steps into their sequences (texts 0 and 1, and text
    3): a stage that dies then fails the first's, and the second learns at its next step that its cache
    is lost."""
    engine, other = model.engine(256, max_running=2), model.engine(256)
    seqs = [Sequence(unsplit.tokenize(t), 50) for t in texts[:2]]
    for seq in seqs:
        engine.add(seq)
    other.add(Sequence(unsplit.tokenize(texts[3]), 50))
    for _ in range(3):
        engine.step(), other.step()
    return engine, other, seqs
