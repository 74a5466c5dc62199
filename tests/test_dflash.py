"""Feature-conditioned drafts (llama.cpp's `dflash` GGUF architecture) on the trained demo target, with
tiny random drafts written here (tests/dflash_files.py): the reader and its refusals, llama.cpp loading
and running the same files (the oracle of the draft's forward pass and of the target's captured
features), greedy output token-identical to decoding without a draft — alone, batched with prefix
reuse, under preemption (test_speculative.py's engine tests, run with a DFlash draft) — sampled
output with the target's distribution, and the feature mirror:
its round trip per dtype, its bytes against the memory plan, and prefix reuse carrying its rows.
Random weights propose poorly (acceptance near 0): identity and losslessness must hold regardless."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import ember
from dflash_files import reference_draft, write_dflash
from ember.daemon.step.defaults import KV_BLOCK
from ember.daemon.engine.sequence import Sequence
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.loader.model_file import open_model_file
from ember.daemon.loader.model_file_error import ModelFileError
from ember.daemon.models.dflash import DFlashDraft
from ember.daemon.planning.planner import Device, PlanRequest, SpeculativeSettings, plan_model
from ember.daemon.planning.precision import resolve_policy, DeviceCaps, PrecisionSettings
from ember.daemon.step.step_batch import StepBatch
from ember.daemon.loader.dflash_file import check_fits, read_dflash
from ember.daemon.speculative.feature_mirror import FeatureMirror
from ember.kernels.convert import STORAGE_DTYPES, decode_rows, encode_rows, storage_bytes
from ember.kernels.reference import dflash as reference
from test_engine_core import run
from test_speculative import SEEDS, SNIPPETS, chi_square_z, engine_of, greedy, later_tokens
# test_speculative.py's engine tests, run again here with this module's `spec` (a DFlash draft): batching
# with prefix reuse and a logits stream, preemption, penalties and bias, max_tokens, stops and the
# context limit inside a block, seeded sampling alone and in company
from test_speculative import (test_a_stop_id_inside_a_block_ends_there, test_batched_with_prefix_reuse_and_logit_streams,  # noqa: F401
                              test_greedy_with_penalties_and_bias_is_token_identical,
                              test_kv_exhaustion_preempts_and_finishes_everything, test_max_tokens_inside_a_block,
                              test_seeded_sampling_reproduces_alone_and_in_company, test_the_context_limit_inside_a_block)

MASK = 5


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return write_dflash(tmp_path_factory.mktemp("dflash") / "draft.gguf", DEMO_MODEL, target_layers=(1, 3, 5),
                        block_size=8, mask_id=MASK)


@pytest.fixture(scope="module")
def target() -> ember.Model:
    return ember.load(DEMO_MODEL)


@pytest.fixture(scope="module")
def spec(draft_path) -> ember.Model:  # type: ignore[no-untyped-def]
    return ember.load(DEMO_MODEL, draft=draft_path, draft_tokens=4)


# --- the file -------------------------------------------------------------------------------------
def test_reader(draft_path) -> None:  # type: ignore[no-untyped-def]
    mf = open_model_file(draft_path)
    spec = read_dflash(mf)
    assert (spec.target_layers, spec.block_size, spec.mask_id, spec.max_proposals) == ((1, 3, 5), 8, MASK, 7)
    assert not spec.own_embedding and not spec.own_output and mf.config.vocab == 8192  # from the copied tokenizer
    check_fits(spec, mf.config, open_model_file(DEMO_MODEL).config, str(draft_path))


@pytest.mark.parametrize("variant, match", [
    (dict(extra_tensors={"selector_hidden.weight": np.zeros((8, 384), np.float32)}), "DFlash2"),
    (dict(extra_tensors={"markov_w1.weight": np.zeros((8192, 8), np.float32)}), "DSpark draft"),
    (dict(extra_keys={"dflash.hyper_connection.count": 4}), "DeepSeek-V4 DSpark"),
    (dict(extra_tensors={"d2t": np.arange(64, dtype=np.int64)}), "reduced-vocabulary"),
    (dict(extra_keys={"dflash.selector_rank": 16}), "DFlash2"),
    (dict(extra_tensors={"blk.0.attn_sinks.weight": np.zeros(6, np.float32)}), "attention sinks"),
    (dict(extra_keys={"dflash.attention.sliding_window": 64}), "sliding-window"),
    (dict(extra_keys={"dflash.hidden_activation": "gelu"}), "hidden activation 'gelu'"),
    (dict(extra_keys={"dflash.attention.causal": True}), "causal DFlash block"),
    (dict(layers_key=False), "missing metadata key dflash.target_layers"),
    (dict(mask=False), "mask_token_id"),
])
def test_variants_are_refused_by_name(tmp_path, variant: dict, match: str) -> None:  # type: ignore[no-untyped-def]
    path = write_dflash(tmp_path / "v.gguf", DEMO_MODEL, **variant)
    with pytest.raises(ModelFileError, match=match) as refused:
        read_dflash(open_model_file(path))
    assert "\n" not in str(refused.value) and str(path) in str(refused.value)


@pytest.mark.parametrize("variant, match", [
    (dict(hidden=256, heads=4, kv_heads=2), "hidden size \\(256\\) differs from the target's \\(384\\)"),
    (dict(target_layers=(1, 6)), "layer 6 does not exist"),
])
def test_a_draft_that_does_not_fit_the_target_is_refused(tmp_path, variant: dict, match: str) -> None:  # type: ignore[no-untyped-def]
    path = write_dflash(tmp_path / "v.gguf", DEMO_MODEL, **variant)
    with pytest.raises(ModelFileError, match=match):
        ember.load(DEMO_MODEL, draft=path)


@pytest.mark.oracle
def test_llama_cpp_loads_the_test_drafts(draft_path, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The format check: llama.cpp's own loader takes the files these tests write (both with the
    target's embedding shared and with one of the draft's own)."""
    from llama_cpp_dflash import load_model, llama_cpp

    own = write_dflash(tmp_path / "own.gguf", DEMO_MODEL, own_embedding=True)
    for path in (draft_path, own):
        llama_cpp.llama_model_free(load_model(path))


