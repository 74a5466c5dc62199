"""Tool calling through the gateway with the real openai SDK, against a real daemon on a copy of the demo
model that carries Qwen3's own chat template (tests/fixtures/qwen3_chat_template.jinja: tools rendered,
calls written as <tool_call> blocks). The demo model cannot call tools on its own, so required and named
calls are the grammar's doing, and their arguments must follow each function's schema (jsonschema
checks); `none` leaves the tools out of the prompt; a history with calls and tool results renders."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import jsonschema
import openai
import pytest
from daemon_process import DaemonProcess
from gateway_setup import DAEMON_CONFIG
from gateway_thread import GatewayThread
from gguf_copy import copy_gguf

from ember.daemon.loader.demo_model import DEMO_MODEL

pytestmark = pytest.mark.slow

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "qwen3_chat_template.jinja").read_text()
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 1000},
                                        "b": {"type": "integer", "maximum": 1000}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "qwen3-tools"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    path = tmp_path_factory.mktemp("tools") / f"{MODEL}.gguf"
    copy_gguf(DEMO_MODEL, path, drop=["tokenizer.chat_template"],
              add={"tokenizer.chat_template": (TEMPLATE, gguf.GGUFValueType.STRING)})
    daemon = DaemonProcess(DAEMON_CONFIG, args=("--model", str(path))).wait_ready(300)
    gateway = GatewayThread(socket=daemon.socket)
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    gateway.stop()
    daemon.stop()


def ask(client: openai.OpenAI, **options: Any) -> Any:
    options = {"model": client.models.list().data[0].id, "messages": CHAT, "tools": TOOLS, "max_tokens": 200,
               "temperature": 1.0, "seed": 1, **options}
    return client.chat.completions.create(**options)


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_the_model_advertises_its_format(client: openai.OpenAI) -> None:
    r = ask(client, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)


def test_required_calls_whole(client: openai.OpenAI) -> None:
    for seed in range(4):
        r = ask(client, tool_choice="required", seed=seed, parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_") and choice.message.content is None
        check_call(call.function.name, call.function.arguments)


def test_parallel_calls_until_max_tokens(client: openai.OpenAI) -> None:
    """Parallel calls allowed, the tiny model calls again and again until max_tokens: every complete call
    comes out as one, and the one cut short as the text it is."""
    r = ask(client, tool_choice="required", seed=0, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and len(choice.message.tool_calls) >= 2
    for call in choice.message.tool_calls:
        check_call(call.function.name, call.function.arguments)
    assert choice.message.content.lstrip().startswith("<tool_call>")


def test_a_named_function_streamed_equals_whole(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    whole = ask(client, tool_choice=named, seed=3, parallel_tool_calls=False)
    calls = whole.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} == {"add"}
    for call in calls:
        check_call("add", call.function.arguments)
    chunks = list(ask(client, tool_choice=named, seed=3, parallel_tool_calls=False, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(calls)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks)  # no <tool_call> text leaks


def test_none_leaves_the_tools_out(client: openai.OpenAI) -> None:
    with_tools = ask(client, tool_choice="auto", max_tokens=1)
    without = ask(client, tool_choice="none", max_tokens=1)
    assert without.usage.prompt_tokens < with_tools.usage.prompt_tokens


def test_a_history_of_calls_and_results(client: openai.OpenAI) -> None:
    history = CHAT + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"temp": 21}'}]
    r = ask(client, messages=history, tool_choice="auto", max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError):  # a tool message must say which call it answers
        ask(client, messages=history[:-1] + [{"role": "tool", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        ask(client, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_langchain_bind_tools_and_structured_output(client: openai.OpenAI) -> None:
    """LangChain's ChatOpenAI: bind_tools with a named tool gives an AIMessage whose tool_calls hold the
    arguments as a dict; with_structured_output, by function calling and by json_schema, gives the
    pydantic object."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Add(BaseModel):
        """Add two numbers."""
        a: int = Field(ge=0, le=1000)
        b: int = Field(ge=0, le=1000)

    llm = langchain_openai.ChatOpenAI(model=client.models.list().data[0].id, base_url=str(client.base_url),
                                      api_key="unused", temperature=1.0, seed=2, max_tokens=120, max_retries=0)
    message = llm.bind_tools([Add], tool_choice="Add", parallel_tool_calls=False).invoke("Add 2 and 3.")
    assert [c["name"] for c in message.tool_calls] == ["Add"]
    Add.model_validate(message.tool_calls[0]["args"])
    for method in ("function_calling", "json_schema"):
        result = llm.with_structured_output(Add, method=method).invoke("Add 2 and 3.")
        assert isinstance(result, Add), method


def test_ollama_tools(client: openai.OpenAI) -> None:
    """Ollama's chat with tools: the calls come back as message.tool_calls, arguments an object; a
    history with calls and a tool result is taken."""
    ollama = pytest.importorskip("ollama")
    model = client.models.list().data[0].id
    host = str(client.base_url).removesuffix("/v1/")
    ol = ollama.Client(host=host)
    tool = {"type": "function", "function": {"name": "add", "description": "Add", "parameters": ADD}}
    r = ol.chat(model=model, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=[tool],
                options={"temperature": 0, "num_predict": 60})
    assert r.message.role == "assistant" and r.done
    history = [{"role": "user", "content": "Add 2 and 3."},
               {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add",
                                                                                  "arguments": {"a": 2, "b": 3}}}]},
               {"role": "tool", "content": "5", "tool_name": "add"}]
    pieces = list(ol.chat(model=model, messages=history, tools=[tool], stream=True,
                          options={"temperature": 0, "num_predict": 16}))
    assert pieces[-1].done


def test_responses_function_calls(client: openai.OpenAI) -> None:
    """The Responses API: function tools, a named call as a function_call output item (whole and
    streamed, the same), and the call's output sent back as a function_call_output item."""
    model = client.models.list().data[0].id
    tools = [{"type": "function", "name": "add", "description": "Add", "parameters": ADD}]
    options = dict(model=model, input="Add 2 and 3.", tools=tools, tool_choice={"type": "function", "name": "add"},
                   parallel_tool_calls=False, temperature=1.0, max_output_tokens=120, extra_body={"seed": 5})
    r = client.responses.create(**options)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add" and r.status == "completed"
    check_call("add", calls[0].arguments)
    events = list(client.responses.create(**options, stream=True))
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.item.name, e.item.arguments) for e in done] == [(calls[0].name, calls[0].arguments)]
    assert not any(e.type == "response.output_text.delta" for e in events)
    follow = client.responses.create(model=model, tools=tools, max_output_tokens=8, previous_response_id=r.id,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "5"}])
    assert follow.status in ("completed", "incomplete")
