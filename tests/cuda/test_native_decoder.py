"""daemon/runner/native_decoder.py: the trained demo model's whole decode step on the native kernels,
against the CPU model (`ember.load(...).logits`, the oracle here), run on the host harness everywhere
and on a GPU where CuPy finds one (there also captured as a CUDA graph and replayed)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ember
from ember.daemon.loader.model_file import open_model_file
from ember.daemon.runner.native_decoder import NativeDecoder, NativeDecoderUnsupported
from ember.kernels.cuda.native_launch import NativeOps
from ember.kernels.cuda.native_launch import to_host as host
from ember.kernels.sampling import SampleRow, SamplingParams
from ember.kernels.sampling_batch import SamplingBatch
from tests.cuda.native_fake_device import HarnessLauncher
from tests.cuda.conftest import gpu_ops

pytestmark = pytest.mark.cuda

NEEDS_DEVICE = False  # conftest.py: the host harness stands in for the device where there is none

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "daemon" / "assets" / "ember-demo-dense-q8_0.gguf"
MOE = ROOT / "tests" / "fixtures" / "ember-demo-moe-q8_0.gguf"


@pytest.fixture(scope="module")
def cpu_model() -> Any:
    return ember.load(str(DEMO))


TEXTS = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(",
         "import numpy as np\n\nx = np.zeros((3, 4))\nprint(x.")


@pytest.fixture(scope="module")
def prompts(cpu_model: Any) -> list[list[int]]:
    """Two prompts of the code the demo model was trained on: its predictions are confident there, so
    its argmax is a fair check (on random tokens it is a coin toss between near-equal logits)."""
    return [list(cpu_model.tokenize(text)) for text in TEXTS]


def _decode(decoder: NativeDecoder, prompts: list[list[int]], batch: int) -> list[np.ndarray]:
    """Each prompt decoded one token a step, side by side in one batch of `batch` rows (padding past
    them), sequence s in blocks 4s.. of the cache -> per prompt, its logits at every position."""
    bufs = decoder.buffers(batch)
    out: list[list[np.ndarray]] = [[] for _ in prompts]
    tables = np.array([[4 * s + j for j in range(4)] for s in range(len(prompts))])
    for p in range(max(map(len, prompts))):
        live = [s for s, prompt in enumerate(prompts) if p < len(prompt)]
        decoder.fill(bufs, np.array([prompts[s][p] for s in live]), np.full(len(live), p), tables[live])
        decoder.step(bufs)
        logits = host(bufs.logits)
        for row, s in enumerate(live):
            out[s].append(logits[row].copy())
    return [np.array(rows) for rows in out]


@pytest.mark.parametrize("kv_dtype", ["f32", "q8_0"])
def test_the_decode_step_gives_the_cpu_model_s_logits(ops: NativeOps, cpu_model: Any, kv_dtype: str,
                                                      prompts: list[list[int]]) -> None:
    decoder = NativeDecoder.from_file(open_model_file(DEMO), ops, n_blocks=8, block_size=16, kv_dtype=kv_dtype,
                                      max_context=64)
    for prompt, got in zip(prompts, _decode(decoder, prompts, 4), strict=True):
        expected = cpu_model.logits(prompt)
        errors = np.linalg.norm(got - expected, axis=1) / np.linalg.norm(expected, axis=1)
        # q8_1 activations before each matmul: about 1% of the logits' norm (the CPU's are float32 here)
        assert errors.max() < 0.04 and errors.mean() < 0.015, errors
        assert np.mean(got.argmax(axis=1) == expected.argmax(axis=1)) >= 0.9


def test_more_than_8_rows_of_a_bucket_compute_as_smaller_batches_do(lib) -> None:  # type: ignore[no-untyped-def]
    """The 16- and 32-row buckets: their GEMVs launch 8 rows at a time; ten sequences decoded in one step
    give bit for bit what two steps of five give."""
    rng = np.random.default_rng(3)
    ids, positions = rng.integers(5, 8000, 10), np.zeros(10, np.int64)
    tables = np.arange(10)[:, None]

    def decoder() -> NativeDecoder:
        return NativeDecoder.from_file(open_model_file(DEMO), NativeOps(np, HarnessLauncher(lib)), n_blocks=10,
                                       block_size=16, kv_dtype="f16", max_context=16)

    together = host(decoder().forward(ids, positions, tables, np.arange(10)))
    apart = decoder()
    halves = [host(apart.forward(ids[h], positions[h], tables[h], np.arange(5))) for h in (slice(0, 5), slice(5, 10))]
    assert np.array_equal(together, np.concatenate(halves))


def test_padding_rows_leave_the_real_rows_as_a_smaller_batch_computes_them(  # type: ignore[no-untyped-def]
        lib, prompts) -> None:
    ops = NativeOps(np, HarnessLauncher(lib))
    small, padded = (_decode(NativeDecoder.from_file(open_model_file(DEMO), ops, n_blocks=8, block_size=16,
                                                     kv_dtype="f16", max_context=64), prompts, batch)
                     for batch in (2, 5))
    for a, b in zip(small, padded, strict=True):
        assert np.array_equal(a, b)


def test_a_whole_step_launches_the_same_way_at_every_position(lib) -> None:  # type: ignore[no-untyped-def]
    launcher = HarnessLauncher(lib)
    decoder = NativeDecoder.from_file(open_model_file(DEMO), NativeOps(np, launcher), n_blocks=8, block_size=16,
                                      kv_dtype="q8_0", max_context=64)
    bufs = decoder.buffers(2)
    rows = [SampleRow(k, SamplingParams(temperature=0.8, top_p=0.9), np.random.default_rng(k)) for k in range(2)]
    traces = []
    for p in range(3):
        decoder.fill(bufs, np.array([11 + p, 99 + p]), np.array([p, p + 20]), np.array([[0, 1], [2, 3]]))
        bufs.sampling.fill(np, SamplingBatch.of(rows))
        del launcher.launches[:]
        decoder.step(bufs, sample=True)
        traces.append(list(launcher.launches))
    assert traces[0] == traces[1] == traces[2]
    layers = decoder.config.n_layers
    assert len(traces[0]) == 1 + 13 * layers + 2 + 3  # embed; 13 a layer; final norm, output; the sampler


def test_the_step_samples_on_the_device(lib) -> None:  # type: ignore[no-untyped-def]
    decoder = NativeDecoder.from_file(open_model_file(DEMO), NativeOps(np, HarnessLauncher(lib)), n_blocks=4,
                                      block_size=16, max_context=32)
    bufs = decoder.buffers(3)
    decoder.fill(bufs, np.array([5, 6, 7]), np.array([0, 0, 0]), np.array([[0], [1], [2]]))
    rows = SamplingBatch.of([SampleRow(k, SamplingParams(), np.random.default_rng(k)) for k in range(3)])
    bufs.sampling.fill(np, rows)
    decoder.step(bufs, sample=True)
    assert [c.token for c in bufs.sampling.choices(rows)] == list(bufs.logits.argmax(axis=1))


def test_what_the_native_step_cannot_run_is_refused(lib) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(NativeDecoderUnsupported, match="dense"):
        NativeDecoder.from_file(open_model_file(MOE), NativeOps(np, HarnessLauncher(lib)), n_blocks=4)
    decoder = NativeDecoder.from_file(open_model_file(DEMO), NativeOps(np, HarnessLauncher(lib)), n_blocks=4,
                                      max_context=32)
    with pytest.raises(ValueError, match="1 to 32 rows"):
        decoder.buffers(33)
    bufs = decoder.buffers(1)
    with pytest.raises(ValueError, match="context"):
        decoder.fill(bufs, np.array([1]), np.array([32]), np.array([[0, 1]]))


def test_a_captured_step_of_the_model_replays_at_new_positions(prompts: list[list[int]]) -> None:
    """On a GPU: the whole step captured once, then replayed for the next positions of two sequences,
    gives what the eager step gives."""
    ops = gpu_ops()
    import cupy  # noqa: PLC0415

    eager_decoder, graph_decoder = (NativeDecoder.from_file(open_model_file(DEMO), ops, n_blocks=8, block_size=16,
                                                            kv_dtype="q8_0", max_context=64) for _ in range(2))
    eager, replayed = eager_decoder.buffers(2), graph_decoder.buffers(2)
    tables = np.array([[0, 1], [2, 3]])
    graph_decoder.fill(replayed, np.array([1, 2]), np.array([0, 0]), tables)
    graph_decoder.step(replayed)  # compiles every kernel before the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        graph_decoder.step(replayed)
        graph = stream.end_capture()
    for p in range(8):
        ids, positions = np.array([prompts[0][p], prompts[1][p]]), np.array([p, p])
        eager_decoder.fill(eager, ids, positions, tables)
        eager_decoder.step(eager)
        graph_decoder.fill(replayed, ids, positions, tables)
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_allclose(host(replayed.logits), host(eager.logits), rtol=1e-5, atol=1e-5)


SNIPPETS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Parser:\n    def __init__(self, text):",
            "for i in range(10):\n    print("]


def test_the_engine_serves_requests_on_the_native_runner(ops: NativeOps, cpu_model: Any) -> None:
    """EngineCore over a NativeRunner: staggered greedy requests (prompts prefilled in chunks through
    GEMMs, decode rows through the static step, side by side). Teacher-forced on the CPU model, every
    token the native runner chose is the CPU's argmax, or within a near-tie of it (the native step's
    q8_1 activations move logits by ~1%); most are the argmax itself. A sampled request draws."""
    from ember.daemon.engine.engine_core import EngineCore  # noqa: PLC0415
    from ember.daemon.engine.sequence import Sequence  # noqa: PLC0415
    from ember.daemon.runner.native_runner import NativeRunner  # noqa: PLC0415

    mf = open_model_file(DEMO)
    decoder = NativeDecoder.from_file(mf, ops, n_blocks=32, block_size=16, kv_dtype="f16", max_context=512)
    engine = EngineCore(NativeRunner(decoder, mf.config), max_step_tokens=12)
    prompts = [list(cpu_model.tokenize(s)) for s in SNIPPETS]
    seqs = [Sequence(p, max_tokens=12) for p in prompts]
    sampled = Sequence(prompts[0], max_tokens=6, params=SamplingParams(temperature=0.8, top_p=0.9), seed=3)
    arrivals = {0: [seqs[0], sampled], 2: [seqs[1]], 4: [seqs[2], seqs[3]]}
    for step in range(500):
        for seq in arrivals.get(step, []):
            engine.add(seq)
        if not engine.has_work and step > 4:
            break
        engine.step()
    exact = 0
    for seq, prompt in zip(seqs, prompts, strict=True):
        tokens = list(seq.generated)
        assert len(tokens) == 12
        logits = cpu_model.logits(prompt + tokens[:-1])[len(prompt) - 1:]
        for row, token in zip(logits, tokens, strict=True):
            assert row.max() - row[token] <= 0.02 * (row.max() - row.min())
            exact += int(token == row.argmax())
    assert exact >= 0.9 * 12 * len(seqs)
    assert len(sampled.generated) == 6


def test_a_greedy_burst_on_the_device_takes_the_step_by_step_argmax(ops: NativeOps, prompts: list[list[int]]) -> None:
    """NativeDecoder.greedy_burst (the argmax taken by the device's sampler, each step's token the next
    one's input) gives the tokens of stepping forward() and taking the host argmax; a row that meets
    its stop id keeps it as input, and the burst ends when every row has. On a GPU the burst's steps
    are graph replays, forward()'s too."""
    def decoder() -> NativeDecoder:
        return NativeDecoder.from_file(open_model_file(DEMO), ops, n_blocks=8, block_size=16, kv_dtype="f16",
                                       max_context=64)

    tables = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    lengths = [len(p) for p in prompts]
    stepped, burst = decoder(), decoder()
    def prefill(d: NativeDecoder) -> None:  # both prompts' K/V but their last tokens
        for s, prompt in enumerate(prompts):
            n = len(prompt) - 1
            d.forward(np.array(prompt[:-1]), np.arange(n), np.repeat(tables[s:s + 1], n, 0), np.zeros(0, np.int64))

    for d in (stepped, burst):
        prefill(d)
    cur, expected = np.array([p[-1] for p in prompts]), []
    for j in range(10):
        logits = stepped.forward(cur, np.array(lengths) - 1 + j, tables, np.arange(2))
        cur = host(logits).argmax(axis=1)
        expected.append(cur)
    got = burst.greedy_burst(np.array([p[-1] for p in prompts]), np.array(lengths) - 1, tables, 10,
                             [frozenset(), frozenset()])
    assert np.array_equal(got, np.array(expected))
    stop = int(expected[2][0])  # row 0 stops at its third token; row 1 never does: all 10 steps run
    again = decoder()
    prefill(again)
    stopped = again.greedy_burst(np.array([p[-1] for p in prompts]), np.array(lengths) - 1, tables, 10,
                                 [frozenset({stop}), frozenset({-5})])
    assert stopped.shape == (10, 2) and np.array_equal(stopped[:3, 0], np.array(expected)[:3, 0])
    assert np.array_equal(stopped[:, 1], np.array(expected)[:, 1])


SAMPLING_CASES = {
    # with a row asking for top alternatives, steps sample through DeviceSampling (and that row on the host)
    "device": [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
               SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={13: 2.0}),
               SamplingParams(), SamplingParams(temperature=0.7, logprobs=2)],
    # without one, decode steps sample inside the step (its graph, on a GPU)
    "in-step": [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
                SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={13: 2.0}),
                SamplingParams(), SamplingParams(temperature=0.7, top_p=0.5)],
}


