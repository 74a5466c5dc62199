"""`python -m ember.cluster.daemon_child ARGS...`: `ember ARGS...`, ending when the process that
started it is gone.

A replica (cluster/replica.py) starts its daemon and its gateway this way. Ray kills a replica's actor
with SIGKILL when it dies or is killed, and a killed parent leaves its children to init: without this
watch a dead replica's daemon would keep its cores and its model's memory. Why not PR_SET_PDEATHSIG:
it fires when the *thread* that forked exits, and a Ray actor forks from whichever of its threads runs
the constructor, which need not live as long as the actor. The watch sends the child SIGTERM, so the
daemon drains what it holds and exits as it does under systemd.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

PARENT_POLL = 0.5  # seconds between looks at the parent


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL)
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    threading.Thread(target=_watch, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    from ember.client.cli import main as ember_main

    return ember_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
