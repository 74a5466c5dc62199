"""Hybrid models (qwen35: Gated DeltaNet + gated attention) against transformers, and the engine's
handling of their per-sequence recurrent state: continuous batching, preemption, cancel, failure
isolation, and prefix reuse (off for them: docs/hybrid.md)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ember
from ember.daemon.engine.engine_core import EngineCore
from ember.daemon.engine.sequence import Sequence, Status
from ember.daemon.runner.model_runner import ModelRunner
from test_engine_core import run
from references import hf_greedy, hf_logits
from tiny_models import QWEN35, build_hf_model


rng = np.random.default_rng(7)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    return build_hf_model("qwen35", tmp_path_factory.mktemp("qwen35") / "model", **QWEN35)


@pytest.fixture(scope="module")
def model(hybrid) -> ember.Model:
    return ember.load(hybrid[0])



def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / (want.max() - want.min()))


def prompts(n: int, lo: int = 5, hi: int = 40) -> list[list[int]]:
    return [rng.integers(1, 8192, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def alone(model, prompt: list[int], n: int) -> list[int]:
    return list(model.generate(prompt, max_tokens=n, ignore_eos=True))


def engine_of(model, kv_blocks: int, block_size: int = 16, max_running: int = 8, **options) -> EngineCore:
    runner = ModelRunner(model.net, kv_blocks, block_size, max_sequences=max_running)
    return EngineCore(runner, max_running=max_running, **options)


def decode_logits(model: ember.Model, prompt: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """The logits each of n generated tokens was sampled from (greedy), and the tokens."""
    engine = model.engine(len(prompt) + n)
    engine.add(Sequence(prompt, n, wants_logits=True))
    rows, tokens = [], []
    while engine.has_work:
        for out in engine.step().outputs:
            rows.append(out.logits[0])
            tokens += out.new_tokens
    return np.stack(rows), tokens


def test_logits_and_greedy_match_transformers_past_a_prefill_chunk(hybrid) -> None:
    """A 300-token prompt (two prefill chunks of the engine, five chunks of the delta rule), then decode
    steps (the recurrence) continuing it: every row within 1e-4 of the logit range of transformers'."""
    path, ref = hybrid
    model = ember.load(path, decode_act="f32", prompt_act="f32", kv_dtype="f32")
    prompt = rng.integers(1, 8192, 300).tolist()
    assert rel_error(model.logits(prompt), hf_logits(ref, prompt)) <= 1e-4
    rows, tokens = decode_logits(model, prompt, 8)
    assert rel_error(rows, hf_logits(ref, prompt + tokens[:-1])[len(prompt) - 1:]) <= 1e-4
    assert alone(model, prompt[:40], 16) == hf_greedy(ref, prompt[:40], 16)


QWEN35_MOE = dict(QWEN35, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                  shared_expert_intermediate_size=96)


def test_moe_variant_matches_transformers(tmp_path: Path) -> None:
    """qwen35moe: the same hybrid layers with routed experts (top-2 of 8, renormalised) and a shared
    expert behind a sigmoid gate in every layer; 300-token prompt, decode steps, greedy tokens."""
    path, ref = build_hf_model("qwen35moe", tmp_path / "moe", **QWEN35_MOE)
    model = ember.load(path, decode_act="f32", prompt_act="f32", kv_dtype="f32")
    assert model.config.arch == "qwen35moe" and model.config.n_experts == 8
    prompt = rng.integers(1, 8192, 300).tolist()
    assert rel_error(model.logits(prompt), hf_logits(ref, prompt)) <= 1e-4
    rows, tokens = decode_logits(model, prompt, 6)
    assert rel_error(rows, hf_logits(ref, prompt + tokens[:-1])[len(prompt) - 1:]) <= 1e-4
    assert alone(model, prompt[:30], 12) == hf_greedy(ref, prompt[:30], 12)


def test_prompt_logits_do_not_depend_on_how_steps_cut_the_prompt(model) -> None:
    """Prompt runs stop at multiples of the delta rule's chunk (64) unless they reach the end, so the
    logits are bit-identical whatever the step size, and beside another sequence's decodes."""
    prompt = rng.integers(1, 8192, 300).tolist()

    def prompt_logits(step: int, company: bool) -> np.ndarray:
        engine = engine_of(model, kv_blocks=64, max_running=2, max_step_tokens=step)
        assert engine.scheduler.align == 64
        seq = Sequence(prompt, 0, prompt_logits=True)
        rows: list[np.ndarray] = []
        if company:
            engine.add(Sequence(prompts(1)[0], 40))
            engine.step()
        engine.add(seq)
        while seq.status != Status.FINISHED:
            rows += [o.logits for o in engine.step().outputs if o.seq is seq and o.logits is not None]
        return np.concatenate(rows)

    solo = prompt_logits(256, False)
    for step, company in ((100, False), (67, True), (256, True)):
        assert np.array_equal(prompt_logits(step, company), solo), (step, company)


