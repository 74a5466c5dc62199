"""Tool calls parsed from scripted answers in each family's format (client/tool_calls.py), fed whole, a
character at a time and in uneven pieces — the same text and calls every way — and the gateway's chat
chunks built from such a stream (OpenAI's tool-call deltas, finish_reason tool_calls)."""
from __future__ import annotations

import json
import random

import msgspec
import pytest

from ember.client.gateway.response_format import ChatFormat
from ember.client.tool_calls import ToolCallParser, parse_tool_calls
from ember.protocol.messages import Finished, Usage

WEATHER = {"city": "Zürich", "units": ["c"], "days": 3, "detail": {"wind": True, "rain": None}}
CASES = [
    # (format, answer, its text, its calls as (name, arguments))
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) +
     '}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n',
     "Let me look.\n", [("get_weather", WEATHER), ("add", {"a": 1, "b": 2})]),
    ("hermes", "Plain text with <tool_ in it, and <tool_call> nothing", "Plain text with <tool_ in it, and "
     "<tool_call> nothing", []),
    ("hermes", '<tool_call>\n{"name": "x", "arguments": {"a": ', '<tool_call>\n{"name": "x", "arguments": {"a": ', []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"q\\": 1}"}\n</tool_call>', "", [("f", {"q": 1})]),
    ("llama3", '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}", "",
     [("get_weather", WEATHER)]),
    ("llama3", ' <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', " ",
     [("a", {}), ("b", {"x": 1})]),
    ("llama3", 'It is {"a": 1} as JSON', 'It is {"a": 1} as JSON', []),
    ("llama3", '{"not": "a call"}', '{"not": "a call"}', []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"q": "x"}}, {"name": "g", "arguments": {}}]',
     "Sure. ", [("f", {"q": "x"}), ("g", {})]),
    ("gemma4", 'One moment.<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3,units:[<|"|>c<|"|>],'
     'detail:{wind:true,rain:null}}<tool_call|>', "One moment.",
     [("get_weather", {"city": "Paris, FR", "days": 3, "units": ["c"], "detail": {"wind": True, "rain": None}})]),
    ("gemma4", "<|tool_call>call:broken{city:<tool_call|>", "<|tool_call>call:broken{city:<tool_call|>", []),
]


def pieces(text: str, how: str) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    rng, out, at = random.Random(len(text)), [], 0
    while at < len(text):
        n = rng.randint(1, 7)
        out.append(text[at:at + n])
        at += n
    return out


@pytest.mark.parametrize("how", ["whole", "chars", "uneven"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_text_and_calls_whatever_the_pieces(case: int, how: str) -> None:
    fmt, answer, text, calls = CASES[case]
    parser = ToolCallParser(fmt)
    got_text, got_calls = [], []
    for piece in pieces(answer, how):
        t, c = parser.feed(piece)
        got_text.append(t)
        got_calls += c
    t, c = parser.close()
    got_text.append(t)
    got_calls += c
    assert "".join(got_text) == text
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


def test_a_possible_start_is_held_back_no_longer_than_it_can_be_one() -> None:
    parser = ToolCallParser("hermes")
    assert parser.feed("Hello <tool") == ("Hello ", [])
    assert parser.feed("box> there") == ("<toolbox> there", [])
    with pytest.raises(ValueError, match="no tool-call format"):
        ToolCallParser("xml")


def test_parse_whole_answers() -> None:
    assert parse_tool_calls("hermes", "no calls") == ("no calls", [])


def test_chat_chunks_of_a_streamed_answer_with_calls() -> None:
    """The gateway's chunks: text deltas, one delta per complete call (index, id, name, arguments), no
    <tool_call> text, and finish_reason tool_calls."""
    fmt = ChatFormat("m", tool_format="hermes")
    answer = CASES[0][1]
    body = b"".join(fmt.delta(p, None) for p in pieces(answer, "uneven"))
    body += fmt.closing(Finished(1, "stop", Usage(3, 40)))
    chunks = [msgspec.json.decode(line[6:]) for line in body.split(b"\n\n") if line.startswith(b"data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look.\n"
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert [(c["index"], c["type"], c["function"]["name"]) for c in calls] == [(0, "function", "get_weather"),
                                                                               (1, "function", "add")]
    assert json.loads(calls[0]["function"]["arguments"]) == WEATHER and calls[0]["id"].startswith("call_")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = msgspec.json.decode(fmt.whole([(answer, None, Finished(1, "stop", Usage(3, 40)))]))
    message = whole["choices"][0]["message"]
    assert message["content"] == "Let me look.\n" and len(message["tool_calls"]) == 2
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    cut = msgspec.json.decode(fmt.whole([(answer, None, Finished(1, "length", Usage(3, 40)))]))
    assert cut["choices"][0]["finish_reason"] == "length"  # calls, but cut short: the reason stands


def test_ollama_lines_of_a_streamed_answer_with_calls() -> None:
    """Ollama's NDJSON: text pieces as message.content, each call as message.tool_calls with its
    arguments an object; the whole answer the same."""
    from ember.client.gateway.ollama_api import OllamaFormat

    fmt = OllamaFormat("m", True, 0.0, tool_format="hermes")
    answer = CASES[0][1]
    body = b"".join(fmt.delta(p, None) for p in pieces(answer, "chars"))
    body += fmt.closing(Finished(1, "stop", Usage(3, 40)))
    lines = [msgspec.json.decode(line) for line in body.splitlines()]
    assert "".join(line["message"]["content"] for line in lines) == "Let me look.\n"
    calls = [c["function"] for line in lines for c in line["message"].get("tool_calls", [])]
    assert calls == [{"name": "get_weather", "arguments": WEATHER}, {"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert lines[-1]["done"] and not any(line["done"] for line in lines[:-1])
    whole = msgspec.json.decode(OllamaFormat("m", True, 0.0, "hermes").whole([(answer, None,
                                                                               Finished(1, "stop", Usage(3, 40)))]))
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather", "add"]
