"""A cold-expert worker process: it maps the model file itself (no copy of the engine's), waits for a
Job on its socket, computes weight * expert(x) for each pair in the shared segment with the same CPU
kernels the engine uses, and replies. Run as `python -m ember.daemon.experts.cold_worker PATH FD_SEG
FD_SOCK CAPACITY PROMPT_ACT` by ColdPool, never by hand.
"""
from __future__ import annotations

import socket
import sys
import time
import traceback

import numpy as np


def main(argv: list[str]) -> int:
    path, seg_fd, sock_fd, capacity, prompt_act = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    from ember.daemon.experts.cold_channel import FAILED, JOB, OK, READY, REPLY, ColdSlots, map_segment, recv_exact
    from ember.daemon.loader.model_file import open_model_file
    from ember.kernels import get_ops
    from ember.kernels.ops import ExpertWeights

    mf = open_model_file(path)
    ops = get_ops("cpu")
    ops.prompt_act = prompt_act  # the engine's: a cold expert's prompt rows as a hot one's
    hidden, gelu = mf.config.hidden, mf.config.ffn_act == "gelu_tanh"
    slots = ColdSlots.over(map_segment(seg_fd, ColdSlots.nbytes(capacity, hidden)), capacity, hidden)
    sock = socket.socket(fileno=sock_fd)
    experts: dict[tuple[int, int], ExpertWeights] = {}  # packed on first use: views of the mapped file

    def weights(layer: int, ids: np.ndarray) -> dict[int, ExpertWeights]:
        for e in ids.tolist():
            if (layer, e) not in experts:
                g, u, d = (mf.experts(layer, p)[e] for p in ("gate", "up", "down"))
                experts[layer, e] = ExpertWeights(ops.weight(g), ops.weight(u), ops.weight(d), gelu)
        return {e: experts[layer, e] for e in ids.tolist()}

    sock.sendall(READY)
    while True:
        head = recv_exact(sock, JOB.size)
        if not head:
            return 0  # the engine closed the channel
        seq, layer, n = JOB.unpack(head)
        status, start = OK, time.perf_counter()
        try:
            expert = slots.expert[:n].astype(np.int64)
            slots.out[:n] = ops.expert_ffn(slots.x[:n], weights(layer, np.unique(expert)), np.arange(n), expert,
                                           slots.weight[:n], slots.decode[:n].astype(bool))
        except Exception:
            traceback.print_exc(file=sys.stderr)
            status = FAILED
        sock.sendall(REPLY.pack(seq, status, time.perf_counter() - start))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