# --- the draft's forward pass ---------------------------------------------------------------------
@pytest.mark.oracle
def test_draft_against_llama_cpp_and_the_numpy_reference(target, draft_path,  # type: ignore[no-untyped-def]
                                                         monkeypatch) -> None:
    """llama.cpp decodes a context with the target, injects its features into the draft and runs a
    noise block: ember's captured features and the draft's logits agree with it (to its q8_0
    activations against the q8_0 target: ember's decode rows do the same), and ember's draft equals
    the numpy reference written from dflash.cpp on the same features."""
    from llama_cpp_dflash import run_draft

    layers, k = (1, 3, 5), 5
    ids = target.tokenize("def fibonacci(n):\n    if n < 2:\n        return")
    context, last, n = ids[:-1], ids[-1], len(ids) - 1
    # llama.cpp's qwen3 graph taps no input of layer 5 (the last layer's output): its draft reads layers 1 and 3
    two_path = write_dflash(Path(draft_path).with_name("two.gguf"), DEMO_MODEL, target_layers=(1, 3))
    oracle = run_draft(DEMO_MODEL, two_path, (1, 3), context, last, MASK, k)
    net = target.net
    monkeypatch.setattr(net.ops, "prompt_act", "f32")  # the prompt rows below are the reference's: exact
    prompt = StepBatch.build([(context, 0, [0, 1, 2])], 16, prompt_lengths=[0])  # decode rows: q8_0 as llama.cpp
    _, captured = net.forward_with_features(prompt, net.new_cache(3, 16), layers)
    features = np.concatenate(captured, axis=1)
    np.testing.assert_allclose(features[:, : 2 * 384], oracle.features, atol=0.02 * np.abs(oracle.features).max())

    draft = DFlashDraft(open_model_file(draft_path), net)
    cache = draft.new_cache(3, 16)
    draft.inject(features, prompt, cache)
    block = StepBatch.build([([last] + [MASK] * k, n, [0, 1, 2])], 16, logit_tails=[k], prompt_lengths=[0])
    logits = draft.block_logits(replace(block, attn_end=np.full(k + 1, n + k)), cache)
    ref = reference_draft(draft_path, DEMO_MODEL)
    mine = reference.block_logits(ref, np.array([last] + [MASK] * k), n, reference.inject(ref, features, np.arange(n)))[1:]
    np.testing.assert_allclose(logits, mine, atol=0.02 * np.abs(mine).max())  # ember's q8_0 decode rows
    exact = StepBatch.build([([last] + [MASK] * k, n, [0, 1, 2])], 16, logit_tails=[k])  # f32 rows: the reference's
    cache = draft.new_cache(3, 16)
    draft.inject(features, StepBatch.build([(context, 0, [0, 1, 2])], 16), cache)
    np.testing.assert_allclose(draft.block_logits(replace(exact, attn_end=np.full(k + 1, n + k)), cache), mine,
                               atol=1e-4 * np.abs(mine).max())

    two = DFlashDraft(open_model_file(two_path), net)
    cache = two.new_cache(3, 16)
    two.inject(oracle.features, prompt, cache)
    got = two.block_logits(replace(block, attn_end=np.full(k + 1, n + k)), cache)
    tolerance = 0.01 * np.abs(oracle.logits).max()
    np.testing.assert_allclose(got, oracle.logits, atol=tolerance)
    # ember's proposal is llama.cpp's, but for near-ties within the tolerance (random weights have them)
    chosen = oracle.logits[np.arange(k), got.argmax(1)]
    assert (chosen >= oracle.logits.max(1) - 2 * tolerance).all()


