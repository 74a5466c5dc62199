"""The micro model on cuda:0 against the same file on the CPU: logits within float32 noise, the same
greedy tokens, every weight type read."""
from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ember

sys.path.insert(0, str(Path(__file__).parent))

from micro_model import WEIGHT_TYPES, write_micro_model  # noqa: E402

pytestmark = pytest.mark.cuda

PROMPT = [1, 17, 300, 45, 9]


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return write_micro_model(tmp_path_factory.mktemp("micro"))


@pytest.fixture(scope="module")
def pair(micro: Path) -> tuple[ember.Model, ember.Model]:
    # f32 decode and prompt activations on the CPU: the CUDA backend computes every row in float32
    return (ember.load(micro, decode_act="f32", prompt_act="f32", kv_dtype="f32"),
            ember.load(micro, device="cuda:0", kv_dtype="f32"))


def test_the_micro_model_holds_every_weight_type(micro: Path) -> None:
    from ember.daemon.loader.model_file import open_model_file

    assert {t.ttype for t in open_model_file(micro).tensors.values()} == WEIGHT_TYPES


def test_cuda_logits_equal_cpu_logits(pair: tuple[ember.Model, ember.Model]) -> None:
    cpu, gpu = pair
    assert gpu.device == "cuda:0"
    want, got = cpu.logits(PROMPT), gpu.logits(PROMPT)
    assert got.shape == want.shape == (len(PROMPT), 512)
    assert np.abs(got - want).max() <= 1e-5 * (want.max() - want.min())


def test_cuda_greedy_tokens_equal_cpu_tokens(pair: tuple[ember.Model, ember.Model]) -> None:
    cpu, gpu = pair
    want = list(cpu.generate(PROMPT[:3], max_tokens=3, ignore_eos=True))
    assert list(gpu.generate(PROMPT[:3], max_tokens=3, ignore_eos=True)) == want


def test_cuda_seeded_sampling_equals_cpu(pair: tuple[ember.Model, ember.Model]) -> None:
    """The full sampler on the device (penalties, temperature, top-k/p) draws from the request's
    generator as the host sampler does: the same seeded tokens on both devices."""
    cpu, gpu = pair
    options = dict(max_tokens=2, ignore_eos=True, temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.2, seed=7)
    assert list(gpu.generate(PROMPT[:3], **options)) == list(cpu.generate(PROMPT[:3], **options))


def test_a_hybrid_moe_model_on_cuda_equals_cpu(tmp_path: Path) -> None:
    """qwen35moe: gated attention (a strided [q | gate] split, partial rotary), Gated DeltaNet layers
    (their recurrence through the ops API's host defaults, on the device's arrays), routed experts and
    a sigmoid-gated shared expert (array broadcasting in model code)."""
    from tiny_models import QWEN35, build_hf_model

    moe = dict(QWEN35, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
               shared_expert_intermediate_size=96, vocab_size=512)
    path, _ = build_hf_model("qwen35moe", tmp_path / "hybrid", **moe)
    want = ember.load(path, decode_act="f32", prompt_act="f32", kv_dtype="f32").logits(PROMPT[:3])
    got = ember.load(path, device="cuda:0", kv_dtype="f32").logits(PROMPT[:3])
    assert np.abs(got - want).max() <= 1e-5 * (want.max() - want.min())


def test_laguna_on_cuda_equals_cpu(tmp_path: Path) -> None:
    """laguna: sliding-window layers (the window passed: 10 tokens, a window of 8), per-layer heads,
    the softplus output gate, sigmoid routing with a selection bias and soft cap, an ungated shared
    expert, through the device's kernels and the ops API's defaults."""
    from tiny_models import build_hf_model

    path, _ = build_hf_model("laguna", tmp_path / "laguna", vocab_size=512)
    prompt = PROMPT * 2
    want = ember.load(path, decode_act="f32", prompt_act="f32", kv_dtype="f32").logits(prompt)
    got = ember.load(path, device="cuda:0", kv_dtype="f32").logits(prompt)
    assert np.abs(got - want).max() <= 1e-5 * (want.max() - want.min())


