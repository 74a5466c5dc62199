"""Layer split: a model's layers in stage worker processes (`cpu:N`), or the last stage in the engine's
own thread (`cpu`), hidden states staged in shared memory. With f32 staging the split model computes what the unsplit one does — logits equal, greedy and
seeded sampled tokens identical — on the trained demo model and on a tiny random Llama, alone and
batched (micro-batches pipelined through the stages); narrow staging stays close; the staging
allocated is the planner's figure; bad specs are refused with what to change; a micro-batch one stage
fails passes the others and names that stage; a stage that dies fails the sequences it held, and
every stage is restarted (two stages and three)."""
from __future__ import annotations

import gc
import math
import os
import shutil
import signal
import stat

import pytest

import ember
from burst_cases import SAMPLING, SAMPLING_IDS, burst_sequences
from split_checks import assert_narrow_staging_tracks_f32, engines_under_way, generated_logits, rel_error
from ember.daemon.step.defaults import KV_BLOCK
from ember.daemon.engine.engine_core import EngineCore
from ember.daemon.engine.sequence import Sequence
from ember.daemon.loader.demo_model import DEMO_DFLASH, DEMO_DRAFT, DEMO_MODEL
from ember.daemon.planning.planner import Device, PlanRequest, plan_model
from ember.daemon.planning.precision import PrecisionSettings
from ember.daemon.runner.devices import CudaUnavailable
from ember.daemon.runner.split_spec import SplitSpecError, stage_threads_for
from ember.daemon.runner.stage_channel import DropCache
from ember.daemon.runner.stage_process import ProcessStage, StageDied, visible_gpu
from ember.daemon.runner.stage_worker import bind_to_numa_node, parse_cpulist, pin_to_cpus, stage_cpus
from ember.kernels.sampling import SamplingParams

pytestmark = pytest.mark.slow

SNIPPETS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
            "for i in range(10):\n    print(", "# read the config file\nwith open(", "x = ["]
STEP = 64  # max_step_tokens of the split models here (their staging holds this many rows)


@pytest.fixture(scope="module")
def unsplit() -> ember.Model:
    return ember.load(DEMO_MODEL)


@pytest.fixture(scope="module", params=["cpu:0,cpu:1", "cpu:0,cpu"], ids=["workers", "engine-last"])
def split(request) -> ember.Model:
    """Two worker processes, or a worker and the engine's own thread for the last stage."""
    model = ember.load(DEMO_MODEL, devices=request.param, split=[3, 2], act_dtype="f32", max_step_tokens=STEP)
    yield model
    model.close()


