"""OpenAI request -> ember Generate, the gateway's configuration and the shape of its answers, without a
daemon: the rules that decide what a client gets before anything is sent."""
from __future__ import annotations

import asyncio
import json

import pytest
from ember.client.errors import (
    BadRequest,
    Busy,
    ConnectionLost,
    GenerationFailed,
    LimitExceeded,
    ShuttingDown,
    UnknownModel,
)
from ember.client.gateway import token_texts
from ember.client.gateway.config import (
    GatewayConfig,
    GatewayConfigError,
    is_loopback,
    parse_listen,
)
from ember.client.gateway.errors import ApiError, from_ember
from ember.client.gateway.openai_schema import ChatRequest, CompletionRequest
from ember.client.gateway.request_translation import (
    decode_body,
    translate_chat,
    translate_completion,
)
from ember.client.gateway.response_format import ChatFormat, TextFormat, TokenScore
from ember.client.gateway.structured_output import ollama_grammar, responses_grammar
from ember.client.gateway.token_texts import TokenTexts
from ember.protocol.messages import Finished, Grammar, Usage


def chat(**body: object):  # type: ignore[no-untyped-def]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return translate_chat(decode_body(json.dumps(body).encode(), ChatRequest))  # type: ignore[arg-type]


def completion(**body: object):  # type: ignore[no-untyped-def]
    body = {"model": "m", "prompt": "hi", **body}
    return translate_completion(decode_body(json.dumps(body).encode(), CompletionRequest))  # type: ignore[arg-type]


def refused(call, param: str | None = None, **body: object) -> ApiError:  # type: ignore[no-untyped-def]
    with pytest.raises(ApiError) as e:
        call(**body)
    assert e.value.status == 400
    if param is not None:
        assert e.value.param == param, e.value.message
    return e.value


def test_sampling_left_out_is_left_to_the_model() -> None:
    t = chat()
    o = t.options  # None: the daemon fills in the model's recommended sampling, not OpenAI's temperature 1
    assert (o["temperature"], o["top_p"], o["top_k"], o["min_p"], o["repetition_penalty"]) == (None,) * 5
    assert t.max_tokens is None and t.logprobs is None and not t.stream and not t.include_usage
    assert t.messages is not None and t.messages[0].role == "user" and t.prompt is None


def test_sampling_fields_and_extras_pass_through() -> None:
    t = chat(temperature=0, top_p=0.5, seed=-1, stop="\n", frequency_penalty=0.5, presence_penalty=-0.5,
             logit_bias={"42": 5, "7": -100}, top_k=3, min_p=0.1, repetition_penalty=1.2, max_tokens=9)
    o = t.options
    assert (o["temperature"], o["top_p"], o["top_k"], o["min_p"], o["repetition_penalty"]) == (0, 0.5, 3, 0.1, 1.2)
    assert o["seed"] == 2**64 - 1  # OpenAI's signed seeds, modulo ember's unsigned range
    assert o["stop"] == ("\n",) and o["logit_bias"] == {42: 5.0, 7: -100.0} and t.max_tokens == 9
    assert chat(max_tokens=5, max_completion_tokens=7).max_tokens == 7
    assert chat(stop=["a", "b"]).options["stop"] == ("a", "b")


def test_logprobs_fields() -> None:
    assert chat(logprobs=True).logprobs == 0 and chat(logprobs=True, top_logprobs=3).logprobs == 3
    assert chat(logprobs=False).options["logprobs"] is False
    refused(chat, "top_logprobs", top_logprobs=2)
    assert completion(logprobs=2).logprobs == 2 and completion().logprobs is None
    t = completion(logprobs=0)
    assert t.options["logprobs"] is True and t.options["top_logprobs"] == 0


def test_streaming_flags() -> None:
    assert chat(stream=True).stream and not chat(stream=True).include_usage
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=False, stream_options={"include_usage": True}).include_usage