# --- generation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("draft_tokens", [1, 4, 10])
def test_greedy_is_token_identical(target, draft_path, draft_tokens: int) -> None:  # type: ignore[no-untyped-def]
    spec = ember.load(DEMO_MODEL, draft=draft_path, draft_tokens=draft_tokens)
    spec.draft_min_prob = 0.0  # every block whole (random weights are never sure): the cap is what is tested
    for text in SNIPPETS[:2]:
        prompt = target.tokenize(text)
        assert list(spec.generate(prompt, max_tokens=48, ignore_eos=True)) == greedy(target, prompt, 48), text
    stats = spec.spec_stats()
    cap = min(draft_tokens, 7)  # the block (8) less its known token
    assert stats.steps > 0 and stats.proposed <= cap * stats.steps and stats.proposed > (cap - 1) * stats.steps


def test_a_prompt_run_in_pieces_speculates_from_its_last_token(target, spec) -> None:  # type: ignore[no-untyped-def]
    """A prompt cut by max_step_tokens: its last piece, one token, already speculates (its block
    starts with a prompt token, over the injected rest of the prompt)."""
    prompt = spec.tokenize(SNIPPETS[2])
    engine = engine_of(spec, kv_blocks=16, max_step_tokens=len(prompt) - 1)
    seq = Sequence(prompt, max_tokens=20)
    run(engine, {0: [seq]})
    assert seq.generated == greedy(target, prompt, 20) and engine.spec_stats.steps > 0


# --- sampled: the target's distribution -----------------------------------------------------------
@pytest.mark.slow
def test_sampled_tokens_follow_the_target_distribution(target, spec) -> None:  # type: ignore[no-untyped-def]
    """test_speculative.py's statistic (its power is shown on a small vocabulary in
    test_speculative_verification.py). Here the draft's q is far from p (random weights), so almost
    every token comes from the residual norm(max(0, p - q)): a wrong residual would show at once."""
    plain, _ = later_tokens(target)
    got, engine = later_tokens(spec)
    assert engine.spec_stats.steps >= SEEDS  # every sequence speculated
    for position, (a, b) in enumerate(zip(plain, got), start=2):
        assert chi_square_z(a, b) < 4.0, f"token {position} differs: {a.most_common(5)} vs {b.most_common(5)}"


# --- the feature mirror ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
def test_mirror_round_trip(dtype: str) -> None:
    """Rows go in through kernels/convert.py (ggml-exact) and come back as f32: the stored bytes are
    encode_rows' and what comes back is their decoding, at the slots written, nowhere else."""
    width, rng = 3 * 384, np.random.default_rng(0)
    mirror = FeatureMirror(6, 4, width, dtype)
    rows = (rng.standard_normal((5, width)) * 3).astype(np.float32)
    blocks, offsets = np.array([0, 0, 3, 5, 5]), np.array([0, 3, 1, 2, 3])
    mirror.write(blocks, offsets, rows)
    assert mirror.nbytes == 6 * 4 * storage_bytes(dtype, width)
    assert (mirror.store[blocks, offsets] == encode_rows(rows, dtype).view(np.uint8)).all()
    back = mirror.read(blocks, offsets)
    np.testing.assert_array_equal(back, decode_rows(encode_rows(rows, dtype), dtype, width))
    tolerance = {"f32": 0, "f16": 1e-3, "bf16": 8e-3, "q8_0": 1e-2}[dtype]
    np.testing.assert_allclose(back, rows, rtol=0, atol=tolerance * np.abs(rows).max())
    assert not mirror.store[1].any() and not mirror.read(np.array([3]), np.array([0])).any()


