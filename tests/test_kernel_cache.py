"""The CPU kernels compute the same bits in the first process after a (re)compile as in every later one
(daemon/runner/kernel_cache.py explains why that needed a child process)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
                              timeout=1800)  # a cold compile: 6-7 minutes on 2 cores
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    cold = digest()
    stamps = list(tmp_path.rglob("ember-kernels-*.stamp"))
    assert stamps, "the first process left no stamp"
    assert digest() == cold

    # a kernel source changed (its stamp is gone): every cached kernel is compiled anew, none reused
    stamps[0].unlink()
    stale = stamps[0].parent / "decoder_layer._attention_in-1.py311.nbi"
    stale.write_bytes(b"an index of kernels compiled from older sources")
    assert digest() == cold
    assert not stale.exists()
    assert list(tmp_path.rglob("ember-kernels-*.stamp"))
