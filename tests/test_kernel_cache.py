"""The CPU kernels compute the same bits in the first process after a (re)compile as in every later one
(daemon/runner/kernel_cache.py explains why that needed a child process)."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

LOGITS_DIGEST = """
import hashlib, ember
from ember.daemon.loader.demo_model import DEMO_MODEL
m = ember.load(DEMO_MODEL)
ids = m.tokenize("def fibonacci(n):\\n    " * 20)  # long enough for the parallel kernels
print(hashlib.sha256(m.logits(ids).tobytes()).hexdigest())
"""


STAGED_START = """
import hashlib, json, time
from numba.core import event
import ember
from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.kernels.cpu import decoder_layer, greedy_decode, kernel_tiers

fused = []  # the second tier's calls: fused layers, greedy bursts
run_stack, burst = decoder_layer.run_stack, greedy_decode.burst
decoder_layer.run_stack = lambda *args: fused.append(1) or run_stack(*args)
greedy_decode.burst = lambda *args: fused.append(1) or burst(*args)

def run(m):
    ids = m.tokenize("def fibonacci(n):\\n    " * 20)  # as LOGITS_DIGEST
    return (hashlib.sha256(m.logits(ids).tobytes()).hexdigest(),
            list(m.generate("def fibonacci(n):", max_tokens=24, temperature=0, ignore_eos=True)))

with event.install_recorder("numba:compile") as compiles:
    m = ember.load(DEMO_MODEL)  # a first start: it returns once the first tier is cached
    staged = kernel_tiers.first_tier_only()
    first = run(m)
    first_fused = len(fused)
    deadline = time.monotonic() + 1500
    while kernel_tiers.first_tier_only() and time.monotonic() < deadline:
        time.sleep(0.5)
    complete = not kernel_tiers.first_tier_only()
    second = run(m)
compiled = sorted({ev.data["dispatcher"].py_func.__qualname__ for _, ev in compiles.buffer
                   if ev.data["dispatcher"].py_func.__module__.startswith("ember.")})
print(json.dumps(dict(staged=staged, first=first, first_fused=first_fused, complete=complete, second=second,
                      fused=len(fused) - first_fused, compiled=compiled)))
"""


@pytest.mark.slow
def test_a_first_start_a_later_one_and_a_changed_source_give_the_same_logits(tmp_path: Path) -> None:
    """On an empty cache ember.load returns once the first tier is compiled (kernels/cpu/kernel_tiers.py)
    and serves op by op while the second tier compiles in the background: the logits of a long prompt
    and the greedy tokens are the same before and after the switch, and the process compiles nothing
    itself. A later process, loading everything, gives the same logits; so does one after a kernel
    source changed, which compiles every kernel anew."""
    import json

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}  # empty: the first process finds nothing compiled
    done = subprocess.run([sys.executable, "-c", STAGED_START], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["staged"] and seen["complete"]
    assert seen["first_fused"] == 0 and seen["fused"] > 0  # op by op first, the fused layers once compiled
    assert seen["first"] == seen["second"]
    assert seen["compiled"] == []  # every kernel came from the cache the children filled
    stamps = sorted(tmp_path.rglob("ember-kernels-*.stamp"))
    assert [p.name.endswith(".first-tier.stamp") for p in stamps] == [True, False], stamps
    if len(os.sched_getaffinity(0)) > 1:  # the parts, compiled side by side, left the last children nothing to do
        assert all(p.read_text().strip().endswith("the last child compiled: nothing") for p in stamps), stamps

    def digest() -> str:
        done = subprocess.run([sys.executable, "-c", LOGITS_DIGEST], env=env, capture_output=True, text=True,
                              timeout=1800)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert digest() == seen["first"][0]  # a later process: everything loaded

    # a kernel source changed (its stamps are gone): every cached kernel is compiled anew, none reused
    for stamp in stamps:
        stamp.unlink()
    stale = stamps[0].parent / "decoder_layer._attention_in-1.py311.nbi"
    stale.write_bytes(b"an index of kernels compiled from older sources")
    assert digest() == seen["first"][0]
    assert not stale.exists()
    assert list(tmp_path.rglob("ember-kernels-*.stamp"))


SAVE_ONE_ENTRY = """
import sys
from numba.core.caching import IndexDataCacheFile
from ember.daemon.runner.kernel_cache import _lock_cache_writes
_lock_cache_writes()
IndexDataCacheFile(sys.argv[1], "kernel", "stamp").save("key", b"data")
"""


def test_cache_saves_wait_for_the_cache_directorys_lock(tmp_path: Path) -> None:
    """The compile's children write one numba cache side by side: each save holds the directory's lock."""
    import fcntl

    index = tmp_path / "kernel.nbi"
    with open(tmp_path / "ember-kernels-save.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        child = subprocess.Popen([sys.executable, "-c", SAVE_ONE_ENTRY, str(tmp_path)])
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=3.0)  # it would have saved by now (an import and one small write)
        assert not index.exists()
    assert child.wait(timeout=60) == 0
    assert index.exists()


def test_a_failing_part_fails_the_compile_with_its_output(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.daemon.runner import kernel_cache

    with pytest.raises(RuntimeError, match="no-such-part") as failed:
        kernel_cache._compile_in_children(2, ("no-such-part",), lambda done, total: None)
    assert "KeyError" in str(failed.value)  # the child's own traceback


def test_the_compile_reports_each_child_as_it_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first start shows how far its compile got: (0, n) before the first child, then one report
    per child that finished, the last child (which runs every part) counted last."""
    from ember.daemon.runner import kernel_cache

    class Finished:
        def __init__(self, parts: list[str], background: bool = False) -> None:
            self.parts = parts
            self.process = types.SimpleNamespace(poll=lambda: 0)

        def overdue(self) -> bool:
            return False

        def finish(self) -> str:
            return f"{kernel_cache._REPORT} nothing"

    monkeypatch.setattr(kernel_cache, "_Child", Finished)
    seen: list[tuple[int, int]] = []
    report = kernel_cache._compile_in_children(2, ("a", "b", "c"), lambda done, total: seen.append((done, total)))
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)] and report.endswith("nothing")
    seen.clear()
    kernel_cache._compile_in_children(1, ("a", "b", "c"), lambda done, total: seen.append((done, total)))  # one core: the last child alone
    assert seen == [(0, 1), (1, 1)]
