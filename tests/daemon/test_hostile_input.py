"""Hostile input against a real daemon: every bad message gets an Error or is dropped, nothing else
happens, and a well-behaved client is served correctly all along."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from concurrent_streams import PacedStream

from ember.client import Client
from ember.protocol import messages as m
from ember.protocol.codec import Codec, ProtocolError

pytestmark = pytest.mark.slow

codec = Codec()
PROBE_ID = 2**62  # the id of the Health request that follows each hostile message
WAIT_MS = 10_000  # a bound for a hung daemon, never a pacing


class WellBehavedClient:
    """Generates and checks completions in a thread for as long as the module's tests run."""

    def __init__(self, socket: object, expected: list[int]) -> None:
        self.expected, self.served, self.failures = expected, 0, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(socket,), daemon=True)
        self._thread.start()

    def _run(self, socket: object) -> None:
        try:
            with Client(socket) as client:  # type: ignore[arg-type]
                while not self._stop.is_set():
                    got = [t for c in client.generate("def fibonacci(n):", max_tokens=16) for t in c.token_ids]
                    if got != self.expected:
                        self.failures.append(got)
                    self.served += 1
        except Exception as e:  # recorded, asserted by the last test
            self.failures.append(repr(e))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


@pytest.fixture(scope="module")
def bystander(daemon, demo_model) -> Iterator[WellBehavedClient]:  # type: ignore[no-untyped-def]
    client = WellBehavedClient(daemon.socket, list(demo_model.generate("def fibonacci(n):", max_tokens=16)))
    yield client
    client.stop()


@pytest.fixture(scope="module")
def ctx() -> Iterator[zmq.Context]:  # type: ignore[type-arg]
    c = zmq.Context()
    yield c
    c.destroy(linger=0)  # also closes the socket of a test that failed midway


def raw_socket(ctx: zmq.Context, daemon) -> zmq.Socket:  # type: ignore[no-untyped-def, type-arg]
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, WAIT_MS)
    sock.connect(f"ipc://{daemon.socket}")
    return sock


def replies_until_probe(sock: zmq.Socket) -> list[m.Wire]:  # type: ignore[type-arg]
    """Send a Health probe; return every frame that came before its answer (the daemon handles one
    connection's messages in order, so the hostile message has been dealt with by then)."""
    sock.send(codec.encode(m.Health(PROBE_ID)))
    replies = []
    while True:
        reply = codec.decode_server(sock.recv())  # anything the daemon sends must decode
        if isinstance(reply, m.HealthStatus) and reply.id == PROBE_ID:
            return replies
        if not isinstance(reply, m.Ping):
            replies.append(reply)


# --- what hostile frames look like ------------------------------------------------------------------
_valid = st.sampled_from([
    m.Generate(1, prompt="def f(x):", max_tokens=3), m.Tokenize(2, "hello"), m.Hello(3, 1, "x"),
    m.Generate(4, token_ids=(1, 2, 3), stop=("a",), logit_bias={1: 2.0}), m.Release(5, (1, 2)), m.Cancel(6),
])
_scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
            | st.binary(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.integers(0, 9), inner, max_size=2),
                       max_leaves=12)
_tags = st.sampled_from([cls.__struct_config__.tag for cls in m.ClientMessage.__args__] + ["welcome", "bogus", ""])
hostile_payloads = st.one_of(
    st.binary(max_size=200),  # random bytes
    st.tuples(_valid, st.integers(0, 200)).map(lambda v: codec.encode(v[0])[: v[1]]),  # truncated msgpack
    st.builds(lambda tag, fields: msgspec.msgpack.encode([tag, *fields]), _tags, st.lists(_values, max_size=6)),  # wrong types / unknown tags
    st.integers(1, 3000).map(lambda n: b"\x91" * n + b"\xc0"),  # deep nesting
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(hostile_payloads, min_size=1, max_size=3))
def test_hostile_frames_get_errors_or_nothing(daemon, bystander, ctx, frames) -> None:  # type: ignore[no-untyped-def]
    sock = raw_socket(ctx, daemon)
    try:
        sock.send_multipart(frames)
        replies = replies_until_probe(sock)
        if len(frames) > 1:
            assert [r.code for r in replies if isinstance(r, m.Error)] == [m.ErrorCode.BAD_MESSAGE]
            return
        try:
            message = codec.decode_client(frames[0])
        except ProtocolError as e:
            assert replies == [m.Error(e.request_id, m.ErrorCode.BAD_MESSAGE, str(e))]
            return
        if isinstance(message, m.Generate):  # valid by chance: do not leave it running
            sock.send(codec.encode(m.Cancel(message.id)))
            replies_until_probe(sock)
        for reply in replies:  # a valid message gets its normal answer or a typed Error
            assert getattr(reply, "id", None) in (None, message.id)
    finally:
        sock.close()


