"""The CPU kernels' compile cache, filled by child processes so that every process runs cached code.

numba does not run the same machine code for a kernel that this process compiled and for one it loaded
from its on-disk cache: a cached library carries its own copies of the functions it calls (the
parallel loop body, the per-row dot products), optimized again together with the caller, while a
process that has just compiled them calls the separately compiled ones. Measured on the 2-core
development VM: the Q8_0 matvec ran 2x faster loaded from the cache, and the logits differed in their
last bits — the first process after an install or a kernel change computed differently, and more
slowly, than every later one.

`ensure_kernel_cache()` makes every process a "later one": when the cache is not known to be complete,
child processes compile every kernel signature the runtime uses (a forward pass of a small synthetic
model with every weight type and KV dtype, through both variants of each twin kernel) and leave a
stamp; this process then only ever loads. A lock keeps concurrent starts from compiling twice.

The compile comes in two tiers (kernels/cpu/kernel_tiers.py). The first (FIRST_TIER) is every op run
op by op, each twin in its serial variant: about 30 s of the 2-core VM's 2-3 minutes. A daemon
(`whole=False`) serves once it is cached, with those kernels alone, while a thread of its own
(complete_in_background) has the second tier (PARTS: the parallel variants, the fused layers, the
greedy bursts) compiled by children at the lowest CPU priority, and then runs every kernel. The tiers
compute the same bits, so the switch changes the speed of a step, never a token. A stamp marks each
tier done.

Each tier is cut into parts that children compile side by side, as many at once as this
process has cores: numba compiles on one thread, and a part's kernels are mostly other functions than
another part's. numba's cache writes are not safe between processes (a save reads a function's index,
picks a free data file and writes the index back: two at once can lose an entry or share a file), so
the children take a lock around each save. A last child then runs every part once more: it loads
what the parts wrote and compiles whatever they missed, so the cache is complete however the parts
were cut.

Before the first tier compiles, every cached kernel is removed. numba checks a cache entry against its own
source file only: a fused kernel in decoder_layer.py that inlined quant_matmul.py's matvec kept the
old matvec's code after quant_matmul.py changed (seen: a 1.75x faster matvec that the fused layers
did not get). The stamp names every kernel source, so a change to any of them recompiles them all.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import llvmlite.binding as llvm
import numba
import numpy as np

_CHILD_TIMEOUT = 1800.0  # seconds: one child compiling everything took 6-9 minutes on the 2-core VM, once


def ensure_kernel_cache(on_compile: Callable[[int, int], None] = lambda done, total: None, *,
                        whole: bool = True, background: bool = False) -> bool:
    """Fill numba's cache for the CPU kernels in child processes unless it is known to be complete
    (whole=False: unless its first tier is; kernels/cpu/kernel_tiers.py). When it compiles, it reports
    its progress as on_compile(children done, children in all): (0, total) first, then as each child
    finishes (a long first start shows how far it got). Returns whether it compiled. background:
    the children run at the lowest CPU priority (a daemon serving beside them keeps the cores).
    A failure to compile in a child raises RuntimeError (with the child's output); this process
    would fail the same way."""
    stamp = _stamp_path()
    first = _first_tier_stamp(stamp)
    if stamp.exists() or (not whole and first.exists()):
        return False
    with open(stamp.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling: wait for it
        if stamp.exists() or (not whole and first.exists()):
            return False
        tiers = ([] if first.exists() else [FIRST_TIER]) + ([PARTS] if whole else [])
        cores = len(os.sched_getaffinity(0))
        total = sum(_children(parts, cores) for parts in tiers)
        on_compile(0, total)
        done = 0
        for parts in tiers:
            if parts is FIRST_TIER:
                _remove_cached_kernels(stamp.parent)
            report = _compile_in_children(cores, parts, lambda n, _: n and on_compile(done + n, total), background)
            done += _children(parts, cores)
            (first if parts is FIRST_TIER else stamp).write_text(
                f"compiled by child processes (ember/daemon/runner/kernel_cache.py); {report}\n")
    return True


def kernel_cache_complete() -> bool:
    """Both tiers are in the cache: a process may run every kernel."""
    return _stamp_path().exists()


def complete_in_background(on_done: Callable[[], None], on_failed: Callable[[str], None]) -> threading.Thread:
    """The cache completed (its second tier compiled, or waited for where another process compiles
    it) by a thread of this process, its children at the lowest CPU priority, then on_done(); or
    on_failed(the error) if a child failed, this process then keeping to the first tier. The children
    die with this process (a daemon stopped mid-compile leaves the rest to its next start)."""
    def complete() -> None:
        try:
            ensure_kernel_cache(background=True)
        except Exception as err:  # noqa: BLE001 (a thread: its caller hears of any failure)
            on_failed(f"{type(err).__name__}: {err}")
            return
        on_done()

    thread = threading.Thread(target=complete, name="ember-kernel-cache", daemon=True)
    thread.start()
    return thread


def _children(parts: Sequence[str], cores: int) -> int:
    """How many children compile `parts`: one a part, side by side, then the last; the last alone on one core."""
    return len(parts) + 1 if cores > 1 else 1


def _compile_in_children(cores: int, parts: Sequence[str], progress: Callable[[int, int], None],
                         background: bool = False) -> str:
    """`parts` in children, `cores` at a time, then one child that runs them all (loading, and
    compiling what is missing) -> that child's report; progress(done, total) as they finish.
    RuntimeError with a failed child's output (the other children are stopped)."""
    waiting = [[part] for part in parts] if cores > 1 else []
    running: list[_Child] = []
    total = _children(parts, cores)
    progress(0, total)
    try:
        while waiting or running:
            while waiting and len(running) < cores:
                running.append(_Child(waiting.pop(0), background))
            done = next((child for child in running if child.process.poll() is not None or child.overdue()), None)
            if done is None:
                time.sleep(0.1)
                continue
            running.remove(done)
            done.finish()
            progress(total - 1 - len(waiting) - len(running), total)
        lines = _Child([_LAST, *parts], background).finish().splitlines()
        progress(total, total)
        return next((line for line in reversed(lines) if line.startswith(_REPORT)), "no report from the last child")
    finally:
        for child in running:
            child.process.kill()
            child.process.wait()


class _Child:
    """A child compiling `parts`; its output goes to a file, not a pipe that could fill while this
    process waits on another child."""

    def __init__(self, parts: list[str], background: bool = False) -> None:
        self.parts = parts
        self.output = tempfile.TemporaryFile("w+")
        # its stdin is a pipe that only this process writes to: it ends when this process does, however
        # it ends, and the child then exits (_exit_with_parent)
        self.process = subprocess.Popen([sys.executable, "-m", "ember.daemon.runner.kernel_cache",
                                         *([_NICE] if background else []), *parts],
                                        stdin=subprocess.PIPE, stdout=self.output, stderr=subprocess.STDOUT, text=True)
        self.deadline = time.monotonic() + _CHILD_TIMEOUT

    def overdue(self) -> bool:
        return time.monotonic() > self.deadline

    def finish(self) -> str:
        """Wait for it -> its output; RuntimeError if it failed or outran _CHILD_TIMEOUT."""
        try:
            self.process.wait(timeout=max(self.deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdin.close()
        with self.output:
            self.output.seek(0)
            output = self.output.read()
        if self.process.returncode != 0:
            raise RuntimeError(f"compiling the CPU kernels failed ({' '.join(self.parts)}):\n{output}")
        return output


@functools.cache  # the sources and versions it hashes do not change while a process runs
def _stamp_path() -> Path:
    """A stamp beside numba's cache files, named for everything a cached kernel depends on."""
    from ember.kernels.cpu import quant_matmul

    sources = sorted(Path(quant_matmul.__file__).parent.glob("*.py"))
    digest = hashlib.sha256()
    cpu = f"{llvm.get_host_cpu_name()} {llvm.get_host_cpu_features().flatten()}"  # numba's cache is per CPU too
    for part in (numba.__version__, np.__version__, sys.version, cpu, *(p.read_bytes() for p in sources)):
        digest.update(part if isinstance(part, bytes) else part.encode())
    cache_dir = Path(quant_matmul._matmul._cache._cache_path)  # where numba keeps this module's kernels
    cache_dir.mkdir(parents=True, exist_ok=True)
    return cache_dir / f"ember-kernels-{digest.hexdigest()[:16]}.stamp"


def _first_tier_stamp(stamp: Path) -> Path:
    return stamp.with_suffix(".first-tier.stamp")


def _remove_cached_kernels(cache_dir: Path) -> None:
    """numba's index and data files and the stamps of earlier kernel sources: compiled anew from here."""
    for pattern in ("*.nbi", "*.nbc", "ember-kernels-*.stamp"):
        for path in cache_dir.glob(pattern):
            path.unlink(missing_ok=True)


def compile_all(parts: Sequence[str] = ()) -> None:
    """Run every kernel signature the runtime uses (or those of `parts`): a small model whose layers
    cover every weight type, a prompt and a decode step in every KV dtype, once with the serial and
    once with the parallel variant of each twin kernel."""
    for part in parts or _PARTS:
        _PARTS[part]()


def _first_tier_layers() -> None:
    """The first tier's layers (kernel_tiers.py): the synthetic model's prompt and decode steps in
    every KV dtype, op by op, every twin serial (the fused layers' data is made, never run)."""
    from ember.kernels.cpu import kernel_tiers

    kernel_tiers.use_first_tier()
    _forward_passes(None)


def _first_tier_others() -> None:
    """The first tier's other kernels: the hybrid models' and the MoE layers' decode kernel, serial."""
    from ember.kernels.cpu import kernel_tiers

    kernel_tiers.use_first_tier()
    _linear_attention_kernels()
    _expert_kernels(synthetic_model())


def _serial_kernels() -> None:
    """Every twin's serial variant, the fused layers' serial kernel, the MoE layers' decode kernel (one
    signature for both variants: it picks them itself), the hybrid models' serial kernels."""
    net = _forward_passes("serial")
    _linear_attention_kernels()
    _expert_kernels(net)


def _parallel_kernels() -> None:
    """Every twin's parallel variant, the fused layers' thread team and the greedy burst (which runs
    that team), the hybrid models' parallel kernels."""
    _forward_passes("parallel")
    _linear_attention_kernels()
    _greedy_kernels()


def _forward_passes(variant: str | None):  # type: ignore[no-untyped-def]
    """The synthetic model's prompt and decode steps in every KV dtype, every twin taking `variant`
    (None: as each picks)."""
    from ember.daemon.step.step_batch import StepBatch
    from ember.kernels.cpu import twin
    from ember.kernels.convert import KV_DTYPES

    twin.FORCE = variant
    net, gemma4 = synthetic_model(), _cache_gemma4()
    for dtype in KV_DTYPES:
        for model, cache in ((net, net.new_cache(2, 16, dtype)),
                             (gemma4, gemma4.new_cache(16, 16, dtype, max_sequences=2, step_tokens=16))):
            model.forward(StepBatch.build([([1, 2, 3, 4, 5], 0, [0, 1])], 16, all_logits=True), cache)
            model.forward(StepBatch.build([([6], 5, [0, 1])], 16, prompt_lengths=[5]), cache)  # one generated token
            model.forward(StepBatch.build([([7], 6, [0, 1]), ([8, 9], 0, [1])], 16, prompt_lengths=[5, 2]), cache)
            model.forward(StepBatch.build([([7], 6, [0, 1]), ([8], 1, [1])], 16, prompt_lengths=[5, 2]), cache)
    net.ops.prompt_act = "q8_0"  # prompt rows through kernels/cpu/int8_prompt.py (the prompt_act policy)
    net.forward(StepBatch.build([([1, 2, 3, 4, 5], 0, [0, 1])], 16, all_logits=True), net.new_cache(2, 16))
    net.ops.prompt_act = "f32"
    return net


def _greedy_kernels() -> None:
    """A greedy decode burst (kernels/cpu/greedy_decode.py) of a model whose every layer is fused: one
    signature for any depth and weight types (its layers go in a typed List), and its n-gram lookup
    burst; a Gemma 4's (kernels/cpu/sandwich_stack.py), one for any Gemma 4."""
    from ember.daemon.step.step_batch import StepBatch
    from ember.kernels.tensor_types import TensorType as T

    net = synthetic_model([T.Q8_0, T.Q4_K])
    cache = net.new_cache(2, 16, "f32")
    batch = StepBatch.build([([6], 5, [0, 1])], 16, prompt_lengths=[5])
    if net.greedy_steps(batch, cache, 2, np.full((1, 1), -1, np.int64)) is None:
        raise RuntimeError("the kernel cache's model takes no greedy decode bursts")
    history = np.zeros(16, np.int32)  # ... 2, 6 | 1, 2, 6: the last 2-gram occurred before
    history[:6] = [2, 6, 1, 2, 2, 6]
    if net.lookup_steps(batch, cache, 3, 2, 2, 4, history, 6, np.full(1, -1, np.int64)) is None:
        raise RuntimeError("the kernel cache's model takes no n-gram lookup bursts")
    gemma4 = _cache_gemma4()  # sandwich_stack.py's burst
    cache = gemma4.new_cache(16, 16, "f32", max_sequences=2, step_tokens=16)
    gemma4.forward(StepBatch.build([([1, 2, 3, 4, 5], 0, [0, 1])], 16), cache)
    if gemma4.greedy_steps(batch, cache, 2, np.full((1, 1), -1, np.int64)) is None:
        raise RuntimeError("the kernel cache's Gemma 4 takes no greedy decode bursts")


def _linear_attention_kernels() -> None:
    """The hybrid models' kernels (conv1d, delta rule, output gate) on a prompt step and a decode step,
    with the argument types the model passes them; laguna's output gate."""
    from ember.kernels.cpu.backend import CpuOps

    ops, rng = CpuOps(), np.random.default_rng(0)
    hk, hv, dk, dv, taps = 1, 2, 8, 8, 4
    channels = 2 * hk * dk + hv * dv
    conv_states, delta_states = ops.zeros((2, taps - 1, channels)), ops.zeros((2, hv, dk, dv))
    w, A, dt_bias = ops.zeros((channels, taps)), -np.ones(hv, np.float32), ops.zeros((hv,))
    for lengths, first in (([5], [0]), ([1, 1], [5, 0])):
        n = sum(lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        slots = np.arange(len(lengths), dtype=np.int64)
        positions = np.concatenate([np.arange(p, p + m) for p, m in zip(first, lengths)]).astype(np.int64)
        x = rng.standard_normal((n, channels)).astype(np.float32)
        mixed = ops.causal_conv1d(x, w, conv_states, starts, slots, positions)
        ab = ops.zeros((n, hv))
        for tiled in (False, True):
            ops.gated_delta_net(mixed, ab, ab, A, dt_bias, delta_states, starts, slots, positions, hk, dk, tiled)
        ops.sigmoid_mul(x, x)
    ops.softplus_gate(ops.zeros((2, 2, 4)), ops.zeros((2, 2)))  # laguna's output gate, op by op (prompt rows)


def _expert_kernels(net) -> None:  # type: ignore[no-untyped-def]
    """MoE layers' kernels, with the synthetic model's dense FFNs standing in for experts: the routing
    (softmax and sigmoid), the experts of a decode step in one call, and router, routing and experts
    in one call (one compiled signature whatever the router's type)."""
    from ember.kernels.ops import ExpertWeights, Routing
    from ember.kernels.raw_tensor import RawTensor
    from ember.kernels.tensor_types import TensorType

    experts = {e: ExpertWeights(b.ffn.gate, b.ffn.up, b.ffn.down) for e, b in enumerate(net.blocks[:4])}
    x = np.ones((2, net.config.hidden), np.float32)
    token, expert, weight = np.array([0, 0, 1, 1]), np.array([0, 1, 1, 3]), np.ones(4, np.float32)
    net.ops.expert_ffn(x, experts, token, expert, weight, np.ones(2, bool))
    table = net.ops.expert_table(experts, len(experts))
    f32 = np.zeros((len(experts), net.config.hidden), np.float32)
    router = net.ops.weight(RawTensor("router", TensorType.F32, f32.shape, f32))
    for routing in (Routing(2, True), Routing(2, True, "sigmoid", np.zeros(len(experts), np.float32), 1.0, 2.0)):
        net.ops.route(np.zeros((2, len(experts)), np.float32), *routing)
        net.ops.routed_ffn(x, router, table, routing, np.ones(2, bool))


def synthetic_model(types: Sequence[int] | None = None, arch: str = "qwen3"):  # type: ignore[no-untyped-def]
    """A small Transformer of random weights, layer i stored in types[i] (default: every weight type,
    so every kernel runs). qwen3 has q/k norms, qwen2 q/k/v biases, llama neither; laguna q/k norms,
    4 or 8 query heads by layer, partial rotary, an output gate of a value a head or an element by
    layer, and a sliding window of 3 keys on every other layer (with a rope of its own). Tests build
    models from it too."""
    from ember.daemon.loader.model_config import ModelConfig
    from ember.daemon.loader.model_file import ModelFile
    from ember.daemon.models.transformer import Transformer
    from ember.kernels import get_ops
    from ember.kernels.reference.quant import quantize
    from ember.kernels.raw_tensor import RawTensor
    from ember.kernels.tensor_types import TensorType as T

    types = [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.F16, T.BF16, T.F32] if types is None else [T(t) for t in types]
    laguna = arch == "laguna"
    cfg = ModelConfig(arch=arch, n_layers=len(types), hidden=256, n_heads=8 if laguna else 4, n_kv_heads=2,
                      head_dim=64, ffn=256, vocab=64, context_length=64, rope_theta=10000.0, norm_eps=1e-6,
                      **(dict(layer_heads=tuple(4 + 4 * (i % 2) for i in range(len(types))), rope_dim=32,
                              sliding_layers=tuple(i % 2 == 1 for i in range(len(types))), sliding_window=3,
                              rope_theta_swa=5000.0) if laguna else {}))
    rng = np.random.default_rng(0)
    tensors: dict[str, RawTensor] = {}

    def add(name: str, ttype: T, *shape: int) -> None:
        data = quantize(ttype, rng.standard_normal(shape).astype(np.float32) * 0.1)
        tensors[name] = RawTensor(name, ttype, shape, data.reshape(*shape[:-1], -1) if len(shape) > 1 else data.reshape(-1))

    add("token_embd.weight", T.Q8_0, cfg.vocab, cfg.hidden)
    add("output_norm.weight", T.F32, cfg.hidden)
    kv = cfg.n_kv_heads * cfg.head_dim
    vectors = [("attn_norm.weight", cfg.hidden), ("ffn_norm.weight", cfg.hidden)]
    vectors += {"qwen3": [("attn_q_norm.weight", cfg.head_dim), ("attn_k_norm.weight", cfg.head_dim)],
                "laguna": [("attn_q_norm.weight", cfg.head_dim), ("attn_k_norm.weight", cfg.head_dim)],
                "qwen2": [("attn_q.bias", cfg.n_heads * cfg.head_dim), ("attn_k.bias", kv),
                          ("attn_v.bias", kv)]}.get(arch, [])
    for i, ttype in enumerate(types):
        q = cfg.heads(i) * cfg.head_dim
        gate = (("attn_gate", (cfg.heads(i) if i % 2 == 0 else q, cfg.hidden)),) if laguna else ()
        for name, shape in (("attn_q", (q, cfg.hidden)), ("attn_k", (kv, cfg.hidden)), ("attn_v", (kv, cfg.hidden)),
                            ("attn_output", (cfg.hidden, q)), ("ffn_gate", (cfg.ffn, cfg.hidden)),
                            ("ffn_up", (cfg.ffn, cfg.hidden)), ("ffn_down", (cfg.hidden, cfg.ffn)), *gate):
            add(f"blk.{i}.{name}.weight", ttype, *shape)
        for name, width in vectors:
            add(f"blk.{i}.{name}", T.F32, width)
    return Transformer(ModelFile(Path("<kernel cache>"), "gguf", cfg, tensors), get_ops("cpu"))


def _cache_gemma4():  # type: ignore[no-untyped-def]
    """The kernel cache's Gemma 4: sliding layers (through rings), a full layer, a KV-shared layer and
    per-layer inputs, so that its runs reach every Gemma 4 kernel signature."""
    from ember.kernels.tensor_types import TensorType as T

    return synthetic_gemma4([T.Q8_0, T.Q4_K, T.Q8_0], shared=1, per_layer_input=True)


def synthetic_gemma4(types: Sequence[int], shared: int = 0, per_layer_input: bool = False):  # type: ignore[no-untyped-def]
    """A small Gemma 4 of random weights, layer i stored in types[i]: sliding layers (even i: a window
    of 3 keys, head_dim 64, 2 KV heads) and full ones (odd i: head_dim 128, 1 KV head, values from the
    keys' projection, proportional rope), sandwich norms, GELU-tanh, layer scalars, a soft-capped
    head; the last `shared` layers KV-shared, per-layer inputs (64 wide, Q8_0) where asked."""
    from ember.daemon.loader.model_config import ModelConfig
    from ember.daemon.loader.model_file import ModelFile
    from ember.daemon.models.transformer import Transformer
    from ember.kernels import get_ops
    from ember.kernels.raw_tensor import RawTensor
    from ember.kernels.reference.quant import quantize
    from ember.kernels.tensor_types import TensorType as T

    n, hidden, width = len(types), 256, 64 if per_layer_input else 0
    sliding = tuple(i % 2 == 0 for i in range(n))
    kv_heads, head_dims = tuple(2 if s else 1 for s in sliding), tuple(64 if s else 128 for s in sliding)
    cfg = ModelConfig(arch="gemma4", n_layers=n, hidden=hidden, n_heads=4, n_kv_heads=2, head_dim=128, ffn=256,
                      vocab=64, context_length=64, rope_theta=1e6, norm_eps=1e-6, sliding_layers=sliding,
                      sliding_window=3, rope_theta_swa=10000.0, rope_dim_swa=64, rope_turning=0.25,
                      layer_kv_heads=kv_heads, layer_head_dims=head_dims, kv_shared_layers=shared, attn_scale=1.0,
                      ffn_act="gelu_tanh", embed_scale=hidden**0.5, logit_softcap=30.0, layer_input_dim=width)
    rng = np.random.default_rng(0)
    tensors: dict[str, RawTensor] = {}

    def add(name: str, ttype: T, *shape: int, scale: float = 0.1, offset: float = 0.0) -> None:
        data = quantize(ttype, rng.standard_normal(shape).astype(np.float32) * scale + offset)
        tensors[name] = RawTensor(name, ttype, shape, data.reshape(*shape[:-1], -1) if len(shape) > 1 else data.reshape(-1))

    add("token_embd.weight", T.Q8_0, cfg.vocab, hidden)
    add("output_norm.weight", T.F32, hidden, offset=1.0)
    if width:
        add("per_layer_token_embd.weight", T.Q8_0, cfg.vocab, n * width)
        add("per_layer_model_proj.weight", T.Q8_0, n * width, hidden)
        add("per_layer_proj_norm.weight", T.F32, width, offset=1.0)
    for i, ttype in enumerate(types):
        q, kv, own = 4 * head_dims[i], kv_heads[i] * head_dims[i], i < n - shared
        mats = [("attn_q", (q, hidden)), ("attn_output", (hidden, q)), ("ffn_gate", (cfg.ffn, hidden)),
                ("ffn_up", (cfg.ffn, hidden)), ("ffn_down", (hidden, cfg.ffn))]
        mats += [("attn_k", (kv, hidden))] if own else []
        mats += [("attn_v", (kv, hidden))] if own and sliding[i] else []
        for name, shape in mats:
            add(f"blk.{i}.{name}.weight", ttype, *shape)
        norms = [("attn_norm", hidden), ("attn_q_norm", head_dims[i]), ("post_attention_norm", hidden),
                 ("ffn_norm", hidden), ("post_ffw_norm", hidden)] + ([("attn_k_norm", head_dims[i])] if own else [])
        for name, size in norms:
            add(f"blk.{i}.{name}.weight", T.F32, size, offset=1.0)
        add(f"blk.{i}.layer_output_scale.weight", T.F32, 1, scale=0.0, offset=0.5 + 0.1 * i)
        if width:
            add(f"blk.{i}.inp_gate.weight", T.Q8_0, width, hidden)
            add(f"blk.{i}.proj.weight", T.Q8_0, hidden, width)
            add(f"blk.{i}.post_norm.weight", T.F32, hidden, offset=1.0)
    return Transformer(ModelFile(Path("<kernel cache>"), "gguf", cfg, tensors), get_ops("cpu"))


_PARTS: dict[str, Callable[[], None]] = {"first-layers": _first_tier_layers, "first-others": _first_tier_others,
                                         "serial": _serial_kernels, "parallel": _parallel_kernels}
FIRST_TIER = ("first-layers", "first-others")  # what a process runs until the second tier is cached too
PARTS = ("serial", "parallel")  # the second tier: the rest (and, loaded, the first)


def _lock_cache_writes() -> None:
    """Make each of numba's cache saves whole with respect to other processes' (see the module
    docstring): an exclusive lock on the cache directory around it."""
    from numba.core.caching import IndexDataCacheFile

    save = IndexDataCacheFile.save

    def locked_save(self, key, data):  # type: ignore[no-untyped-def]
        with open(os.path.join(self._cache_path, "ember-kernels-save.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            save(self, key, data)

    IndexDataCacheFile.save = locked_save


_LAST = "--last"  # the child after the parts: it reports what it had to compile itself (_compiled_report)
_REPORT = "the last child compiled:"


def _compiled_report(events: list) -> str:  # type: ignore[type-arg]
    """What numba compiled (rather than loaded) of ember's kernels, from its recorded compile events."""
    fns = {ev.data["dispatcher"].py_func for _, ev in events}
    names = sorted(f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__qualname__}" for fn in fns
                   if fn.__module__.startswith("ember."))
    return f"{_REPORT} {', '.join(names) or 'nothing'}"


_NICE = "--nice"  # a child of a background compile: the lowest CPU priority


def _exit_with_parent() -> None:
    """In a child: exit once stdin ends, which is when the process that started it ends (_Child)."""
    def watch() -> None:
        while os.read(0, 4096):  # the raw descriptor: a buffered reader's lock fails interpreter shutdown
            pass
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    from numba.core import event

    _exit_with_parent()
    parts = sys.argv[1:]
    if parts[:1] == [_NICE]:
        os.nice(19)
        parts = parts[1:]
    _lock_cache_writes()
    with event.install_recorder("numba:compile") as compiles:
        compile_all([p for p in parts if p != _LAST])
    if parts[:1] == [_LAST]:
        print(_compiled_report(compiles.buffer))
