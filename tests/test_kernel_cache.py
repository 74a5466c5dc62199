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
ids = m.tokenize("def fibonacci(n):\\n    " * 20)  # long enough for the parallel kernels; then one token
print(hashlib.sha256(m.logits(ids).tobytes() + m.logits(ids[:1]).tobytes()).hexdigest())
"""


@pytest.mark.slow
def test_a_cold_cache_and_a_warm_one_give_the_same_logits(tmp_path: Path) -> None:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}  # empty: the first process finds nothing compiled

    def digest() -> str:
        done = subprocess.run([sys.executable, "-c", LOGITS_DIGEST], env=env, capture_output=True, text=True,
                              timeout=1800)  # a cold compile: about 4 minutes on 2 cores
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    cold = digest()
    stamps = list(tmp_path.rglob("ember-kernels-*.stamp"))
    assert stamps, "the first process left no stamp"
    if len(os.sched_getaffinity(0)) > 1:  # the parts, compiled side by side, left the last child nothing to do
        assert stamps[0].read_text().strip().endswith("the last child compiled: nothing"), stamps[0].read_text()
    assert digest() == cold

    # a kernel source changed (its stamp is gone): every cached kernel is compiled anew, none reused
    stamps[0].unlink()
    stale = stamps[0].parent / "decoder_layer._attention_in-1.py311.nbi"
    stale.write_bytes(b"an index of kernels compiled from older sources")
    assert digest() == cold
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

    monkeypatch.setattr(kernel_cache, "PARTS", ("no-such-part",))
    with pytest.raises(RuntimeError, match="no-such-part") as failed:
        kernel_cache._compile_in_children(2, lambda done, total: None)
    assert "KeyError" in str(failed.value)  # the child's own traceback


def test_the_compile_reports_each_child_as_it_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first start shows how far its compile got: (0, n) before the first child, then one report
    per child that finished, the last child (which runs every part) counted last."""
    from ember.daemon.runner import kernel_cache

    class Finished:
        def __init__(self, parts: list[str]) -> None:
            self.parts = parts
            self.process = types.SimpleNamespace(poll=lambda: 0)

        def overdue(self) -> bool:
            return False

        def finish(self) -> str:
            return f"{kernel_cache._REPORT} nothing"

    monkeypatch.setattr(kernel_cache, "_Child", Finished)
    monkeypatch.setattr(kernel_cache, "PARTS", ("a", "b", "c"))
    seen: list[tuple[int, int]] = []
    report = kernel_cache._compile_in_children(2, lambda done, total: seen.append((done, total)))
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)] and report.endswith("nothing")
    seen.clear()
    kernel_cache._compile_in_children(1, lambda done, total: seen.append((done, total)))  # one core: the last child alone
    assert seen == [(0, 1), (1, 1)]
