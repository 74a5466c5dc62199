"""Continuous batching on the trained demo model: batched sequences produce exactly the tokens each
produces alone, with and without prefix reuse, and under KV exhaustion (preemption)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import ember
from burst_cases import SAMPLING, SAMPLING_IDS, burst_sequences
from ember.daemon.engine.engine_core import EngineCore
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.engine.sequence import Sequence, Status
from ember.daemon.runner.model_runner import ModelRunner
from ember.kernels.sampling import SamplingParams

SNIPPETS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
            "for i in range(10):\n    print(", "# read the config file\nwith open(", "x = [", "return self.",
            "    @property\n    def name(self) -> str:\n        "]


@pytest.fixture(scope="module")
def model() -> ember.Model:
    return ember.load(DEMO_MODEL)


def alone(model, prompt: list[int], n: int, **sampling) -> list[int]:
    return list(model.generate(prompt, max_tokens=n, ignore_eos=True, **sampling))


def engine_of(model, kv_blocks: int, block_size: int = 16, **options) -> EngineCore:
    return EngineCore(ModelRunner(model.net, kv_blocks, block_size), **options)


def run(engine: EngineCore, arrivals: dict[int, list[Sequence]], max_steps: int = 5000) -> None:
    """Step the engine, adding sequences at the steps given in `arrivals`."""
    for step in range(max_steps):
        for seq in arrivals.get(step, []):
            engine.add(seq)
        if not engine.has_work and step > max(arrivals):
            return
        engine.step()
        engine.blocks.check_integrity([s.table for s in engine.scheduler.running + list(engine.scheduler.waiting)])
    raise AssertionError("did not finish")


@pytest.mark.parametrize("decode_act", ["q8_0", "f32"])
def test_generated_tokens_logits_against_prompt_logits(decode_act: str) -> None:
    """Model.logits reads a text as a prompt. With decode_act f32 (and so f32 prompt rows) a generated
    token's logits equal those to float32 rounding; with q8_0 (llama.cpp's numerics, prompt rows q8_0
    too) they differ by the activations' quantization of slightly different inputs, well under 2% of
    the logit range on the trained demo model."""
    model = ember.load(DEMO_MODEL, decode_act=decode_act)
    prompt = model.tokenize(SNIPPETS[2])
    engine = model.engine(128)
    engine.add(Sequence(prompt, 12, wants_logits=True))
    rows, tokens = [], []
    while engine.has_work:
        for out in engine.step().outputs:
            rows.append(out.logits[0])
            tokens += out.new_tokens
    got, want = np.stack(rows), model.logits(prompt + tokens[:-1])[len(prompt) - 1 :]
    error = (np.abs(got - want).max(axis=1) / (want.max(axis=1) - want.min(axis=1))).max()
    if decode_act == "f32":
        assert error < 1e-5
    else:
        assert 1e-5 < error < 0.02


@pytest.mark.parametrize("n_seqs", range(1, 9))
def test_batched_greedy_equals_alone(model, n_seqs: int) -> None:
    prompts = [model.tokenize(s) for s in SNIPPETS[:n_seqs]]
    engine = engine_of(model, kv_blocks=64, max_step_tokens=24)
    seqs = [Sequence(p, max_tokens=20) for p in prompts]
    run(engine, {i * 3: [s] for i, s in enumerate(seqs)})  # staggered arrivals: prefill meets decode
    for seq, prompt in zip(seqs, prompts):
        assert seq.generated == alone(model, prompt, 20), model.detokenize(prompt)


def fail_sampling_of_min_p_half_at(monkeypatch, generated: int) -> None:
    """Sampling raises for sequences with min_p 0.5 once they have `generated` tokens."""
    from ember.kernels import sampling_batch  # the host sampler every backend's default sample_rows calls

    real_of, real_row = sampling_batch.SamplingBatch.of.__func__, sampling_batch.sample_row
    built: dict[int, tuple[object, list[int]]] = {}  # batch id -> (the batch, kept alive; its rows' histories)

    def of(cls, rows):  # type: ignore[no-untyped-def]
        batch = real_of(cls, rows)
        built[id(batch)] = (batch, [len(r.generated) for r in rows])
        return batch

    def flaky(logits, batch, k):  # type: ignore[no-untyped-def]
        if batch.min_p[k] == 0.5 and built[id(batch)][1][k] == generated:
            raise ValueError("probabilities contain NaN")
        return real_row(logits, batch, k)

    monkeypatch.setattr(sampling_batch.SamplingBatch, "of", classmethod(of))
    monkeypatch.setattr(sampling_batch, "sample_row", flaky)


def bursting(model, kv_blocks: int, **options) -> tuple[EngineCore, list[int]]:
    """An engine whose decode steps run in bursts of 4 whenever the scheduler allows, and the decode
    steps of each step its executor took."""
    engine = engine_of(model, kv_blocks, decode_burst=math.inf, max_burst=4, **options)
    sizes, real = [], engine.executor.submit

    def counted(work):  # type: ignore[no-untyped-def]
        sizes.append(work.steps)
        return real(work)

    engine.executor.submit = counted  # type: ignore[method-assign]
    return engine, sizes


@pytest.mark.parametrize("sampling", SAMPLING, ids=SAMPLING_IDS)
def test_decode_bursts_give_the_tokens_of_single_steps(model, sampling: dict) -> None:
    """Decode bursts (several decode steps in one engine step) against one token a step: the same
    tokens and ends for staggered sequences, seeded sampling with penalties over the tokens the burst
    sampled before, a stop id in mid-burst, max_tokens inside a burst, and every block back."""
    prompts = [model.tokenize(s) for s in SNIPPETS[:5]]
    params = SamplingParams(**sampling)

    def sequences(stop: int | None) -> list[Sequence]:
        return burst_sequences(prompts, params, stop)

    single = sequences(None)
    run(engine_of(model, kv_blocks=64), {0: single[:2], 7: single[2:]})
    stop = single[1].generated[6]  # the stop falls inside a burst of 4
    assert stop not in single[1].generated[:6]
    single = sequences(stop)
    run(engine_of(model, kv_blocks=64), {0: single[:2], 7: single[2:]})
    engine, sizes = bursting(model, kv_blocks=64)
    burst = sequences(stop)
    run(engine, {0: burst[:2], 7: burst[2:]})
    assert [s.generated for s in burst] == [s.generated for s in single]
    assert [s.finish_reason for s in burst] == [s.finish_reason for s in single] == ["length", "stop"] + ["length"] * 3
    assert sizes and max(sizes) == 4
    assert engine.stats().kv_blocks_free == 64


def test_decode_bursts_under_kv_exhaustion_and_a_failing_sampler(model, monkeypatch) -> None:
    """Bursts reserve their slots without preempting anyone; when blocks run short the engine
    preempts and recomputes as it does for single steps, and a sequence whose sampling fails in
    mid-burst ends alone with the tokens it had before."""
    fail_sampling_of_min_p_half_at(monkeypatch, 6)
    prompts = [model.tokenize(s) for s in SNIPPETS[:6]]
    engine, sizes = bursting(model, kv_blocks=12, block_size=4, max_step_tokens=32)
    good = [Sequence(p, max_tokens=16, params=SamplingParams(temperature=0.8), seed=i) for i, p in enumerate(prompts[:5])]
    bad = Sequence(prompts[5], 16, SamplingParams(temperature=0.8, min_p=0.5), seed=9)
    run(engine, {0: good[:2], 1: [bad], 30: good[2:]})
    assert bad.finish_reason == "error" and len(bad.generated) == 6
    assert engine.scheduler.preemptions > 0 and max(sizes) == 4
    for seed, (seq, prompt) in enumerate(zip(good, prompts, strict=False)):
        assert seq.finish_reason == "length" and seq.generated == alone(model, prompt, 16, temperature=0.8, seed=seed)
    assert engine.stats().kv_blocks_free == 12


def test_prefix_reuse_gives_identical_output_and_hits(model) -> None:
    shared = model.tokenize("import json\nimport re\n\n\ndef load(path):\n    with open(path) as f:\n")
    prompts = [shared + model.tokenize(tail) for tail in ("        return json.load(f)\n", "        data = f.read()\n", "        for")]
    outputs = {}
    for caching in (False, True):
        engine = engine_of(model, kv_blocks=64, block_size=4, prefix_caching=caching)
        seqs = [Sequence(p, max_tokens=12) for p in prompts]
        run(engine, {0: seqs[:1], 6: seqs[1:]})
        outputs[caching] = [s.generated for s in seqs]
        hit_rate = engine.stats().prefix_hit_rate
        assert (hit_rate > 0.3) if caching else hit_rate == 0.0
    assert outputs[True] == outputs[False] == [alone(model, p, 12) for p in prompts]


def test_kv_exhaustion_preempts_and_finishes_everything(model) -> None:
    prompts = [model.tokenize(s) for s in SNIPPETS[:6]]
    engine = engine_of(model, kv_blocks=10, block_size=4, max_step_tokens=32)  # 40 slots, 6 x ~30 wanted
    seqs = [Sequence(p, max_tokens=16) for p in prompts]
    run(engine, {0: seqs})
    assert engine.scheduler.preemptions > 0
    for seq, prompt in zip(seqs, prompts):
        assert seq.status == Status.FINISHED and seq.generated == alone(model, prompt, 16)
    assert engine.stats().kv_blocks_free == 10


@pytest.mark.parametrize("kv_dtype", ["f16", "bf16", "q8_0"])
def test_narrow_kv_dtypes_track_f32(model, kv_dtype: str) -> None:
    ids = model.tokenize(SNIPPETS[2])
    narrow = ember.load(DEMO_MODEL, kv_dtype=kv_dtype)
    a, b = model.logits(ids), narrow.logits(ids)
    assert np.abs(a - b).max() <= 0.02 * (a.max() - a.min())
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


def test_seeded_sampling_is_independent_of_batch_company(model) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95)
    prompt = model.tokenize(SNIPPETS[0])
    solo = engine_of(model, kv_blocks=32)
    s1 = Sequence(prompt, max_tokens=16, params=params, seed=1234)
    run(solo, {0: [s1]})
    crowd = engine_of(model, kv_blocks=64)
    s2 = Sequence(prompt, max_tokens=16, params=params, seed=1234)
    others = [Sequence(model.tokenize(t), max_tokens=16, params=params, seed=i) for i, t in enumerate(SNIPPETS[1:4])]
    run(crowd, {0: others, 2: [s2]})
    assert s1.generated == s2.generated
    assert s1.generated == alone(model, prompt, 16, temperature=0.8, top_p=0.95, seed=1234)


def test_a_sequence_whose_sampling_fails_ends_alone(model, monkeypatch) -> None:
    fail_sampling_of_min_p_half_at(monkeypatch, 3)
    prompts = [model.tokenize(s) for s in SNIPPETS[:3]]
    good = [Sequence(p, 12, SamplingParams(temperature=0.8), seed=i) for i, p in enumerate(prompts[:2])]
    bad = Sequence(prompts[2], 12, SamplingParams(temperature=0.8, min_p=0.5), seed=9)
    engine = engine_of(model, kv_blocks=64)
    run(engine, {0: [*good, bad]})
    assert bad.status == Status.FINISHED and bad.finish_reason == "error" and len(bad.generated) == 3
    for seed, (seq, prompt) in enumerate(zip(good, prompts[:2], strict=True)):
        assert seq.finish_reason == "length" and seq.generated == alone(model, prompt, 12, temperature=0.8, seed=seed)
    assert engine.stats().kv_blocks_free == 64


def test_a_forward_pass_that_fails_for_one_sequence_fails_only_that_one(model, monkeypatch) -> None:
    poison = 4242  # a token id no snippet contains: the forward pass "crashes" on any batch holding it
    prompts = [model.tokenize(s) for s in SNIPPETS[:3]]
    assert all(poison not in p for p in prompts)
    engine = engine_of(model, kv_blocks=64)
    real = engine.runner.net.forward

    def crashing(batch, cache):  # type: ignore[no-untyped-def]
        if poison in batch.ids.tolist():
            raise RuntimeError("kernel fault")
        return real(batch, cache)

    monkeypatch.setattr(engine.runner.net, "forward", crashing)
    good = [Sequence(p, 10) for p in prompts]
    bad = Sequence(prompts[0] + [poison], 10)
    failed = []
    for s in good:
        engine.add(s)
    for step in range(200):
        if step == 2:
            engine.add(bad)  # arrives while the others decode: its prompt chunk shares their step
        if not engine.has_work:
            break
        failed += [seq for seq, _ in engine.step().failed]
    assert failed == [bad] and bad.finish_reason == "error"
    for seq, prompt in zip(good, prompts, strict=True):
        assert seq.generated == alone(model, prompt, 10)


def test_prompt_logits_survive_preemption_without_repeats(model) -> None:
    engine = engine_of(model, kv_blocks=5, block_size=4, max_step_tokens=3)  # 20 token slots
    grower = Sequence(model.tokenize(SNIPPETS[1])[:8], max_tokens=12)  # needs all 5 blocks by its end
    prompt = model.tokenize(SNIPPETS[2])[:12]
    reader = Sequence(prompt, max_tokens=0, prompt_logits=True)  # younger: preempted first
    engine.add(grower)
    engine.add(reader)
    rows = []
    while engine.has_work:
        rows += [o.logits for o in engine.step().outputs if o.seq is reader and o.logits is not None]
    assert reader.preemptions > 0 and reader.finish_reason == "length"
    got = np.concatenate(rows)
    assert got.shape == (12, model.config.vocab)
    np.testing.assert_allclose(got, model.logits(prompt), rtol=0, atol=1e-4)


def test_in_process_generation_raises_what_the_engine_reports_as_failed(model, monkeypatch) -> None:
    from ember.kernels import sampling_batch

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ValueError("probabilities contain NaN")

    monkeypatch.setattr(sampling_batch, "sample_row", broken)
    with pytest.raises(RuntimeError, match="probabilities contain NaN"):
        list(model.generate("def f(x):", max_tokens=4, temperature=0.8))


def test_in_process_generation_trims_the_heap_after_dropping_its_engine(model, monkeypatch) -> None:
    """The heap is trimmed once a generation ends, with its private engine (KV cache, prompt
    buffers) already freed: trimming while the engine lived would keep what it frees after."""
    import weakref

    from ember.daemon import runtime

    engines, alive_at_trim = [], []
    make = model.engine

    def tracked(*args, **kwargs):  # type: ignore[no-untyped-def]
        engine = make(*args, **kwargs)
        engines.append(weakref.ref(engine))
        return engine

    monkeypatch.setattr(model, "engine", tracked)
    monkeypatch.setattr(runtime, "release_free_heap", lambda: alive_at_trim.append(engines[-1]() is not None))
    assert len(alone(model, model.tokenize(SNIPPETS[0]), 5)) == 5
    model.logits(model.tokenize(SNIPPETS[1]))
    assert alive_at_trim == [False, False]


def test_a_burst_clock_believes_a_faster_step_at_once() -> None:
    """One stall (a first burst loading its compiled code) must not keep later bursts at one step."""
    from ember.daemon.engine.decode_burst import BurstClock

    clock = BurstClock(0.008, 32)
    assert clock.size() == 1  # nothing timed yet
    clock.timed(0.2, 1)
    assert clock.size() == 1
    clock.timed(0.001, 1)
    assert clock.size() == 8
    clock.timed(0.004, 2)  # slower steps are averaged in: 0.75 * 1 ms + 0.25 * 2 ms
    assert clock.size() == 6


def test_engines_of_one_model_share_a_burst_clock() -> None:
    """Model.generate makes an engine a call: its bursts start at the size the calls before measured."""
    model = ember.load(DEMO_MODEL)
    assert model.engine(64)._bursts is model.engine(64)._bursts
    assert model.engine(64, decode_burst=0.004)._bursts is not model.engine(64)._bursts
    list(model.generate(model.tokenize("def f(x):"), max_tokens=8, ignore_eos=True))
    assert model.engine(64)._bursts.size() > 1