@pytest.mark.parametrize("case", SAMPLING_CASES)
def test_sampling_on_the_device_draws_what_the_host_sampler_draws(ops: NativeOps, cpu_model: Any, case: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The native runner sampling on the device (its logits never leave it) against the same runner
    sampling every row on the host: seeded requests with temperature, top-k/p, min-p, penalties and
    logit bias, a greedy one beside them, give the same tokens and logprobs, whether the step's rows
    sample through DeviceSampling or inside the step."""
    from ember.daemon.engine.engine_core import EngineCore  # noqa: PLC0415
    from ember.daemon.engine.sequence import Sequence  # noqa: PLC0415
    from ember.daemon.runner.native_runner import NativeRunner  # noqa: PLC0415

    mf = open_model_file(DEMO)
    prompts = [list(cpu_model.tokenize(s)) for s in SNIPPETS]
    in_step = []
    sample_step = NativeDecoder.sample_step
    monkeypatch.setattr(NativeDecoder, "sample_step", lambda *a, **k: in_step.append(1) or sample_step(*a, **k))
    runs = []
    for device_sampling in (True, False):
        decoder = NativeDecoder.from_file(mf, ops, n_blocks=32, block_size=16, kv_dtype="f16", max_context=512)
        engine = EngineCore(NativeRunner(decoder, mf.config, device_sampling=device_sampling), max_step_tokens=16)
        seqs = [Sequence(p, max_tokens=10, params=o, seed=7 + k, wants_logprob=True)
                for k, (p, o) in enumerate(zip(prompts, SAMPLING_CASES[case], strict=True))]
        for seq in seqs:
            engine.add(seq)
        while engine.has_work:
            engine.step()
        runs.append([(list(s.generated), [c.logprob for c in s.choices]) for s in seqs])
    for (tokens, logprobs), (host_tokens, host_logprobs) in zip(*runs, strict=True):
        assert tokens == host_tokens
        np.testing.assert_allclose(logprobs, host_logprobs, rtol=1e-5, atol=1e-5)
    assert len({tuple(t) for t, _ in runs[0]}) == len(SNIPPETS)
    assert bool(in_step) == (case == "in-step")


def test_a_model_on_the_native_kernels_generates_and_scores_as_the_cpu_model(ops: NativeOps,
                                                                            cpu_model: Any) -> None:
    """ember's Model with cuda_kernels "native" (what `ember serve --cuda-kernels native` loads): its
    generate() (greedy bursts on the device, a sampled request beside) and logits() follow the CPU
    model's; what it cannot run is refused with the reason."""
    from ember.daemon.runtime import Model  # noqa: PLC0415
    from ember.daemon.text.text_model import tokenizer_of  # noqa: PLC0415

    mf = open_model_file(DEMO)
    model = Model(mf, tokenizer_of(mf), "cuda:0", "f16", cuda_kernels="native", native_ops=ops)
    prompt = list(cpu_model.tokenize(TEXTS[1]))
    tokens = list(model.generate(prompt, max_tokens=12, ignore_eos=True))
    expected = cpu_model.logits(prompt + tokens[:-1])[len(prompt) - 1:]
    assert all(row.max() - row[t] <= 0.02 * (row.max() - row.min()) for row, t in zip(expected, tokens, strict=True))
    got = model.logits(prompt)
    reference = cpu_model.logits(prompt)
    assert np.linalg.norm(got - reference) <= 0.01 * np.linalg.norm(reference)  # one chunk through the GEMMs
    sampled = list(model.generate(prompt, max_tokens=6, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True))
    assert len(sampled) == 6
    with pytest.raises(ValueError, match="native CUDA kernels hold"):
        model.net  # noqa: B018 - the property raises
    with pytest.raises(ValueError, match="decode_act"):
        Model(mf, tokenizer_of(mf), "cuda:0", decode_act="f32", cuda_kernels="native", native_ops=ops)
    with pytest.raises(ValueError, match="layer split"):
        ember.load(str(DEMO), devices="cuda:0,cpu", cuda_kernels="native")
    with pytest.raises(ValueError, match="cuda_kernels"):
        ember.load(str(DEMO), cuda_kernels="fast")


def test_a_model_on_cuda_1_launches_every_native_kernel_inside_its_device(lib, cpu_model: Any) -> None:  # type: ignore[no-untyped-def]
    """cuda:1: the weights' upload, each engine's cache and every step (prompt GEMMs, greedy bursts,
    a sampled request) launch while the calling thread is inside the ops' device scope (on a GPU,
    cupy.cuda.Device(1): CuPy's current device is per thread)."""
    from ember.daemon.runtime import Model  # noqa: PLC0415
    from ember.daemon.text.text_model import tokenizer_of  # noqa: PLC0415

    depth, outside, launched = [0], [], []
    harness = HarnessLauncher(lib)

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1

    def launcher(kernel: Any, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple[Any, ...]) -> None:
        (launched if depth[0] else outside).append(kernel.name)
        harness(kernel, grid, block, args)

    mf = open_model_file(DEMO)
    model = Model(mf, tokenizer_of(mf), "cuda:1", "f16", cuda_kernels="native",
                  native_ops=NativeOps(np, launcher, scope))
    assert model.device == "cuda:1"
    prompt = list(cpu_model.tokenize(TEXTS[1]))
    assert len(list(model.generate(prompt, max_tokens=4, ignore_eos=True))) == 4
    assert len(list(model.generate(prompt, max_tokens=2, temperature=0.8, seed=1, ignore_eos=True))) == 2
    assert not outside, sorted(set(outside))
    assert len(launched) > 100


def test_a_step_allocates_and_copies_nothing(  # type: ignore[no-untyped-def]
        lib, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a decode step (what a graph captures) no array is made or copied: with numpy as the array
    module, every allocating numpy function raises while the step runs, sampler included."""
    decoder = NativeDecoder.from_file(open_model_file(DEMO), NativeOps(np, HarnessLauncher(lib)), n_blocks=4,
                                      block_size=16, kv_dtype="q8_0", max_context=32)
    bufs = decoder.buffers(2)
    decoder.fill(bufs, np.array([5, 6]), np.array([0, 3]), np.array([[0, 1], [2, 3]]))
    bufs.sampling.fill(np, SamplingBatch.of([SampleRow(k, SamplingParams(temperature=0.7), np.random.default_rng(k))
                                            for k in range(2)]))

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an array was allocated inside the step")

    for name in ("zeros", "empty", "ones", "full", "array", "asarray", "ascontiguousarray", "copy", "concatenate",
                 "zeros_like", "empty_like", "full_like", "stack"):
        monkeypatch.setattr(np, name, refuse)
    decoder.step(bufs, sample=True)
    monkeypatch.undo()
    assert (bufs.sampling.tokens >= 0).all()
