"""The prefix cache shares a prompt's KV blocks between the clients of one Unix user only
(engine.prefix_sharing "user", the default): another user's identical prompt finds none of them, so
the time of its first token cannot tell it what was sent (issue 38: 15 ms instead of 650 ms gave a
1,000-token prompt away). The daemon knows each connection's user from SO_PEERCRED (the relay's
X-Ember-Peer). Another user's client is a forked child of this test that drops to nobody after its
imports, so this test needs root; elsewhere it skips."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from daemon_process import DaemonProcess

from ember.client import Client

pytestmark = pytest.mark.slow
NOBODY = 65534

PROMPT = "".join(f"def handler_{i}(event, context):\n    return process(event, {i})\n" for i in range(12))


def as_nobody(socket_path: Path) -> int:
    """Send PROMPT as user nobody (a forked child), wait for it to end; its exit status."""
    pid = os.fork()
    if pid == 0:  # the child: already imported everything it needs
        status = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with Client(socket_path) as client:
                list(client.generate(PROMPT, max_tokens=2))
            status = 0
        except BaseException as e:  # its reason on stderr, for the test's report
            os.write(2, f"the other user's client failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(status)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's client needs root to become that user")
@pytest.mark.parametrize("sharing", ["user", "all"])
def test_another_users_identical_prompt_finds_no_cached_block(sharing: str) -> None:
    """"user" (the default): another user's identical prompt finds none of the blocks; "all": every one."""
    config = f'[server]\nsocket_group = "nogroup"\n[engine]\nprefix_sharing = "{sharing}"\n'
    daemon = DaemonProcess(config).wait_ready(300)
    try:
        for parent in daemon.socket.parents[1:3]:  # the test's private directories: nobody may pass
            parent.chmod(parent.stat().st_mode | 0o111)
        with Client(daemon.socket) as root:
            blocks = len(root.tokenize(PROMPT)) // 16
            list(root.generate(PROMPT, max_tokens=2))
            before = root.stats().prefix_hits
            list(root.generate(PROMPT, max_tokens=2))  # the same user: every full block found
            assert root.stats().prefix_hits - before == blocks
            before = root.stats().prefix_hits
            assert as_nobody(daemon.socket) == 0
            assert root.stats().prefix_hits - before == (0 if sharing == "user" else blocks)
            assert root.stats().requests_total == 3
    finally:
        daemon.stop()

