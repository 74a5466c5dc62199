"""ColdPool: the engine's side of the cold-expert workers — N processes that compute the (token,
expert) pairs whose expert is cold, while the engine computes the hot ones.

Per MoE layer and step, `submit` splits the cold pairs between the workers by expert (an expert's pairs
all go to one worker, which reads its weights once), copies each worker's share into its shared
segment and sends it a Job; `Pending.wait` collects the replies and sums the weighted outputs per
token. A share larger than a segment runs in rounds. A worker that dies (or fails) fails the step with
ColdWorkerError after the others have answered; it is restarted first, so the next step finds a full pool.
One that dies between steps (an idle daemon's) is restarted at the next request boundary (revive), before
the request's first step: it fails nothing.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ember.daemon.experts.cold_channel import (JOB, OK, READY, REPLY, ColdSlots, create_segment, map_segment,
                                               recv_exact)

log = logging.getLogger("ember.experts")

READY_TIMEOUT_S = 300.0  # a worker's start: import, map the file, load the cached kernels (slow on a busy box)


class ColdWorkerError(RuntimeError):
    """A cold-expert worker died or failed during a step; the step fails, the pool carries on."""


class _Worker:
    def __init__(self, index: int, model: Path, capacity: int, hidden: int, prompt_act: str) -> None:
        self.index, self.capacity, self.hidden = index, capacity, hidden
        nbytes = ColdSlots.nbytes(capacity, hidden)
        seg = create_segment(nbytes)
        self.buf = map_segment(seg, nbytes)
        self.slots = ColdSlots.over(self.buf, capacity, hidden)
        ours, theirs = socket.socketpair()
        env = dict(os.environ, NUMBA_NUM_THREADS="1")  # one kernel thread each: the pool is the parallelism
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ember.daemon.experts.cold_worker", str(model), str(seg), str(theirs.fileno()),
             str(capacity), prompt_act], pass_fds=(seg, theirs.fileno()), env=env, stdin=subprocess.DEVNULL)
        os.close(seg)
        theirs.close()
        self.sock = ours
        self.sock.settimeout(READY_TIMEOUT_S)
        try:
            ready = recv_exact(self.sock, 1)
        except TimeoutError:
            ready = b""
        self.sock.settimeout(None)
        if ready != READY:
            self.close()
            raise ColdWorkerError(f"cold expert worker {index} did not start (exit code {self.proc.poll()})")
        self.seq = 0

    def send(self, layer: int, x: np.ndarray, expert: np.ndarray, weight: np.ndarray, decode: np.ndarray) -> bool:
        n = len(expert)
        s = self.slots
        s.x[:n], s.expert[:n], s.weight[:n], s.decode[:n] = x, expert, weight, decode
        self.seq += 1
        try:
            self.sock.sendall(JOB.pack(self.seq, layer, n))
        except OSError:
            return False
        return True

    def receive(self) -> tuple[int, float] | None:
        """The status of the reply to the last job and the seconds the worker computed; None if the
        worker is gone."""
        try:
            while True:
                data = recv_exact(self.sock, REPLY.size)
                if not data:
                    return None
                seq, status, seconds = REPLY.unpack(data)
                if seq == self.seq:  # else a reply to a job of a step that failed meanwhile
                    return status, seconds
        except OSError:
            return None

    def describe(self) -> str:
        return f"cold expert worker {self.index} (pid {self.proc.pid}, exit code {self.proc.poll()})"

    def close(self) -> None:
        self.sock.close()  # the worker reads EOF and exits
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class _Share:
    worker: int
    pairs: np.ndarray  # indices into the submitted pairs


class Pending:
    """The cold half of one layer's step, under way in the workers."""

    def __init__(self, pool: ColdPool, layer: int, x: np.ndarray, token: np.ndarray, expert: np.ndarray,
                 weight: np.ndarray, decode: np.ndarray, n_tokens: int) -> None:
        self.pool, self.layer = pool, layer
        self.x, self.token, self.expert, self.weight, self.decode = x, token, expert, weight, decode
        self.out = np.zeros((n_tokens, x.shape[1]), np.float32)
        self.busy = 0.0  # seconds the workers computed, the slowest of each round (they run side by side)
        self.waited = 0.0  # seconds the engine waited for them, after its own (hot) work
        self.rounds = pool.split(expert)
        self.in_flight = self._send(self.rounds.pop(0)) if self.rounds else []

    def _send(self, shares: list[_Share]) -> list[_Share]:
        sent = []
        for share in shares:
            p = share.pairs
            # a worker that cannot take the job is found dead when its reply is read
            self.pool.workers[share.worker].send(self.layer, self.x[p], self.expert[p], self.weight[p], self.decode[p])
            sent.append(share)
        return sent

    def _collect(self) -> None:
        dead: list[tuple[int, int | None]] = []
        slowest = 0.0
        for share in self.in_flight:
            w = self.pool.workers[share.worker]
            reply = w.receive()
            if reply is None or reply[0] != OK:
                dead.append((share.worker, None if reply is None else reply[0]))
                continue
            slowest = max(slowest, reply[1])
            np.add.at(self.out, self.token[share.pairs], w.slots.out[: len(share.pairs)])
        self.in_flight = []
        self.busy += slowest
        if dead:
            self.pool.failed(dead, self.layer)

    def wait(self) -> np.ndarray:
        """Sum over the cold pairs of weight * expert(x), per token: float32 [n_tokens, hidden]."""
        start = time.perf_counter()
        try:
            self._collect()
            while self.rounds:
                self.in_flight = self._send(self.rounds.pop(0))
                self._collect()
        finally:
            self.waited = time.perf_counter() - start
        return self.out