def run_batched(model: ember.Model, seqs: list[Sequence], lanes: int | None = None) -> None:
    """Staggered arrivals, so prompt chunks meet decodes and steps hold several sequences (lanes: the
    steps the engine keeps in flight, if not the runner's own)."""
    engine = model.engine(1024, max_running=len(seqs), max_step_tokens=24)
    if lanes is not None:
        engine.runner.lanes = lanes
    for step in range(10_000):
        if step < 3 * len(seqs) and step % 3 == 0:
            engine.add(seqs[step // 3])
        elif not engine.has_work:
            if step >= 3 * len(seqs):  # (a burst may finish the ones so far before the next arrives)
                return
            continue
        result = engine.step()
        assert not result.failed, result.failed
    raise AssertionError("did not finish")


def test_f32_staging_logits_equal_unsplit(unsplit, split) -> None:
    for text in SNIPPETS[:3]:
        ids = unsplit.tokenize(text)
        assert rel_error(split.logits(ids), unsplit.logits(ids)) <= 1e-6


def test_generated_tokens_logits_equal_unsplit(unsplit, split) -> None:
    """Decode rows (int8 activations, the fast path) cross the boundary too: their logits agree."""
    ids = unsplit.tokenize(SNIPPETS[2])
    assert rel_error(generated_logits(split, ids), generated_logits(unsplit, ids)) <= 1e-6


def test_greedy_and_seeded_sampling_identical(unsplit, split) -> None:
    ids = unsplit.tokenize(SNIPPETS[0])
    assert list(split.generate(ids, 32, ignore_eos=True)) == list(unsplit.generate(ids, 32, ignore_eos=True))
    sampling = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.2,
                    frequency_penalty=0.3, presence_penalty=0.2, logit_bias={10: 2.0}, seed=7)
    got = list(split.generate(ids, 32, ignore_eos=True, **sampling))
    assert got == list(unsplit.generate(ids, 32, ignore_eos=True, **sampling))


def test_a_grammar_holds_through_the_split(unsplit, split) -> None:
    """Constrained decoding: the split's last stage's logits are sampled under the grammar's mask as the
    unsplit model's are (the same tokens, greedy and seeded), and the text follows the schema."""
    import json

    from ember.protocol.messages import Grammar

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    grammar = Grammar("json_schema", json.dumps(schema))
    ids = unsplit.tokenize(SNIPPETS[1])
    for sampling in ({}, dict(temperature=1.0, seed=4)):
        got = list(split.generate(ids, 80, grammar=grammar, **sampling))
        assert got == list(unsplit.generate(ids, 80, grammar=grammar, **sampling))
        assert set(json.loads(unsplit.detokenize(got))) == {"name", "n"}


def assert_served_as_unsplit(engine: EngineCore, seqs: list[Sequence], unsplit: ember.Model) -> None:
    """`seqs` run together to their ends on `engine`, none failing, each with the unsplit model's greedy tokens."""
    for seq in seqs:
        engine.add(seq)
    while engine.has_work:
        assert not engine.step().failed
    for seq in seqs:
        assert seq.generated == list(unsplit.generate(seq.prompt, seq.max_tokens, ignore_eos=True))


def mixed_sequences(model: ember.Model) -> list[Sequence]:
    """Greedy and seeded sampled ones, alternating."""
    params = SamplingParams(temperature=0.8, top_k=20)
    return [Sequence(model.tokenize(t), 16, params if i % 2 else SamplingParams(), seed=i) for i, t in enumerate(SNIPPETS)]


def test_batched_sequences_pipelined_equal_unsplit(unsplit, split) -> None:
    want, got = mixed_sequences(unsplit), mixed_sequences(unsplit)
    run_batched(unsplit, want)
    run_batched(split, got)
    assert [s.generated for s in got] == [s.generated for s in want]


@pytest.mark.parametrize("devices", ["cpu:0", "cpu:0,cpu:1"], ids=["one-worker", "two-stages-one-lane"])
def test_one_step_in_flight_gives_the_unsplit_tokens(unsplit, devices: str) -> None:
    """A model in a single worker stage (bound to one NUMA node) has one lane, and so has a split that
    the engine keeps to one step at a time: their decode bursts step through the stages."""
    model = ember.load(DEMO_MODEL, devices=devices, act_dtype="f32", max_step_tokens=STEP)
    try:
        want, got = mixed_sequences(unsplit), mixed_sequences(unsplit)
        run_batched(unsplit, want)
        run_batched(model, got, lanes=1)
        assert [s.generated for s in got] == [s.generated for s in want]
        assert all(len(s.generated) == 16 for s in got)
    finally:
        model.close()


def counting_bursts(engine: EngineCore) -> dict[str, int]:
    """How many steps the engine's scheduler planned and how many its runner ran (more: bursts)."""
    counts = {"plans": 0, "steps": 0}
    schedule, submit = engine.scheduler.schedule, engine.runner.submit

    def planned(*args, **kwargs):  # type: ignore[no-untyped-def]
        plan = schedule(*args, **kwargs)
        counts["plans"] += bool(plan.chunks)
        return plan

    def ran(*args, **kwargs):  # type: ignore[no-untyped-def]
        counts["steps"] += 1
        return submit(*args, **kwargs)

    engine.scheduler.schedule, engine.runner.submit = planned, ran  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("sampling", SAMPLING, ids=SAMPLING_IDS)
def test_decode_bursts_through_the_pipeline_give_the_tokens_of_single_steps(unsplit, split, sampling) -> None:
    """Each lane's flight goes round with its next step until its burst is through: the tokens and
    ends of one step at a time (staggered arrivals, seeded sampling with penalties over the burst's
    tokens, a stop id inside a burst, max_tokens inside one), every block back, and bursts ran."""
    prompts = [unsplit.tokenize(t) for t in SNIPPETS[:5]]
    params = SamplingParams(**sampling)

    def sequences(stop: int | None) -> list[Sequence]:
        return burst_sequences(prompts, params, stop)

    def stepped(seqs: list[Sequence], **options: float) -> dict[str, int]:
        engine = split.engine(1024, max_running=len(seqs), **options)
        counts = counting_bursts(engine)
        for step in range(10_000):
            if step in (0, 5):
                for seq in seqs[:2] if step == 0 else seqs[2:]:
                    engine.add(seq)
            elif not engine.has_work:
                assert engine.stats().kv_blocks_free == engine.blocks.n_blocks
                return counts
            assert not engine.step().failed
        raise AssertionError("did not finish")

    single = sequences(None)
    stepped(single, decode_burst=0.0)
    stop = single[1].generated[6]
    assert stop not in single[1].generated[:6]
    single, burst = sequences(stop), sequences(stop)
    stepped(single, decode_burst=0.0)
    counts = stepped(burst, decode_burst=math.inf, max_burst=4)
    assert [s.generated for s in burst] == [s.generated for s in single]
    assert [s.finish_reason for s in burst] == [s.finish_reason for s in single] == ["length", "stop"] + ["length"] * 3
    assert counts["steps"] > counts["plans"] + 10  # most decode steps went round without a plan


def test_a_sequence_cancelled_in_mid_burst_through_the_pipeline(unsplit, split) -> None:
    """Its flight stops going round: its blocks are free at once, and a sequence that arrives then
    gets them (the KV cache holds two blocks a sequence), so a step more of the burst would write into
    the newcomer's. The cancelled one takes none of the burst's tokens; the others', the newcomer's
    too, are those they get alone."""
    engine = split.engine(8 * KV_BLOCK, max_running=4, decode_burst=math.inf, max_burst=4)
    seqs = [Sequence(unsplit.tokenize(t), 16) for t in SNIPPETS[:5]]
    for seq in seqs[:4]:
        engine.add(seq)
    def early(f) -> bool:  # type: ignore[no-untyped-def]  # a burst of 4 with two steps to go at least
        return f.burst is not None and f.work.steps == 4 and f.burst.taken <= 1

    running = engine.executor._running  # its flights in the stages, in order
    while not any(early(f) for f in running):
        engine.step()
    flight = next(f for f in running if early(f))
    victim = engine._flights[id(flight.work)].plan.chunks[0].seq
    taken, steps = len(victim.generated), flight.burst.taken
    engine.abort(victim)
    engine.add(seqs[4])
    while engine.has_work:
        for out in engine.step().outputs:
            assert out.seq is not victim
        engine.blocks.check_integrity([s.table for s in engine.scheduler.running + list(engine.scheduler.waiting)])
    assert victim.finish_reason == "cancelled" and len(victim.generated) == taken
    assert flight.burst.taken == steps + 1  # the step in the stages came back; no further one started
    for seq in seqs:
        if seq is not victim:
            assert seq.generated == list(unsplit.generate(seq.prompt, 16, ignore_eos=True)), unsplit.detokenize(seq.prompt)
    assert engine.stats().kv_blocks_free == engine.blocks.n_blocks


def test_a_micro_batch_a_stage_fails_passes_the_next_and_names_that_stage(unsplit, split) -> None:
    """The stage after passes it on without running it, the last one replies for it, and the
    engine ends its sequence with the failing stage's error; the pipeline serves on."""
    engine = split.engine(256)
    split.pipeline.stages[0].send(DropCache(engine.runner.cache_id))  # stage 0 alone loses this engine's cache
    seq = Sequence(unsplit.tokenize(SNIPPETS[0]), 8)
    engine.add(seq)
    result = engine.step()
    assert [s for s, _ in result.failed] == [seq]
    assert result.failed[0][1] == f"RuntimeError: stage cpu:0 (layers 0-2): KeyError: {engine.runner.cache_id}"
    assert [stage.restarts for stage in split.pipeline.stages] == [0] * len(split.pipeline.stages)
    ids = unsplit.tokenize(SNIPPETS[1])
    assert list(split.generate(ids, 12, ignore_eos=True)) == list(unsplit.generate(ids, 12, ignore_eos=True))


def killed_mid_stream(stage: ProcessStage, engine: EngineCore, steps: int) -> list[tuple[Sequence, str]]:
    """SIGKILL a stage worker, then step the engine `steps` times: the sequences that failed, and why."""
    os.kill(stage.process.pid, signal.SIGKILL)
    failed = []
    for _ in range(steps):
        failed += engine.step().failed
    return failed


def test_the_engines_own_stage_fails_a_micro_batch_by_name_and_empties_its_caches_on_a_restart(unsplit) -> None:
    """`cpu` last: a micro-batch its stage fails ends that sequence with the stage's name; when the
    worker before it dies, every sequence in flight fails, the worker restarts and the engine's
    stage starts its caches afresh as the worker does; the split serves on with the unsplit tokens."""
    model = ember.load(DEMO_MODEL, devices="cpu:0,cpu", split=[3, 2], max_step_tokens=STEP)
    try:
        stage = model.pipeline.engine_stage
        assert stage is not None and len(model.pipeline.stages) == 1 and model.pipeline.lanes == 2
        engine = model.engine(256)
        stage.drop_cache(engine.runner.cache_id)  # this engine's micro-batches then fail in the last stage
        seq = Sequence(unsplit.tokenize(SNIPPETS[0]), 8)
        engine.add(seq)
        result = engine.step()
        assert result.failed == [(seq, f"RuntimeError: stage cpu (layers 3-4): KeyError: {engine.runner.cache_id}")]

        engine, other, seqs = engines_under_way(model, unsplit, SNIPPETS)
        before = dict(stage.caches)
        failed = killed_mid_stream(model.pipeline.stages[0], engine, 3)
        assert sorted(s.seq_id for s, _ in failed) == sorted(s.seq_id for s in seqs)
        assert all("stage cpu:0 (layers 0-2) died: killed by signal 9; restarted" in why for _, why in failed)
        assert before.keys() == stage.caches.keys() and all(stage.caches[c] is not before[c] for c in before)
        lost = other.step()
        assert len(lost.failed) == 1 and "KV cache is lost" in lost.failed[0][1]
        ids = unsplit.tokenize(SNIPPETS[4])
        assert list(model.generate(ids, 12, ignore_eos=True)) == list(unsplit.generate(ids, 12, ignore_eos=True))
    finally:
        model.close()


def test_cancelling_a_sequence_whose_step_is_in_flight(unsplit, split) -> None:
    """Two steps in flight (one per stage): a sequence cancelled between them takes nothing from the
    step that comes back, its blocks are free, and the others' tokens are those they get alone."""
    engine = split.engine(1024, max_running=4)
    seqs = [Sequence(unsplit.tokenize(t), 12) for t in SNIPPETS[:4]]
    for seq in seqs:
        engine.add(seq)
    while not all(s.generated for s in seqs):
        engine.step()
    victim = next(s for s in seqs if s.in_flight)
    taken = len(victim.generated)
    engine.abort(victim)
    while engine.has_work:
        for out in engine.step().outputs:
            assert out.seq is not victim
        running = engine.scheduler.running + list(engine.scheduler.waiting)
        engine.blocks.check_integrity([s.table for s in running])
    assert victim.finish_reason == "cancelled" and len(victim.generated) == taken
    for seq in seqs:
        if seq is not victim:
            assert seq.generated == list(unsplit.generate(seq.prompt, 12, ignore_eos=True)), unsplit.detokenize(seq.prompt)


def test_a_sequence_cancelled_while_its_failing_step_is_in_flight_is_not_failed(unsplit, split, monkeypatch) -> None:
    """Its sampling fails in the step that comes back after the cancel: it ended as cancelled, and the
    engine reports no failure of it (the daemon's engine loop no longer knows it)."""
    from test_engine_core import fail_sampling_of_min_p_half_at

    fail_sampling_of_min_p_half_at(monkeypatch, 3)  # its fourth token's sampling fails
    engine = split.engine(1024, max_running=2, decode_burst=0.0)  # a token a step: the in-flight step is known
    victim = Sequence(unsplit.tokenize(SNIPPETS[0]), 12, SamplingParams(temperature=0.8, min_p=0.5), seed=1)
    other = Sequence(unsplit.tokenize(SNIPPETS[1]), 12)
    engine.add(victim)
    engine.add(other)
    for _ in range(200):
        if victim.in_flight and len(victim.generated) == 3:
            break
        engine.step()
    assert victim.in_flight and len(victim.generated) == 3
    engine.abort(victim)
    failed = []
    while engine.has_work:
        failed += [seq for seq, _ in engine.step().failed]
    assert victim not in failed and victim.finish_reason == "cancelled"
    assert other.generated == list(unsplit.generate(other.prompt, 12, ignore_eos=True))


def test_an_engine_dropped_with_steps_in_flight_gives_its_lanes_back(unsplit, split) -> None:
    """Its runner's cache is dropped once those steps are through (not under them), and nobody
    collects them: their lanes are freed, else two such engines would leave no lane to submit in."""
    for _ in range(3):
        engine = split.engine(512, max_running=2)
        for text in SNIPPETS[:2]:
            engine.add(Sequence(unsplit.tokenize(text), 20))
        engine.step()
        assert engine._flights  # a step of it is still in the stages
        del engine
        gc.collect()
    ids = unsplit.tokenize(SNIPPETS[5])
    assert list(split.generate(ids, 12, ignore_eos=True)) == list(unsplit.generate(ids, 12, ignore_eos=True))
    assert not split.pipeline._held  # every lane free


def test_a_draft_beside_the_split_gives_the_targets_tokens(unsplit) -> None:
    """A draft model beside a split runs in the engine's process; its proposals are verified against the
    stages' logits, one step at a time (the local executor), so greedy decoding gives the unsplit
    target's tokens, alone and batched, and proposals are accepted. A DFlash draft is refused: the
    hidden states it reads stay in the stages."""
    model = ember.load(DEMO_MODEL, devices="cpu:0,cpu:1", split=[3, 2], act_dtype="f32", max_step_tokens=STEP,
                       draft=DEMO_DRAFT, draft_tokens=4)
    model.adaptive_draft = False  # every step speculates: the draft's proposals are what this test checks
    try:
        ids = unsplit.tokenize(SNIPPETS[0])
        assert list(model.generate(ids, 24, ignore_eos=True)) == list(unsplit.generate(ids, 24, ignore_eos=True))
        seqs = [Sequence(unsplit.tokenize(t), 16) for t in SNIPPETS[1:5]]
        engine = model.engine(1024, max_running=len(seqs), max_step_tokens=STEP)
        assert engine.executor.depth == 1 and engine.proposer is not None
        assert_served_as_unsplit(engine, seqs, unsplit)
        stats = model.spec_stats()
        assert stats.steps > 0 and stats.accepted > 0
    finally:
        model.close()
    with pytest.raises(ValueError, match="hidden states"):
        ember.load(DEMO_MODEL, devices="cpu:0,cpu:1", draft=DEMO_DFLASH)


def test_tiny_random_llama_split_equals_unsplit(hf_model) -> None:
    path, _ = hf_model("llama", num_hidden_layers=3)
    whole = ember.load(path)
    parts = ember.load(path, devices="cpu:0,cpu:1", split="1,2", max_step_tokens=STEP)
    try:
        ids = list(range(3, 40))
        assert rel_error(parts.logits(ids), whole.logits(ids)) <= 1e-6
        assert list(parts.generate(ids, 16, ignore_eos=True)) == list(whole.generate(ids, 16, ignore_eos=True))
        seeded = dict(temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
        assert list(parts.generate(ids, 16, **seeded)) == list(whole.generate(ids, 16, **seeded))
    finally:
        parts.close()


def test_staging_allocated_is_the_planners_figure_and_private(split) -> None:
    names = [str(spec.device) for spec in split.pipeline.specs]
    devices = [Device(name, 1 << 30) for name in names]
    request = PlanRequest.create(devices, flags=PrecisionSettings(act="f32"), split=(3, 2), prefill_chunk=STEP)
    plan = plan_model(DEMO_MODEL, request)
    # the boundary (2 slots, one per stage, x hidden 384, f32) and, from a worker, the logits rows (2
    # lanes x vocab 8192, f32); the engine's own last stage keeps its logits where it samples them
    logits = 0 if names[-1] == "cpu" else 8192
    assert [d.staging for d in plan.devices] == split.pipeline.staging_bytes == [0, 2 * STEP * (384 + logits) * 4]
    for segment in split.pipeline._segments:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{segment.name}").st_mode) == 0o600


@pytest.mark.parametrize("act_dtype", ["f16", "bf16"])
def test_narrow_staging_tracks_f32(act_dtype: str) -> None:
    """Hidden states rounded to 16 bits at the boundary, widened back before the next norm: the
    logits move by the rounding (bounded here), the greedy tokens do not. With decode_act f32: the
    q8_0 decode activations magnify the rounding into flipped near-ties on some prompts
    (docs/layer_split.md, benchmarks/layer_split.py --precision)."""
    whole = ember.load(DEMO_MODEL, decode_act="f32", prompt_act="f32", kv_dtype="f32")
    model = ember.load(DEMO_MODEL, kv_dtype="f32", devices=["cpu:0", "cpu:1"], act_dtype=act_dtype, max_step_tokens=STEP,
                       decode_act="f32", prompt_act="f32")
    try:
        assert model.pipeline.staging_bytes == [0, 2 * STEP * 384 * 2 + 2 * STEP * 8192 * 4]
        assert_narrow_staging_tracks_f32(model, whole, SNIPPETS[:2])
    finally:
        model.close()


@pytest.mark.parametrize(("devices", "split", "message"), [
    (["cpu:0", "cpu:1", "cpu:2", "cpu:3", "cpu:4", "cpu:5"], None, "6 devices .* 5 layers.*name at most 5 devices"),
    (["cpu:0", "gpu:1"], None, "unknown device in --devices: not a device: 'gpu:1'"),
    (["cpu:0", "cpu:1"], [3, 3], "split 3,3 adds up to 6 layers; the model has 5: e.g. --split 3,2"),
    (["cpu:0", "cpu:1"], [5], "gives 1 layer counts for 2 devices"),
    (["cpu:0", "cpu:1"], [5, 0], "every stage needs at least one layer"),
    (["cpu", "cpu:1"], None, "'cpu' before the last stage of a split: .* e.g. cpu:0,cpu"),
    (["cpu:0", "cpu", "cpu:1"], None, "'cpu' before the last stage of a split"),
    (["cpu:1", "cpu:1"], None, "cpu:1 named twice"),
])
def test_bad_split_specs_are_refused_with_what_to_change(devices, split, message) -> None:
    with pytest.raises(SplitSpecError, match=message):
        ember.load(DEMO_MODEL, devices=devices, split=split)


def test_a_cuda_stage_the_machine_lacks_is_refused_before_any_stage_starts() -> None:
    with pytest.raises(CudaUnavailable, match="cuda:7: (no such device|no usable CUDA device|CUDA needs numba-cuda)"):
        ember.load(DEMO_MODEL, devices=["cpu:0", "cuda:7"])


def test_a_cuda_stage_sees_its_gpu_alone(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpu(1) == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")  # cuda:N counts the GPUs the engine sees
    assert (visible_gpu(0), visible_gpu(1)) == ("2", "5")
    with pytest.raises(StageDied, match="cuda:2: CUDA_VISIBLE_DEVICES=2, 5 shows 2 GPU"):
        visible_gpu(2)


def test_stage_threads_share_the_cpus_and_never_oversubscribe_them() -> None:
    assert stage_threads_for(0, 2, 2) == 1
    assert stage_threads_for(0, 2, 16) == 8
    assert stage_threads_for(0, 3, 2) == 1  # one thread a stage never spins: allowed beyond the CPUs
    assert stage_threads_for(3, 2, 8) == 3
    with pytest.raises(SplitSpecError, match="stage_threads 2 x 2 stages is 4 kernel threads on 2 CPUs.*--stage-threads 1"):
        stage_threads_for(2, 2, 2)
    cpus = len(os.sched_getaffinity(0))
    if cpus > 1:  # refused at load, before any stage process starts
        with pytest.raises(SplitSpecError, match=f"kernel threads on {cpus} CPUs"):
            ember.load(DEMO_MODEL, devices=["cpu:0", "cpu:1"], stage_threads=cpus)


def test_stages_sharing_cpus_are_pinned_to_disjoint_ones() -> None:
    two_nodes = {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}.get
    assert stage_cpus([0, 1], 2, two_nodes) == [[0, 1], [4, 5]]  # a node each: threads CPUs of it
    assert stage_cpus([0, 0], 2, two_nodes) == [[0, 1], [2, 3]]  # one node shared out
    assert stage_cpus([0, 0], 3, two_nodes) == [[], []]  # too few CPUs for a group each: the node's binding alone
    one_node = lambda node: {0, 1}  # a 2-CPU machine: cpu:1 has no node and shares node 0's CPUs  # noqa: E731
    assert stage_cpus([0, 1], 1, one_node) == [[0], [1]]
    assert stage_cpus([0, 1, 2], 1, one_node) == [[], [], []]


def test_numa_binding_degrades_to_unbound() -> None:
    assert parse_cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    before = os.sched_getaffinity(0)
    assert bind_to_numa_node(4095) == "unbound: this machine has no NUMA node 4095"
    assert os.sched_getaffinity(0) == before
    assert pin_to_cpus([4095]).startswith("not pinned: pinning to CPUs 4095 failed")  # no such CPU
    assert os.sched_getaffinity(0) == before


def test_stages_loading_together_share_one_ready_deadline() -> None:
    """Stages load in parallel: the pipeline gives them all one deadline, READY_TIMEOUT from the start,
    so N stages that never answer fail in READY_TIMEOUT rather than N times it."""
    import time

    from ember.daemon.runner.pipeline import Pipeline
    from ember.daemon.runner.stage_process import READY_TIMEOUT

    class LoadingStage:  # records what the pipeline asks of a stage worker
        def spawn(self, upstream: object, downstream: object) -> None:
            self.links = (upstream, downstream)

        def wait_ready(self, deadline: float, tick: object) -> None:
            self.deadline = deadline

    pipeline = object.__new__(Pipeline)  # only the start of the stages, without processes
    pipeline.stages, pipeline.heartbeat = [LoadingStage() for _ in range(3)], lambda: None
    before = time.monotonic()
    pipeline._start_stages()
    after = time.monotonic()
    deadlines = {stage.deadline for stage in pipeline.stages}
    assert len(deadlines) == 1 and before + READY_TIMEOUT <= deadlines.pop() <= after + READY_TIMEOUT
    assert [stage.links[0] is None for stage in pipeline.stages] == [True, False, False]


def test_a_stage_that_dies_fails_its_sequences_and_is_restarted(unsplit, monkeypatch) -> None:
    model = ember.load(DEMO_MODEL, devices=["cpu:0", "cpu:1"], max_step_tokens=STEP)
    ticks = []
    model.pipeline.heartbeat = lambda: ticks.append(1)  # the daemon's watchdog, petted while stages load
    monkeypatch.setattr("ember.daemon.runner.stage_process.READY_TICK", 0.001)
    try:
        engine, other, seqs = engines_under_way(model, unsplit, SNIPPETS)
        stage = model.pipeline.stages[1]
        os.kill(stage.process.pid, signal.SIGKILL)
        for _ in range(3):  # a step that was done before the kill still comes back
            result = engine.step()
            if result.failed:
                break
        assert sorted(s.seq_id for s, _ in result.failed) == sorted(s.seq_id for s in seqs)
        assert all("stage cpu:1 (layers 3-4) died: killed by signal 9" in why for _, why in result.failed)
        assert all(s.finish_reason == "error" for s in seqs) and not engine.has_work
        assert stage.restarts == 1 and stage.alive()
        assert ticks  # the restart waited for the stages to load, petting the watchdog meanwhile
        lost = other.step()  # another engine over the same stages learns it at its next step
        assert len(lost.failed) == 1 and "KV cache is lost" in lost.failed[0][1]
        ids = unsplit.tokenize(SNIPPETS[4])  # and the model serves on
        assert list(model.generate(ids, 12, ignore_eos=True)) == list(unsplit.generate(ids, 12, ignore_eos=True))
    finally:
        model.close()


def test_a_stage_dead_while_idle_fails_no_request(unsplit) -> None:
    """Stage 0 killed while idle: the engine's first step finds it before it submits anything (every
    stage restarts, the cached prefixes are forgotten), and the requests that came are served as the
    unsplit model serves them; so is Model.generate, with every lane free; another engine over the
    same stages learns at its next step that its cache is gone."""
    model = ember.load(DEMO_MODEL, devices=["cpu:0", "cpu:1"], max_step_tokens=STEP)
    try:
        engine, other = model.engine(1024, max_running=4), model.engine(256)
        stage = model.pipeline.stages[0]
        os.kill(stage.process.pid, signal.SIGKILL)
        stage.process.wait()
        assert_served_as_unsplit(engine, [Sequence(unsplit.tokenize(t), 10) for t in SNIPPETS[:4]], unsplit)
        assert stage.restarts == 1 and stage.alive()
        assert_served_as_unsplit(other, [Sequence(unsplit.tokenize(SNIPPETS[4]), 10)], unsplit)
        ids = unsplit.tokenize(SNIPPETS[5])
        assert list(model.generate(ids, 6, ignore_eos=True)) == list(unsplit.generate(ids, 6, ignore_eos=True))
        assert not model.pipeline._held
    finally:
        model.close()


def test_three_stages_pipeline_three_micro_batches_and_restart_after_a_middle_death(unsplit) -> None:
    """Three lanes, so a staging slot per micro-batch in flight at each boundary; the middle stage's
    death is named (not its neighbours', whose links to it closed) and every stage restarts."""
    model = ember.load(DEMO_MODEL, devices=["cpu:0", "cpu:1", "cpu:2"], split=[2, 2, 1], max_step_tokens=STEP)
    try:
        assert model.pipeline.lanes == 3 and all(b.slots == 3 for b in model.pipeline.boundaries)
        devices = [Device(f"cpu:{i}", 1 << 30) for i in range(3)]
        plan = plan_model(DEMO_MODEL, PlanRequest.create(devices, flags=PrecisionSettings(act="f32"), split=(2, 2, 1),
                                                         prefill_chunk=STEP))
        assert [d.staging for d in plan.devices] == model.pipeline.staging_bytes == \
            [0, 3 * STEP * 384 * 4, 3 * STEP * (384 + 8192) * 4]
        want, got = mixed_sequences(unsplit), mixed_sequences(unsplit)
        run_batched(unsplit, want)
        run_batched(model, got)
        assert [s.generated for s in got] == [s.generated for s in want]

        engine = model.engine(512, max_running=3)
        seqs = [Sequence(unsplit.tokenize(t), 50) for t in SNIPPETS[:3]]
        for seq in seqs:
            engine.add(seq)
        for _ in range(4):
            engine.step()
        failed = killed_mid_stream(model.pipeline.stages[1], engine, 4)
        assert sorted(s.seq_id for s, _ in failed) == sorted(s.seq_id for s in seqs)
        assert all("stage cpu:1 (layers 2-3) died: killed by signal 9; restarted" in why for _, why in failed)
        assert [(stage.restarts, stage.alive()) for stage in model.pipeline.stages] == [(1, True)] * 3
        ids = unsplit.tokenize(SNIPPETS[4])
        assert list(model.generate(ids, 12, ignore_eos=True)) == list(unsplit.generate(ids, 12, ignore_eos=True))
    finally:
        model.close()


def test_a_stage_dead_between_steps_is_found_and_a_failed_restart_is_tried_again(unsplit, tmp_path) -> None:
    """A stage killed while the pipeline idles: the next request's step finds it first, every stage
    restarts and the request is served. A restart that fails (the model file gone) leaves the stages
    down with the reason, the request fails with it, and the next step tries again."""
    path = tmp_path / "demo.gguf"
    shutil.copy(DEMO_MODEL, path)
    model = ember.load(path, devices=["cpu:0", "cpu:1"], max_step_tokens=STEP)
    ids = unsplit.tokenize(SNIPPETS[0])
    want = list(unsplit.generate(ids, 8, ignore_eos=True))
    try:
        stage = model.pipeline.stages[1]
        os.kill(stage.process.pid, signal.SIGKILL)
        stage.process.wait()
        assert list(model.generate(ids, 8, ignore_eos=True)) == want  # found, restarted: nothing lost

        os.kill(model.pipeline.stages[0].process.pid, signal.SIGKILL)
        path.rename(tmp_path / "gone.gguf")
        with pytest.raises(RuntimeError, match=r"the layer-split stages could not be restarted \(StageDied: .*could "
                                               r"not load"):
            list(model.generate(ids, 8, ignore_eos=True))
        with pytest.raises(RuntimeError, match="could not be restarted"):  # tried again, still no file
            list(model.generate(ids, 8, ignore_eos=True))
        (tmp_path / "gone.gguf").rename(path)
        assert list(model.generate(ids, 8, ignore_eos=True)) == want
        assert all(stage.alive() for stage in model.pipeline.stages)
    finally:
        model.close()