@pytest.mark.parametrize("dtype", STORAGE_DTYPES)
def test_mirror_bytes_equal_the_plan(draft_path, dtype: str) -> None:  # type: ignore[no-untyped-def]
    """The daemon's engine (max_active sequences of ctx tokens, daemon/server/serve.py) allocates the
    mirror the planner counts, to the byte."""
    ctx, seqs = 1000, 3
    loaded = ember.load(DEMO_MODEL, draft=draft_path, feature_dtype=dtype)
    engine = loaded.engine(seqs * (-(-ctx // KV_BLOCK) * KV_BLOCK), max_running=seqs, max_context=ctx)
    policy = resolve_policy([DeviceCaps.of("cpu")], env={}, flags=PrecisionSettings(feature=dtype))
    request = PlanRequest(devices=(Device("cpu", 1 << 40),), policy=policy, ctx=ctx, seqs=seqs)
    plan = plan_model(DEMO_MODEL, request, draft_path)  # the mirror's width read off the draft
    assert engine.proposer.mirror.nbytes == plan.devices[0].feature_mirror == seqs * 63 * 16 * storage_bytes(dtype, 3 * 384)
    assert plan_model(DEMO_MODEL, replace(request, speculative=SpeculativeSettings(3))).devices[0].feature_mirror \
        == plan.devices[0].feature_mirror
    stores = engine.proposer.cache.k + engine.proposer.cache.v  # the draft's injected K/V, as a draft model's
    assert plan.devices[0].draft_kv_cache == sum(a.nbytes for s in stores for a in (s.f32, s.u16, s.i8, s.scales)
                                                 if a.size > 1)


@pytest.mark.parametrize("dtype", ["q8_0", "bf16"])
def test_prefix_reuse_carries_the_mirror_in_its_dtype(target, spec, dtype: str) -> None:  # type: ignore[no-untyped-def]
    """A second sequence with the same prompt takes the first one's full blocks from the prefix cache:
    their mirror rows (stored bytes) are those a fresh run writes, they are not written again, and
    the second sequence's tokens are still the target's."""
    prompt = spec.tokenize(SNIPPETS[1] + SNIPPETS[0])
    engines = [engine_of(spec, kv_blocks=32, block_size=4, feature_dtype=dtype, prefix_caching=True) for _ in range(2)]
    stored = []
    for engine in engines:
        run(engine, {0: [Sequence(prompt, max_tokens=6)]})
        shared = engine.blocks.match_prefix(prompt)
        engine.blocks.release(shared)
        stored.append((shared, engine.proposer.mirror.store[shared].copy()))
    (shared, before), (_, fresh) = stored
    assert len(shared) == (len(prompt) - 1) // 4 and before.any()
    np.testing.assert_array_equal(before, fresh)
    engine = engines[0]
    hits = engine.stats().prefix_hits
    second = Sequence(prompt, max_tokens=12)
    run(engine, {0: [second]})
    assert engine.stats().prefix_hits - hits == len(shared)
    np.testing.assert_array_equal(engine.proposer.mirror.store[shared], before)
    assert second.generated == greedy(target, prompt, 12)


# --- the trained demo draft -----------------------------------------------------------------------
@pytest.mark.slow
def test_the_trained_demo_draft_keeps_greedy_tokens_and_stops_when_unsure(target) -> None:  # type: ignore[no-untyped-def]
    """daemon/assets' DFlash draft for the demo model: greedy tokens are the target's with whole blocks
    and with the confidence stop (Model.draft_min_prob), which keeps the accepted length and verifies
    far fewer rows (measured: 4.9 -> 1.4 target rows per token at a block of 7)."""
    from ember.daemon.loader.demo_model import DEMO_DFLASH

    spec = ember.load(DEMO_MODEL, draft=DEMO_DFLASH, draft_tokens=7)
    stats = {}
    for min_prob in (0.0, 0.7):
        spec.draft_min_prob = min_prob
        before = spec.spec_stats()
        for text in SNIPPETS[:3]:
            prompt = target.tokenize(text)
            assert list(spec.generate(prompt, max_tokens=48, ignore_eos=True)) == greedy(target, prompt, 48), text
        after = spec.spec_stats()
        stats[min_prob] = (after.proposed - before.proposed, after.accepted - before.accepted, after.steps - before.steps)
    (p0, a0, s0), (p7, a7, s7) = stats[0.0], stats[0.7]
    assert a0 > 0 and a7 > 0  # a trained draft gets tokens accepted
    assert (s7 + p7) / (s7 + a7) < 0.5 * (s0 + p0) / (s0 + a0)  # target rows per generated token