class ColdPool:
    def __init__(self, model: Path, n_workers: int, hidden: int, prompt_act: str, capacity: int = 1024) -> None:
        """prompt_act: the model's prompt activations (the workers compute its prompt rows alike)."""
        if n_workers < 1:
            raise ValueError(f"cold_workers must be >= 1, got {n_workers}")
        self.model, self.hidden, self.capacity, self.prompt_act = Path(model), hidden, capacity, prompt_act
        self.workers: list[_Worker] = []
        self.restarts = 0
        self._finalizer = weakref.finalize(self, _close_all, self.workers)
        for i in range(n_workers):
            self.workers.append(_Worker(i, self.model, capacity, hidden, prompt_act))

    def submit(self, layer: int, x: np.ndarray, token: np.ndarray, expert: np.ndarray, weight: np.ndarray,
               decode: np.ndarray, n_tokens: int) -> Pending:
        """Start the pairs (x [pairs, hidden] host rows, one per pair) on the workers."""
        return Pending(self, layer, np.ascontiguousarray(x, np.float32), token, expert.astype(np.int32),
                       weight.astype(np.float32), decode.astype(np.uint8), n_tokens)

    def split(self, expert: np.ndarray) -> list[list[_Share]]:
        """Rounds of shares: experts dealt to workers in order, balancing pairs, no expert split, at
        most `capacity` pairs per worker and round."""
        order = np.argsort(expert, kind="stable")
        groups = np.split(order, np.flatnonzero(np.diff(expert[order])) + 1) if order.size else []
        load = [0] * len(self.workers)
        per_worker: list[list[np.ndarray]] = [[] for _ in self.workers]
        for g in sorted(groups, key=len, reverse=True):  # biggest first onto the least loaded worker
            w = load.index(min(load))
            per_worker[w].append(g)
            load[w] += len(g)
        rounds: list[list[_Share]] = []
        for w, gs in enumerate(per_worker):
            if not gs:
                continue
            pairs = np.concatenate(gs)
            for r, start in enumerate(range(0, len(pairs), self.capacity)):
                if r == len(rounds):
                    rounds.append([])
                rounds[r].append(_Share(w, pairs[start : start + self.capacity]))
        return rounds

    def failed(self, dead: list[tuple[int, int | None]], layer: int) -> None:
        """Restart the workers that died or failed, then fail the step."""
        messages = []
        for index, status in dead:
            worker = self.workers[index]
            if status is None:  # its socket closed: let it finish dying, for its exit code
                try:
                    worker.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
            what = "failed" if status is not None and worker.proc.poll() is None else "died"
            messages.append(f"{worker.describe()} {what} computing layer {layer}'s cold experts")
            log.error("%s; restarting it", messages[-1])
            worker.close()
            self.workers[index] = _Worker(index, self.model, self.capacity, self.hidden, self.prompt_act)
            self.restarts += 1
        raise ColdWorkerError("; ".join(messages) + " (restarted; this step failed)")

    def revive(self) -> int:
        """Restart the workers that died between steps -> how many (a poll each: cheap enough for every
        request boundary). A death found in a step fails that step (failed); found here, it fails nothing."""
        revived = 0
        for index, worker in enumerate(self.workers):
            if worker.proc.poll() is None:
                continue
            log.error("%s died between steps (exit code %s); restarting it", worker.describe(), worker.proc.returncode)
            worker.close()
            self.workers[index] = _Worker(index, self.model, self.capacity, self.hidden, self.prompt_act)
            self.restarts += 1
            revived += 1
        return revived

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def close(self) -> None:
        self._finalizer()


def _close_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.close()
