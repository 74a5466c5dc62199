"""Logits to a client: the daemon's shared-memory ring vs the same logits inside msgpack frames.

Two processes on one ZMQ ipc socket, as the daemon and a client are. The sender streams `--rows`
rows of float32 logits (one row per frame, the daemon's shape: one token per Tokens frame) as fast as
the receiver takes them; the receiver reads every value of every row (a max, as a sampler or a
logits consumer would) before it counts the row. Two transports of the same rows:
- msgpack: each frame carries the row's bytes inside the message (a Tokens with a `bytes` field);
- shm: the row goes into a slot of the daemon's ShmRing (protocol/shm_ring.py) and the frame is the
  real Tokens message with its ShmSlot descriptor; the receiver reads the row in place through
  ShmRingReader and sends Release for the slots it has read, once per batch of frames it drained —
  as the SDK does; a full ring makes the sender wait (the daemon's backpressure).
Prints rows/s and GB/s of logits for each vocabulary size and the shm/msgpack speed ratio.

    python benchmarks/logits_transport.py [--vocab 8192,32000,151936] [--rows 3000] [--slots 64]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import zmq

from ember.protocol.codec import Codec
from ember.protocol.messages import Release, Tokens
from ember.protocol.shm_ring import ShmRing, ShmRingReader


class InlineLogits(msgspec.Struct, array_like=True, tag="tokens_inline"):
    """What a Tokens frame would be with the logits inside: the row's raw little-endian f32 bytes."""
    id: int
    token_ids: tuple[int, ...]
    text: str
    logits: bytes


def send(address: str, transport: str, vocab: int, rows: int, slots: int) -> None:
    """The daemon's side: stream `rows` rows."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # as the daemon: a full pipe blocks the sender, never drops
    sock.bind(address)
    client = sock.recv_multipart()[0]  # the receiver says hello
    codec, inline = Codec(), msgspec.msgpack.Encoder()
    release = msgspec.msgpack.Decoder(Release)
    data = np.random.default_rng(0).standard_normal((16, vocab)).astype(np.float32)
    ring = ShmRing.create(slots, vocab * 4) if transport == "shm" else None
    try:
        for i in range(rows):
            row = data[i % 16]
            if ring is None:
                sock.send_multipart([client, inline.encode(InlineLogits(1, (i,), "x", row.tobytes()))])
                continue
            while (slot := ring.acquire()) is None:  # full: wait for the client's releases
                for s in release.decode(sock.recv_multipart()[1]).slots:
                    ring.release(s)
            sock.send_multipart([client, codec.encode(Tokens(1, (i,), "x", logits=(ring.write(slot, row[None, :]),)))])
    finally:
        if ring is not None:
            ring.close()  # unlinked: the receiver's mapping stays valid until it lets go
        sock.close(linger=10_000)  # deliver what is queued
        ctx.term()


def receive(address: str, transport: str, rows: int) -> float:
    """The client's side: seconds from the first row to the last one read."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"hello")
    codec, inline = Codec(), msgspec.msgpack.Decoder(InlineLogits)
    reader, checksum, count, start = ShmRingReader(), 0.0, 0, 0.0
    while count < rows:
        done: list[int] = []
        for frame in [sock.recv()] + _drain(sock):
            if transport == "shm":
                descriptor = codec.decode_server(frame).logits[0]  # type: ignore[union-attr]
                checksum += float(reader.view(descriptor).max())
                done.append(descriptor.slot)
            else:
                checksum += float(np.frombuffer(inline.decode(frame).logits, np.float32).max())
            count += 1
            if count == 1:
                start = time.perf_counter()
        if done:
            sock.send(codec.encode(Release(1, tuple(done))))
    elapsed = time.perf_counter() - start
    reader.close()
    sock.close(linger=0)
    ctx.term()
    assert checksum != 0.0
    return elapsed


def _drain(sock: zmq.Socket) -> list[bytes]:  # type: ignore[type-arg]
    """Frames already waiting: read them all before releasing, as the SDK reads what has arrived."""
    out = []
    while sock.poll(0):
        out.append(sock.recv())
    return out


def measure(transport: str, vocab: int, rows: int, slots: int) -> float:
    with tempfile.TemporaryDirectory(prefix="ember-lt-") as tmp:
        address = f"ipc://{Path(tmp) / 's'}"
        sender = subprocess.Popen([sys.executable, __file__, "--send", transport, address, str(vocab), str(rows), str(slots)])
        time.sleep(0.3)  # let it bind
        try:
            return receive(address, transport, rows)
        finally:
            sender.wait(60)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--send":
        transport, address, vocab, rows, slots = sys.argv[2:7]
        return send(address, transport, int(vocab), int(rows), int(slots))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="8192,32000,151936")
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--slots", type=int, default=64, help="ring slots (the daemon's server.logits_slots)")
    args = parser.parse_args()
    print(f"{'vocab':>7} {'transport':>9} {'rows/s':>9} {'GB/s':>6} {'shm/msgpack':>12}")
    for vocab in (int(v) for v in args.vocab.split(",")):
        rates = {}
        for transport in ("msgpack", "shm"):
            best = min(measure(transport, vocab, args.rows, args.slots) for _ in range(3))
            rates[transport] = args.rows / best
            ratio = f"{rates['shm'] / rates['msgpack']:.2f}x" if transport == "shm" else ""
            print(f"{vocab:>7} {transport:>9} {rates[transport]:>9.0f} {rates[transport] * vocab * 4 / 1e9:>6.2f} {ratio:>12}")


if __name__ == "__main__":
    main()
