"""Gemma 4 through the gateway with the real openai SDK: a tiny random Gemma 4 (Hugging Face
directory) carrying Gemma 4's own chat template (google-gemma-4-31B-it.jinja, from llama.cpp's
sources), served by a real daemon whose sliding layers keep their window in rings. Chat completions
render that template (the prompt the daemon counts is the template's), streamed equals whole, a seeded
sampled request repeats, and tools are rendered in Gemma's format (a required call is refused: its
calls are parsed, not enforced, docs/gateway.md)."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from daemon_process import DaemonProcess
from gateway_setup import DAEMON_CONFIG
from gateway_thread import GatewayThread

import ember

pytestmark = pytest.mark.slow

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bonjour ! Quel temps fait-il ?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, Path]]:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from llama_cpp_tools import llama_cpp_file
    from tiny_models import build_hf_model

    template = llama_cpp_file("models/templates/google-gemma-4-31B-it.jinja").read_text(encoding="utf-8")
    path, _ = build_hf_model("gemma4", tmp_path_factory.mktemp("gemma4") / "gemma4-tiny")
    (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    config = DAEMON_CONFIG.replace("[engine]\n", "[engine]\nmax_step_tokens = 16\nctx = 512\n")  # rings on
    daemon = DaemonProcess(config, args=("--model", str(path))).wait_ready(300)
    gateway = GatewayThread(socket=daemon.socket)
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c, path
    gateway.stop()
    daemon.stop()


def ask(client: openai.OpenAI, **options: Any) -> Any:
    options = {"model": client.models.list().data[0].id, "messages": CHAT, "max_tokens": 24, **options}
    return client.chat.completions.create(**options)


def test_chat_renders_gemmas_template(served) -> None:  # type: ignore[no-untyped-def]
    client, path = served
    model = ember.load(path)
    prompt = model.render_chat(CHAT)
    assert "<|turn>system\nBe brief.<turn|>\n<|turn>user\nBonjour" in prompt and "<|turn>model\n" in prompt
    whole = ask(client, temperature=0.0)
    assert whole.usage.prompt_tokens == len(model.chat_ids(CHAT))
    assert whole.usage.completion_tokens == 24 and isinstance(whole.choices[0].message.content, str)
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(client, temperature=0.0, stream=True)
                       if c.choices)
    assert streamed == whole.choices[0].message.content
    sampled = [ask(client, temperature=0.9, top_p=0.9, seed=5).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_tools_in_gemmas_format(served) -> None:  # type: ignore[no-untyped-def]
    client, _ = served
    with_tools = ask(client, tools=TOOLS, tool_choice="auto", max_tokens=1)
    without = ask(client, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert without.usage.prompt_tokens < with_tools.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="(?i)gemma4"):
        ask(client, tools=TOOLS, tool_choice="required")
