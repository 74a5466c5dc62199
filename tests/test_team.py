"""The thread team (kernels/cpu/team.py): phases of claimed items give every member the previous
phase's results, with any number of members on any number of threads, and a member that fails makes
the team raise instead of leaving the others waiting for ever."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from numba import njit, prange

from ember.kernels.cpu.team import claim, counters_for, fail, failed, finish, join, wait

pytestmark = pytest.mark.slow


@njit(nogil=True)
def _member(counters, a, doubled, mirrored, bad):  # type: ignore[no-untyped-def]
    me = join(counters)
    try:
        i = claim(counters, 0, me, a.size)
        while i < a.size:
            if i == bad:
                raise ValueError("a bad item")
            doubled[i] = 2 * a[i]
            finish(counters, 0)
            i = claim(counters, 0, me, a.size)
        if not wait(counters, 0, a.size):
            return
        i = claim(counters, 1, me, a.size)
        while i < a.size:  # reads items other members may have computed
            mirrored[i] = doubled[i] + doubled[a.size - 1 - i]
            finish(counters, 1)
            i = claim(counters, 1, me, a.size)
    except Exception:  # noqa: BLE001
        fail(counters)


@njit(parallel=True, nogil=True)
def _program(members, a, bad):  # type: ignore[no-untyped-def]
    doubled, mirrored = np.zeros_like(a), np.zeros_like(a)
    counters = counters_for(2, members)
    for _ in prange(members):
        _member(counters, a, doubled, mirrored, bad)
    if failed(counters):
        raise RuntimeError("a member failed")
    return mirrored


@pytest.mark.parametrize("members", [1, 2, 3, 5])  # numba runs 2 threads here: 3 and 5 share threads
def test_each_phase_sees_every_result_of_the_one_before(members: int) -> None:
    a = np.arange(1000, dtype=np.float64)
    for _ in range(20):
        np.testing.assert_array_equal(_program(members, a, -1), 2 * a + 2 * a[::-1])


@pytest.mark.parametrize("bad", [0, 7, 999])  # claimed by whichever member: each run differs
def test_a_failed_member_makes_the_team_raise_not_hang(bad: int) -> None:
    code = ("import numpy as np, sys\n"
            "sys.path.insert(0, 'tests')\n"
            "from test_team import _program\n"
            "for members in (1, 2, 3):\n"
            "    for _ in range(20):\n"
            "        try:\n"
            f"            _program(members, np.arange(1000.0), {bad})\n"
            "            print('returned')\n"
            "        except RuntimeError as e:\n"
            "            print('raised', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)  # not a hang
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["raised a member failed"] * 60


def test_more_threads_than_cores_finish() -> None:
    """Members on more threads than the machine has cores: one may be preempted holding an item,
    and the others yield their cores to it instead of spinning through whole scheduler ticks."""
    code = ("import numba, numpy as np, os, sys, time\n"
            "sys.path.insert(0, 'tests')\n"
            "from test_team import _program\n"
            "a = np.arange(10000.0)\n"
            "t = time.perf_counter()\n"
            "for _ in range(200):\n"
            "    assert np.array_equal(_program(numba.get_num_threads(), a, -1), 2 * a + 2 * a[::-1])\n"
            "print(numba.get_num_threads(), os.cpu_count(), time.perf_counter() - t)\n")
    threads = 4 * (os.cpu_count() or 1)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NUMBA_NUM_THREADS": str(threads)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == str(threads)
