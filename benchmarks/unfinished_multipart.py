"""What unfinished multi-part messages cost the daemon (issue 38, item 2): a hand-written ZMTP 3.0 client
sends `--frames` frames of 4 MiB, each marked "more to come", over each of `--connections`
connections, and never the last one; the daemon's front process RSS is read before, while they stay,
and after the senders close. (A pyzmq client cannot do this: libzmq keeps an unfinished message in the
sender until its last frame.) A bystander's Health must still be answered.

libzmq takes every frame of such a message into the connection's pipe unflushed: ZMQ_MAXMSGSIZE bounds
one frame, RCVHWM counts whole messages, and the daemon sees nothing until the last frame comes, so the
memory stays until the connection closes. This script measures it; the fix needs a bound libzmq does
not have (docs/daemon.md).

    python benchmarks/unfinished_multipart.py [--connections 4] [--frames 100]
"""
from __future__ import annotations

import argparse
import socket
import struct
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "daemon"))  # the test suite's daemon launcher

from daemon_process import DaemonProcess  # noqa: E402

from ember.client import Client  # noqa: E402

FRAME = (4 << 20) - 64  # under the daemon's max_message_bytes: libzmq takes each frame


def rss_mib(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) // 1024


def zmtp_dealer(path: Path) -> socket.socket:
    """A ZMTP 3.0 connection announcing itself as a DEALER (NULL mechanism), ready for frames."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    sock.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
    greeting = b""
    while len(greeting) < 64:
        greeting += sock.recv(64 - len(greeting))
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    sock.sendall(bytes([0x04, len(ready)]) + ready)
    return sock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--frames", type=int, default=100, help="4 MiB frames per connection (default 100)")
    args = parser.parse_args()
    daemon = DaemonProcess("[engine]\nwarmup = false\n").wait_ready(300)
    try:
        before = rss_mib(daemon.proc.pid)
        frame = b"x" * FRAME
        senders = []
        for _ in range(args.connections):
            sock = zmtp_dealer(daemon.socket)
            for _ in range(args.frames):
                sock.sendall(bytes([0x03]) + struct.pack(">Q", len(frame)) + frame)  # MORE | LONG
            senders.append(sock)
        time.sleep(3)
        held = rss_mib(daemon.proc.pid)
        with Client(daemon.socket) as client:
            health = client.health().status
        for sock in senders:
            sock.close()
        time.sleep(2)
        print(f"{args.connections} connections x {args.frames} frames of 4 MiB, never finished: the daemon's front "
              f"process RSS {before} MiB before, {held} MiB while they stay, {rss_mib(daemon.proc.pid)} MiB after "
              f"they close; a bystander's Health: {health}")
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
