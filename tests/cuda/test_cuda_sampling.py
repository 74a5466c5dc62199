"""The sampler on the device against kernels/sampling_batch.sample on the same logits, with twin generators:
the same tokens, logprobs and alternatives, for every sampling option."""
from __future__ import annotations

import numpy as np
import pytest

from ember.kernels.sampling import SampleRow, SamplingParams
from ember.kernels.sampling_batch import SamplingBatch, sample

pytestmark = pytest.mark.cuda

CASES = [
    SamplingParams(logprobs=3),  # greedy, logprob and alternatives
    SamplingParams(repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={5: 4.0, 9: -2.5}),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, top_k=7, logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2, repetition_penalty=0.8),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, logit_bias={3: 5.0}, frequency_penalty=-0.4),
]


@pytest.fixture(scope="module")
def ops():  # type: ignore[no-untyped-def]
    from ember.kernels.cuda.backend import CudaOps

    return CudaOps()


def test_device_sampling_equals_the_host_sampler(ops) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    vocab = 100
    logits = (rng.standard_normal((len(CASES) + 1, vocab)) * 2).astype(np.float32)
    prompt, generated = [5, 7, 7, 12, 3], [9, 12, 12, 40]
    rows = [SampleRow(k + 1, p, np.random.default_rng(k), prompt, generated, True) for k, p in enumerate(CASES)]
    rows.append(SampleRow(0, SamplingParams(), np.random.default_rng(99), prompt, generated, False))  # plain greedy
    for draw in range(3):  # the generators advance as on the host
        got = ops.sample_rows(ops.to_device(logits), SamplingBatch.of(rows))
        for r, choice in zip(rows, got, strict=True):
            twin = np.random.default_rng(rows.index(r) if r.row else 99)
            for _ in range(draw):
                sample(logits[r.row], r.params, twin, prompt, generated, logprob=r.logprob)
            want = sample(logits[r.row], r.params, twin, prompt, generated, logprob=r.logprob)
            assert choice.token == want.token, (r.params, draw)
            np.testing.assert_allclose(choice.logprob, want.logprob, rtol=1e-5, atol=1e-6)
            assert [t for t, _ in choice.top] == [t for t, _ in want.top]
            np.testing.assert_allclose([v for _, v in choice.top], [v for _, v in want.top], rtol=1e-5, atol=1e-6)


def test_sampling_spreads_over_the_kept_tokens(ops) -> None:  # type: ignore[no-untyped-def]
    """Many draws from one flat row with top_k=3: only the three best ids come out, each often."""
    logits = np.zeros((1, 64), np.float32)
    logits[0, [10, 20, 30]] = 1.0
    params = SamplingParams(temperature=1.0, top_k=3)
    rows = [SampleRow(0, params, np.random.default_rng(s)) for s in range(40)]
    tokens = [c.token for c in ops.sample_rows(ops.to_device(np.repeat(logits, 1, axis=0)), SamplingBatch.of(rows))]
    assert set(tokens) == {10, 20, 30}


def test_nan_logits_fail_that_row_only(ops) -> None:  # type: ignore[no-untyped-def]
    logits = np.zeros((2, 32), np.float32)
    logits[1, 4] = np.nan
    logits[0, 7] = 3.0
    params = SamplingParams(temperature=1.0)
    got = ops.sample_rows(ops.to_device(logits), SamplingBatch.of([SampleRow(0, params, np.random.default_rng(0)),
                                                                   SampleRow(1, params, np.random.default_rng(1))]))
    assert got[0].token in range(32) and isinstance(got[1], str) and "sampling failed" in got[1]


def mask_of(allowed: list[int], vocab: int) -> np.ndarray:
    """A grammar's mask words (kernels/sampling.allowed_tokens' layout) allowing `allowed`."""
    bits = np.zeros(-(-vocab // 32) * 32, np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def test_grammar_masks_on_the_device_equal_the_host_sampler(ops) -> None:  # type: ignore[no-untyped-def]
    """A grammar's mask (constrained decoding) rules tokens out on the device as on the host: greedy,
    sampled and top-k rows pick among the allowed tokens only, with the same tokens, logprobs and
    alternatives (a ruled-out token is none); a mask that allows nothing fails its row alone."""
    rng = np.random.default_rng(3)
    vocab = 70  # words past the vocabulary's last one are cut
    logits = (rng.standard_normal((4, vocab)) * 2).astype(np.float32)
    best = int(np.argmax(logits[0]))
    allowed = [a for a in (2, 33, 64, 69) if a != best]
    cases = [SamplingParams(), SamplingParams(logprobs=5), SamplingParams(temperature=1.0, repetition_penalty=1.3),
             SamplingParams(temperature=0.8, top_k=2, logprobs=3)]
    rows = [SampleRow(k, p, np.random.default_rng(k), [2, 5], [33], False, mask_of(allowed, vocab))
            for k, p in enumerate(cases)]
    nothing = mask_of([], vocab)
    rows.append(SampleRow(0, SamplingParams(temperature=1.0), np.random.default_rng(9), (), (), True, nothing))
    got = ops.sample_rows(ops.to_device(logits), SamplingBatch.of(rows))
    for k, r in enumerate(rows[:-1]):
        want = sample(logits[r.row], r.params, np.random.default_rng(k), r.prompt, r.generated, r.logprob, r.allowed)
        assert got[k].token == want.token and want.token in allowed
        assert [t for t, _ in got[k].top] == [t for t, _ in want.top] and set(dict(want.top)) <= set(allowed)
        np.testing.assert_allclose(got[k].logprob, want.logprob, rtol=1e-5, atol=1e-6)  # NaN alike where not asked
    assert got[0].token != best and len(got[1].top) == len(allowed)  # 5 asked, 4 allowed
    assert isinstance(got[-1], str) and "allows no token" in got[-1]
