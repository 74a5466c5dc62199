"""Wire messages, codec and limits: no daemon, no model."""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.protocol import messages as m
from ember.protocol.codec import Codec, ProtocolError
from ember.protocol.limits import ContextLengthExceeded, LimitExceeded, Limits

codec = Codec()

CLIENT_SAMPLES = [
    m.Hello(1, m.PROTOCOL_VERSION, "test"),
    m.Generate(2, prompt="def f(x):", max_tokens=5, stop=("\n\n",), logit_bias={3: -1.5}, seed=7),
    m.Generate(3, token_ids=(1, 2, 3), return_logits=True, logprobs=True, top_logprobs=2),
    m.Generate(4, messages=(m.ChatMessage("user", "hi"),), model="x"),
    m.Cancel(5), m.Release(6, (0, 3)), m.Tokenize(7, "text", "", False), m.Detokenize(8, (1, 2)),
    m.ListModels(9), m.Health(10), m.Stats(11),
]
SERVER_SAMPLES = [
    m.Welcome(1, 1, "ember/0.1.0", (m.ModelInfo("demo", "qwen3", 8192, 4096, True),)),
    m.Tokens(2, (5,), "x", (-0.5,), ((m.TopLogprob(5, -0.5), m.TopLogprob(6, -1.0)),),
             (m.ShmSlot("ember-1-0123456789abcdef", 0, 0, (1, 8192)),)),
    m.Tokens(2, (), "tail"),
    m.Finished(2, m.FinishReason.STOP, m.Usage(3, 4), m.Timings(1.0, 2.0, 3.0, 6.0)),
    m.Error(None, m.ErrorCode.BAD_MESSAGE, "nope"), m.TokenIds(3, (1, 2)), m.Text(4, "hi"),
    m.Models(5, ()), m.HealthStatus(6, "ok", 1.5),
    m.StatsReport(7, 1.0, 1, 2, 3, 4, 5, 6, 7, 8), m.Ping(),
]


@pytest.mark.parametrize("message", CLIENT_SAMPLES, ids=lambda x: type(x).__name__)
def test_client_messages_round_trip(message: m.Wire) -> None:
    assert codec.decode_client(codec.encode(message)) == message


@pytest.mark.parametrize("message", SERVER_SAMPLES, ids=lambda x: type(x).__name__)
def test_server_messages_round_trip(message: m.Wire) -> None:
    assert codec.decode_server(codec.encode(message)) == message


def test_tags_are_unique_and_first() -> None:
    for union in (m.ClientMessage, m.ServerMessage):
        tags = [cls.__struct_config__.tag for cls in union.__args__]
        assert len(set(tags)) == len(tags)
    assert msgspec.msgpack.decode(codec.encode(m.Cancel(9))) == ["cancel", 9]


def test_a_newer_peers_extra_trailing_fields_are_ignored() -> None:
    """The versioning rule's basis: fields appended by a newer version do not break an older reader."""
    newer = msgspec.msgpack.encode(["cancel", 9, "a field from the future", [1, 2]])
    assert codec.decode_client(newer) == m.Cancel(9)
    newer_finished = msgspec.msgpack.decode(codec.encode(SERVER_SAMPLES[3])) + [42]
    assert codec.decode_server(msgspec.msgpack.encode(newer_finished)) == SERVER_SAMPLES[3]


def test_missing_trailing_fields_take_defaults() -> None:
    assert codec.decode_client(msgspec.msgpack.encode(["generate", 3, "", "hi"])) == m.Generate(3, prompt="hi")


@pytest.mark.parametrize("data, request_id", [
    (b"", None), (b"\xc1", None), (msgspec.msgpack.encode(["nope", 1]), None),
    (msgspec.msgpack.encode(["generate", 7, 5]), 7), (msgspec.msgpack.encode(["cancel", "x"]), None),
    (msgspec.msgpack.encode({"id": 1}), None), (b"\x91" * 100_000 + b"\x00", None),
    (codec.encode(m.Generate(4, prompt="x"))[:-3], None),
])
def test_bad_bytes_raise_protocol_error_with_the_id_when_readable(data: bytes, request_id: int | None) -> None:
    with pytest.raises(ProtocolError) as info:
        codec.decode_client(data)
    assert info.value.request_id == request_id
    assert info.value.code == m.ErrorCode.BAD_MESSAGE


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_escape_as_other_exceptions(data: bytes) -> None:
    try:
        codec.decode_client(data)
    except ProtocolError:
        pass


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=10) | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=20,
)
_tags = st.sampled_from([cls.__struct_config__.tag for cls in m.ClientMessage.__args__] + ["bogus", ""])


@settings(max_examples=300, deadline=None)
@given(_tags, st.lists(_values, max_size=8))
def test_structured_garbage_decodes_or_raises_protocol_error(tag: str, fields: list[object]) -> None:
    data = msgspec.msgpack.encode([tag, *fields])
    try:
        message = codec.decode_client(data)
    except ProtocolError:
        return
    assert isinstance(message, m.ClientMessage.__args__)


def test_limits_check_each_count() -> None:
    limits = Limits(max_tokens=10, max_stop_strings=2, max_stop_chars=3, max_stop_ids=1, max_logit_bias=1,
                    max_prompt_tokens=4, max_chat_messages=1)
    limits.check_generate(m.Generate(1, prompt="x", max_tokens=10, stop=("abc",)))
    bad = [
        m.Generate(1, prompt="x", max_tokens=1_000_000),
        m.Generate(1, prompt="x", stop=("a", "b", "c")),
        m.Generate(1, prompt="x", stop=("abcd",)),
        m.Generate(1, prompt="x", stop_ids=(1, 2)),
        m.Generate(1, prompt="x", logit_bias={1: 1.0, 2: 1.0}),
        m.Generate(1, token_ids=(1, 2, 3, 4, 5)),
        m.Generate(1, messages=(m.ChatMessage("user", "a"), m.ChatMessage("user", "b"))),
        m.Generate(1, prompt="x", top_logprobs=21),
    ]
    for msg in bad:
        with pytest.raises(LimitExceeded):
            limits.check_generate(msg)
    with pytest.raises(LimitExceeded, match="prompt tokens"):
        limits.check_prompt(5, context_length=100)
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 101 tokens. However, your prompt "
                                                    "resulted in 200 tokens") as err:
        Limits().check_prompt(200, context_length=100)
    assert err.value.code == "context_length_exceeded"  # OpenAI's code, which litellm and LangChain look for


def test_limits_refuse_nonsense_values() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        Limits(max_tokens=0)
    with pytest.raises(ValueError, match="max_message_bytes"):
        Limits(max_message_bytes=1 << 30)
