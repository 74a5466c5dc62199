"""A MoE router's top-k on the CPU (the CpuOps form of ops.route), compiled: every step's routing,
prompt or decode, goes through `route_rows`, which the compiled decode path of a MoE layer
(expert_ffn.py) calls too, so a token is routed alike whichever path ran its step.

Per token: the logits soft-capped where softcap > 0, then a softmax over the experts or each
expert's sigmoid; the k highest scores (plus the selection bias, where there is one) picked in
order, a tie to the lower expert id (numpy's stable argsort of the negated scores); their scores
renormalised to sum to 1 when asked, then scaled.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["route", "route_rows"]

_EMPTY = np.zeros(0, np.float32)


@njit(cache=True, nogil=True)  # no fast-math: the scores round as written
def route_rows(logits, k, normalize, sigmoid, bias, softcap, scale, ids, weights):  # type: ignore[no-untyped-def]
    """ids [n, k] (int64) and weights [n, k] (float32) of each row of logits [n, experts]; bias has
    0 entries for none."""
    n, e = logits.shape
    probs = np.empty(e, np.float32)
    chosen = np.zeros(e, np.bool_)
    for t in range(n):
        for j in range(e):
            z = logits[t, j]
            if softcap > 0:
                z = np.float32(softcap * math.tanh(z / softcap))
            probs[j] = z
        if sigmoid:
            for j in range(e):
                probs[j] = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-probs[j])))
        else:
            top = probs[0]
            for j in range(1, e):
                top = max(top, probs[j])
            total = np.float32(0.0)
            for j in range(e):
                probs[j] = np.float32(math.exp(probs[j] - top))
                total += probs[j]
            for j in range(e):
                probs[j] = probs[j] / total
        chosen[:] = False
        for r in range(k):
            best, best_score = -1, np.float32(0.0)
            for j in range(e):
                if chosen[j]:
                    continue
                score = probs[j] + bias[j] if bias.size else probs[j]
                if best < 0 or score > best_score:
                    best, best_score = j, score
            chosen[best] = True
            ids[t, r] = best
            weights[t, r] = probs[best]
        if normalize:
            total = np.float32(0.0)
            for r in range(k):
                total += weights[t, r]
            for r in range(k):
                weights[t, r] = weights[t, r] / total
        if scale != 1.0:
            for r in range(k):
                weights[t, r] = weights[t, r] * np.float32(scale)


def route(logits: np.ndarray, k: int, normalize: bool, gating: str, bias: np.ndarray | None, softcap: float,
          scale: float) -> tuple[np.ndarray, np.ndarray]:
    """ops.route on host logits [n, experts] -> (ids int64 [n, k], weights float32 [n, k])."""
    logits = np.ascontiguousarray(logits, np.float32)
    n = logits.shape[0]
    ids, weights = np.empty((n, k), np.int64), np.empty((n, k), np.float32)
    route_rows(logits, k, normalize, gating == "sigmoid", _EMPTY if bias is None else np.asarray(bias, np.float32),
               np.float32(softcap), np.float32(scale), ids, weights)
    return ids, weights