def test_batched_and_staggered_sequences_equal_their_solo_runs(model) -> None:
    ps = prompts(5)
    engine = engine_of(model, kv_blocks=64, max_step_tokens=24)
    seqs = [Sequence(p, max_tokens=12) for p in ps]
    run(engine, {i * 2: [s] for i, s in enumerate(seqs)})  # prompt chunks share steps with decodes
    assert [s.generated for s in seqs] == [alone(model, p, 12) for p in ps]


def test_preemption_recomputes_the_state(model) -> None:
    ps = prompts(5, 20, 30)
    engine = engine_of(model, kv_blocks=12, block_size=4, max_step_tokens=32)  # 48 positions, 5 x ~40 wanted
    seqs = [Sequence(p, max_tokens=14) for p in ps]
    run(engine, {0: seqs})
    assert engine.scheduler.preemptions > 0
    for seq, p in zip(seqs, ps, strict=True):
        assert seq.status == Status.FINISHED and seq.generated == alone(model, p, 14)
    assert sorted(engine.scheduler._free_slots) == list(range(8))


def test_prefix_reuse_is_off_and_output_identical(model) -> None:
    shared = prompts(1, 40, 41)[0]
    ps = [shared + tail for tail in prompts(3, 3, 6)]
    outputs = {}
    for caching in (False, True):
        engine = engine_of(model, kv_blocks=64, block_size=4, prefix_caching=caching)
        seqs = [Sequence(p, max_tokens=10) for p in ps]
        run(engine, {0: seqs[:1], 5: seqs[1:]})
        outputs[caching] = [s.generated for s in seqs]
        assert engine.stats().prefix_queries == 0
    assert outputs[True] == outputs[False] == [alone(model, p, 10) for p in ps]


def test_a_cancelled_sequence_frees_its_slot_for_a_fresh_one(model) -> None:
    a, b, c = prompts(3)
    engine = engine_of(model, kv_blocks=64, max_running=2)
    first, second = Sequence(a, 30), Sequence(b, 8)
    engine.add(first)
    engine.add(second)
    for _ in range(4):
        engine.step()
    slot = first.state_slot
    engine.abort(first)
    third = Sequence(c, 8)
    run(engine, {0: [third]})
    assert first.finish_reason == "cancelled" and third.state_slot == -1
    assert second.generated == alone(model, b, 8) and third.generated == alone(model, c, 8)
    assert slot in engine.scheduler._free_slots


def test_a_failed_step_replays_the_survivors_state(model, monkeypatch) -> None:
    """The forward pass fails after every layer ran (the survivors' states advanced): each chunk is run
    again alone from position 0, and the sequences that did not cause it end as they would have."""
    poison = 8191
    ps = [p for p in prompts(3) if poison not in p]
    engine = engine_of(model, kv_blocks=64)
    real = engine.runner.net.forward

    def failing_late(batch, cache):  # type: ignore[no-untyped-def]
        logits = real(batch, cache)
        if poison in batch.ids.tolist():
            raise RuntimeError("kernel fault")
        return logits

    monkeypatch.setattr(engine.runner.net, "forward", failing_late)
    good = [Sequence(p, 10) for p in ps]
    bad = Sequence(ps[0] + [poison], 10)
    failed = []
    for s in good:
        engine.add(s)
    for step in range(300):
        if step == 3:
            engine.add(bad)
        if not engine.has_work:
            break
        failed += [seq for seq, _ in engine.step().failed]
    assert failed == [bad]
    assert [s.generated for s in good] == [alone(model, p, 10) for p in ps]


def test_more_running_sequences_than_state_slots_is_refused(model) -> None:
    with pytest.raises(ValueError, match="recurrent state slots"):
        EngineCore(ModelRunner(model.net, 16, 16, max_sequences=2), max_running=3)


def test_cache_holds_kv_for_attention_layers_only(model) -> None:
    cache = model.net.new_cache(4, 16, "f32", max_sequences=3)
    lin = model.config.linear
    assert len(cache.k) == model.config.attention_layers == 1
    assert len(cache.state.delta) == lin.n_layers == 3
    assert cache.state.nbytes == 3 * model.config.state_bytes()


def test_plan_counts_state_per_sequence_and_kv_for_attention_layers_only(hybrid, model) -> None:
    from ember.daemon.planning.planner import Device, PlanRequest, plan_model

    cpu = Device("cpu", 1 << 34)
    plans = {seqs: plan_model(hybrid[0], PlanRequest.create([cpu], env={}, ctx=256, seqs=seqs)).devices[0]
             for seqs in (1, 3)}
    cache = model.net.new_cache(256 // 16, 16, "f16", max_sequences=3)  # f16: the default KV dtype
    assert plans[3].recurrent_state == cache.state.nbytes == 3 * plans[1].recurrent_state
    assert plans[1].kv_cache == sum(k.u16.nbytes + v.u16.nbytes for k, v in zip(cache.k, cache.v, strict=True))