def test_messages_roles_and_content_parts() -> None:
    t = chat(messages=[{"role": "developer", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                       {"role": "assistant", "content": None}])
    assert [(m.role, m.content) for m in t.messages or ()] == [("system", "be brief"), ("user", "a\nb"), ("assistant", "")]
    refused(chat, "messages[0].role", messages=[{"role": "critic", "content": "x"}])
    refused(chat, "messages[0].tool_call_id", messages=[{"role": "tool", "content": "x"}])
    refused(chat, "messages[0].content[0]", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    refused(chat, "messages[0].content", messages=[{"role": "user", "content": None}])


def test_tools_tool_choice_and_a_history_of_calls() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g", "description": "G"}}]
    history = [{"role": "user", "content": "go"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                   {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {"y": [2]}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "one"}]
    t = chat(messages=history, tools=tools)
    o = t.options
    assert [(x.name, x.description, json.loads(x.parameters)) for x in o["tools"]] == [
        ("f", "", {"type": "object"}), ("g", "G", {"type": "object", "properties": {}})]
    assert (o["tool_choice"], o["tool_name"], o["parallel_tool_calls"]) == ("auto", "", True)
    calls = t.messages[1].tool_calls
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [("c1", "f", {"x": 1}), ("c2", "g", {"y": [2]})]
    assert (t.messages[2].role, t.messages[2].tool_call_id) == ("tool", "c1")
    named = chat(tools=tools, tool_choice={"type": "function", "function": {"name": "g"}}, parallel_tool_calls=False)
    assert (named.options["tool_choice"], named.options["tool_name"], named.options["parallel_tool_calls"]) == (
        "required", "g", False)
    assert chat(tools=tools, tool_choice="none").options["tool_choice"] == "none"
    refused(chat, "tool_choice", tools=tools, tool_choice={"type": "function", "function": {"name": "h"}})
    refused(chat, "tool_choice", tool_choice="required")  # no tools
    refused(chat, "tools[0].type", tools=[{"type": "retrieval", "function": {"name": "f"}}])
    refused(chat, "messages[0].tool_calls", messages=[{"role": "user", "content": "x", "tool_calls": calls_in(1)}])
    refused(chat, "functions", functions=[{"name": "f"}])


def calls_in(n: int) -> list[dict[str, object]]:
    return [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(n)]


def test_prompt_shapes() -> None:
    assert completion(prompt="x").prompt == "x"
    assert completion(prompt=["x"]).prompt == "x"
    assert completion(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert completion(prompt=[[4, 5]]).prompt == [4, 5]
    several = completion(prompt=["a", [1, 2]], n=2, seed=7)  # a list of prompts: n completions each
    assert several.prompts == ["a", [1, 2]] and several.choices == 4
    assert [several.prompt_of(i) for i in range(4)] == ["a", "a", [1, 2], [1, 2]]
    assert [several.choice(i)["seed"] for i in range(4)] == [7, 8, 7, 8]
    for bad in ([], [1, "a"], ["a"] * 9):  # empty, mixed, over 16 completions with n=2
        refused(completion, "prompt", prompt=bad, n=2)


@pytest.mark.parametrize("body,param", [
    ({"n": 17}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"stop": ["ok", ""]}, "stop"), ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"), ({"max_tokens": "ten"}, "max_tokens"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    ({"temperature": "hot"}, "temperature"), ({"messages": "hi"}, "messages"),
])
def test_bad_chat_fields_are_400_naming_the_field(body: dict[str, object], param: str) -> None:
    error = refused(chat, param, **body)
    assert error.type == "invalid_request_error" and error.message


def test_every_api_names_its_structured_output_as_one_grammar() -> None:
    """OpenAI's response_format, llama.cpp's and vLLM's extras, the Responses API's text.format and
    Ollama's format all become the Generate's one Grammar (the daemon checks the schema itself)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    as_schema = Grammar("json_schema", json.dumps(schema, separators=(",", ":")))
    cases = [
        (chat(), None), (chat(response_format={"type": "text"}), None),
        (chat(response_format={"type": "json_object"}), Grammar("json")),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}),
         as_schema),
        (chat(json_schema=schema), as_schema), (completion(guided_json=json.dumps(schema)), as_schema),
        (completion(grammar='root ::= "yes" | "no"'), Grammar("gbnf", 'root ::= "yes" | "no"')),
        (completion(guided_regex="[0-9]+"), Grammar("regex", "[0-9]+")),
        (chat(guided_choice=["yes", "no"]), Grammar("choice", '["yes","no"]')),
    ]
    for translated, grammar in cases:
        assert translated.options["grammar"] == grammar
    assert responses_grammar({"format": {"type": "json_schema", "name": "a", "schema": schema}}) == as_schema
    assert responses_grammar({"format": {"type": "json_object"}}) == Grammar("json")
    assert responses_grammar({"format": {"type": "text"}}) is responses_grammar(None) is None
    assert ollama_grammar("json") == Grammar("json") and ollama_grammar(schema) == as_schema
    assert ollama_grammar("") is None
    for bad in (lambda: responses_grammar({"format": {"type": "yaml"}}), lambda: ollama_grammar("yaml"),
                lambda: completion(guided_json="{nope")):
        with pytest.raises(ApiError):
            bad()


def test_bad_completion_fields() -> None:
    refused(completion, "echo", echo=True)
    refused(completion, "suffix", suffix="x")
    refused(completion, "best_of", best_of=2)
    with pytest.raises(ApiError, match="missing required field `model`"):
        decode_body(b'{"prompt": "x"}', CompletionRequest)
    with pytest.raises(ApiError, match="not valid JSON"):
        decode_body(b'{"prompt": ', CompletionRequest)


def test_sdk_errors_map_to_statuses_the_openai_sdk_knows() -> None:
    cases = [(UnknownModel("x"), 404), (BadRequest("x"), 400), (LimitExceeded("x"), 400), (Busy("x"), 429),
             (ShuttingDown("x"), 503), (ConnectionLost("x"), 503), (GenerationFailed("x"), 500)]
    for error, status in cases:
        mapped = from_ember(error)
        assert mapped.status == status and mapped.message == "x"  # the daemon's reason, unchanged
    # a limit names the field it bounds (protocol/limits.py writes the limit first)
    for message, param in (("max_tokens: 5000 is over the limit of 4096", "max_tokens"),
                            ("stop strings: 17 is over the limit of 16", "stop"),
                            ("tool bytes: 300000 is over the limit of 262144", "tools"), ("prompt tokens: many", None)):
        assert from_ember(LimitExceeded(message)).param == param


def test_listen_addresses_and_exposure() -> None:
    assert parse_listen("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_listen("[::1]:9") == ("::1", 9)
    for bad in ("8000", "localhost", ":80", "host:port"):
        with pytest.raises(GatewayConfigError, match="HOST:PORT"):
            parse_listen(bad)
    assert is_loopback("localhost") and is_loopback("::1") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org") and not is_loopback("192.168.1.2")
    with pytest.raises(GatewayConfigError, match="refusing to listen on 0.0.0.0:8000 without an API key"):
        GatewayConfig(host="0.0.0.0")
    assert GatewayConfig(host="0.0.0.0", api_key="k").api_key == "k"
    with pytest.raises(GatewayConfigError):
        GatewayConfig(max_requests=0)


def test_chat_chunks_carry_usage_only_when_asked() -> None:
    plain, counted = ChatFormat("m"), ChatFormat("m", include_usage=True)
    chunk = json.loads(plain.delta("x", None)[len(b"data: "):])
    assert "usage" not in chunk and chunk["choices"][0] == {"index": 0, "delta": {"content": "x"}, "logprobs": None,
                                                           "finish_reason": None}
    assert json.loads(counted.delta("x", None)[6:])["usage"] is None
    assert json.loads(plain.opening()[6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(plain.closing(Finished(1, "stop", Usage(3, 4)))[6:])["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                                                  "finish_reason": "stop"}
    last = json.loads(counted.usage(Usage(3, 4))[6:])
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_text_completion_logprobs_offsets() -> None:
    fmt = TextFormat("m")
    first = json.loads(fmt.delta("ab", [TokenScore("a", -1.0, [("a", -1.0), ("c", -2.0)]), TokenScore("b", -0.5, [])])[6:])
    second = json.loads(fmt.delta("é", [TokenScore("é", -0.1, [])])[6:])
    assert first["choices"][0]["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [-1.0, -0.5],
                                               "top_logprobs": [{"a": -1.0, "c": -2.0}, {}], "text_offset": [0, 1]}
    assert second["choices"][0]["logprobs"]["text_offset"] == [2]  # offsets run on across chunks
    whole = json.loads(TextFormat("m").whole([("x", None, Finished(1, "length", Usage(1, 1)))]))
    assert whole["object"] == "text_completion" and whole["usage"]["total_tokens"] == 2
    assert whole["choices"][0] == {"text": "x", "index": 0, "logprobs": None, "finish_reason": "length"}


@pytest.mark.asyncio
async def test_token_texts_wait_out_a_busy_daemon_and_give_up_on_one_that_stays_busy(monkeypatch) -> None:
    """A daemon that takes 2 tokenizer requests at once answers the rest Busy: the texts of a burst's
    12 ids still all come (retried), each fetched once; a daemon busy for good fails the request."""
    in_flight, calls = 0, []

    async def small_daemon(ids: list[int], model: str) -> str:
        nonlocal in_flight
        if in_flight >= 2:
            raise Busy("2 tokenizer requests in flight: retry later")
        in_flight += 1
        try:
            await asyncio.sleep(0.002)
            calls.append(ids[0])
            return f"<{ids[0]}>"
        finally:
            in_flight -= 1

    texts = await TokenTexts(small_daemon).texts("m", range(12))
    assert texts == {i: f"<{i}>" for i in range(12)} and sorted(calls) == list(range(12))

    async def always_busy(ids: list[int], model: str) -> str:
        raise Busy("retry later")

    monkeypatch.setattr(token_texts, "BUSY_PATIENCE", 0.05)
    with pytest.raises(Busy):
        await TokenTexts(always_busy).texts("m", [1])