def test_specific_bad_requests_get_their_codes(daemon, bystander, ctx) -> None:  # type: ignore[no-untyped-def]
    sock = raw_socket(ctx, daemon)
    cases = [
        (m.Generate(1, prompt="x", max_tokens=1_000_000), m.ErrorCode.LIMIT),
        (m.Generate(2, prompt="x", temperature=float("nan")), m.ErrorCode.BAD_REQUEST),
        (m.Generate(3, prompt="x", token_ids=(1,)), m.ErrorCode.BAD_REQUEST),
        (m.Generate(4), m.ErrorCode.BAD_REQUEST),
        (m.Generate(5, prompt="x", seed=-1), m.ErrorCode.BAD_REQUEST),
        (m.Generate(6, prompt="x", stop=("s",) * 100), m.ErrorCode.LIMIT),
        (m.Generate(7, prompt="x", model="gpt-9"), m.ErrorCode.UNKNOWN_MODEL),
        (m.Hello(8, m.PROTOCOL_VERSION + 1), m.ErrorCode.VERSION),
        (m.Tokenize(9, "x", model="gpt-9"), m.ErrorCode.UNKNOWN_MODEL),
        (m.Detokenize(10, (10**9,)), m.ErrorCode.BAD_REQUEST),
    ]
    for message, code in cases:
        sock.send(codec.encode(message))
        replies = replies_until_probe(sock)
        assert len(replies) == 1, (message, replies)
        reply = replies[0]
        assert isinstance(reply, m.Error) and (reply.id, reply.code) == (message.id, code), reply
    sock.close()


def test_duplicate_ids_and_stray_cancels_and_releases(daemon, bystander, ctx) -> None:  # type: ignore[no-untyped-def]
    sock = raw_socket(ctx, daemon)
    sock.send(codec.encode(m.Generate(1, prompt="x", max_tokens=4000, ignore_eos=True)))
    sock.send(codec.encode(m.Generate(1, prompt="y", max_tokens=1)))
    sock.send(codec.encode(m.Cancel(99)))  # unknown: ignored
    sock.send(codec.encode(m.Release(1, (0, 1, 10**6))))  # slots it does not hold: ignored
    replies = replies_until_probe(sock)
    assert m.Error(1, m.ErrorCode.DUPLICATE_ID, "request 1 is still running") in replies
    sock.send(codec.encode(m.Cancel(1)))
    while not isinstance(reply := codec.decode_server(sock.recv()), m.Finished):
        assert isinstance(reply, (m.Tokens, m.Ping))
    assert reply.reason == m.FinishReason.CANCELLED
    sock.close()


def test_huge_frame_drops_only_that_connection(daemon, bystander, ctx) -> None:  # type: ignore[no-untyped-def]
    sock = raw_socket(ctx, daemon)
    sock.send(b"\x00" * (2 << 20))  # over max_message_bytes (1 MiB): libzmq disconnects the sender
    sock.close()
    with Client(daemon.socket) as client:
        assert client.health().status == "ok"


def test_flooding_without_reading_is_bounded(daemon, bystander, ctx) -> None:  # type: ignore[no-untyped-def]
    sock = raw_socket(ctx, daemon)
    sock.setsockopt(zmq.SNDHWM, 0)
    for i in range(5000):
        sock.send(codec.encode(m.Stats(i)))
    sock.close()  # never read a single answer
    with Client(daemon.socket) as client:
        assert client.health().status == "ok"


def test_a_flood_of_junk_leaves_a_stream_its_pace(daemon, ctx) -> None:  # type: ignore[no-untyped-def]
    """100,000 junk messages sent at once (each answered with Error{bad_message}): a stream beside them
    never waits a second for its next tokens (the red-team's flood stopped generation for 3.7 s)."""
    stream = PacedStream(daemon.socket, 3000)
    sock = raw_socket(ctx, daemon)
    sock.setsockopt(zmq.SNDHWM, 0)
    for _ in range(100_000):
        sock.send(b"\xff junk")
    largest = stream.finish()
    sock.close()
    assert largest < 1.0, f"largest gap {largest:.2f} s"


def test_the_well_behaved_client_was_served_throughout(bystander) -> None:  # type: ignore[no-untyped-def]
    bystander.stop()
    assert bystander.failures == [] and bystander.served > 0
