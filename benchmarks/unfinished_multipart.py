"""What unfinished multi-part messages cost the daemon (issue 38, item 2): a hand-written ZMTP 3.0 client
sends `--frames` frames of 4 MiB, each marked "more to come", over each of `--connections`
connections, and never the last one; the daemon's front process RSS is read before, while they stay,
and after the senders close, and how much each sender got through before the daemon closed its
connection. (A pyzmq client cannot do this: libzmq keeps an unfinished message in the sender until
its last frame.) A bystander's Health must still be answered.

libzmq takes every frame of such a message into the connection's pipe unflushed (ZMQ_MAXMSGSIZE bounds
one frame, RCVHWM counts whole messages), and used to hold it until the connection closed: 4 x 100
frames took the front from 68 to 1669 MiB. The relay on the public socket (daemon/server/zmtp_relay.py)
now closes a connection once its message passes limits.max_message_bytes in all.

    python benchmarks/unfinished_multipart.py [--connections 4] [--frames 127]
"""
from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "daemon"))  # the test suite's daemon launcher

from daemon_process import DaemonProcess  # noqa: E402
from raw_zmtp import MORE, frame, zmtp_dealer  # noqa: E402

from ember.client import Client  # noqa: E402

FRAME = (4 << 20) - 64  # under the daemon's max_message_bytes: libzmq takes each frame


def rss_mib(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) // 1024


def send_until_closed(sock: socket.socket, part: bytes, times: int) -> int:
    """Send `part` up to `times` times -> bytes sent before the peer closed the connection."""
    sent = 0
    try:
        for _ in range(times):
            sock.sendall(part)
            sent += len(part)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--frames", type=int, default=127, help="4 MiB frames per connection (default 127: ~500 MiB)")
    args = parser.parse_args()
    daemon = DaemonProcess("[engine]\nwarmup = false\n").wait_ready(300)
    try:
        before = rss_mib(daemon.proc.pid)
        part = frame(b"x" * FRAME, MORE)
        senders, sent = [], []
        for _ in range(args.connections):
            sock = zmtp_dealer(daemon.socket)
            senders.append(sock)
            sent.append(send_until_closed(sock, part, args.frames))
        time.sleep(3)
        held = rss_mib(daemon.proc.pid)
        with Client(daemon.socket) as client:
            health = client.health().status
        for sock in senders:
            sock.close()
        time.sleep(2)
        print(f"{args.connections} connections x {args.frames} frames of 4 MiB, never finished: the daemon's front "
              f"process RSS {before} MiB before, {held} MiB while they stay, {rss_mib(daemon.proc.pid)} MiB after "
              f"they close; MiB each sender got through before its connection was closed: "
              f"{[round(b / 2**20, 1) for b in sent]}; a bystander's Health: {health}")
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