class _RecordedGpus:
    """`numba.cuda.gpus` of a machine with `n` devices, for the simulator (which has one): entering
    device i pushes i on the calling thread's stack, as numba pushes device i's context."""

    def __init__(self, n: int) -> None:
        self.n, self.local = n, threading.local()

    def stack(self) -> list[int]:
        if not hasattr(self.local, "stack"):
            self.local.stack = []
        return self.local.stack

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> contextlib.AbstractContextManager[None]:
        if not 0 <= index < self.n:
            raise IndexError(index)

        @contextlib.contextmanager
        def pushed() -> Iterator[None]:
            self.stack().append(index)
            try:
                yield
            finally:
                assert self.stack().pop() == index

        return pushed()


def test_a_model_on_cuda_1_works_inside_its_device(micro: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda:1 with no CUDA_VISIBLE_DEVICES: every kernel launch and every allocation, at load and in
    each step (logits, greedy and sampled decode), happens while the calling thread has entered device
    1, which is what makes numba and CuPy work on it; and it computes what cuda:0 does. Run on the
    simulator, given a second device it lacks."""
    from numba import cuda
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    from ember.kernels.cuda.device import SIMULATOR

    if not SIMULATOR:
        pytest.skip("the simulator stands in for a second device here (a GPU test: two devices)")
    want = ember.load(micro, device="cuda:0", kv_dtype="f32")
    gpus = _RecordedGpus(2)
    outside: list[str] = []
    counts = {"launches": 0, "allocations": 0}

    def on_device(what: str, kind: str) -> None:
        counts[kind] += 1
        if gpus.stack()[-1:] != [1]:
            outside.append(f"{what} on {gpus.stack() or 'no device'}")

    launch, to_device, device_array = FakeCUDAKernel.__getitem__, cuda.to_device, cuda.device_array

    def recorded_launch(kernel: FakeCUDAKernel, config: Any) -> Any:
        on_device(kernel.py_func.__name__, "launches")
        return launch(kernel, config)

    def recorded(allocate: Any) -> Any:
        def allocation(*args: Any, **kwargs: Any) -> Any:
            on_device(allocate.__name__, "allocations")
            return allocate(*args, **kwargs)
        return allocation

    monkeypatch.setattr(cuda, "gpus", gpus)
    monkeypatch.setattr(FakeCUDAKernel, "__getitem__", recorded_launch)
    monkeypatch.setattr(cuda, "to_device", recorded(to_device))
    monkeypatch.setattr(cuda, "device_array", recorded(device_array))
    model = ember.load(micro, device="cuda:1", kv_dtype="f32")
    assert model.device == "cuda:1"
    got = model.logits(PROMPT)
    greedy = list(model.generate(PROMPT[:3], max_tokens=3, ignore_eos=True))
    options = dict(max_tokens=2, ignore_eos=True, temperature=0.9, top_k=40, seed=7)
    sampled = list(model.generate(PROMPT[:3], **options))
    assert not outside, outside[:5]
    assert counts["launches"] > 50 and counts["allocations"] > 10, counts
    monkeypatch.undo()
    assert np.array_equal(got, want.logits(PROMPT))
    assert greedy == list(want.generate(PROMPT[:3], max_tokens=3, ignore_eos=True))
    assert sampled == list(want.generate(PROMPT[:3], **options))


def test_a_model_on_a_second_gpu_equals_the_first() -> None:
    """On a machine with two GPUs: the demo on cuda:1, its weights in device 1's memory, gives cuda:0's
    logits and tokens."""
    from ember.daemon.loader.demo_model import DEMO_MODEL
    from ember.kernels.cuda.device import SIMULATOR

    from numba import cuda

    if SIMULATOR or len(cuda.gpus) < 2:
        pytest.skip("needs a machine with two CUDA devices")
    with cuda.gpus[1]:
        before = cuda.current_context().get_memory_info()[0]
    second = ember.load(DEMO_MODEL, device="cuda:1", kv_dtype="f32")
    with cuda.gpus[1]:
        assert cuda.current_context().get_memory_info()[0] < before - 8 * 2**20  # the 12 MB file's weights
    first = ember.load(DEMO_MODEL, device="cuda:0", kv_dtype="f32")
    assert np.array_equal(second.logits(PROMPT[:3]), first.logits(PROMPT[:3]))
    assert (list(second.generate(PROMPT[:3], max_tokens=8, ignore_eos=True))
            == list(first.generate(PROMPT[:3], max_tokens=8, ignore_eos=True)))
