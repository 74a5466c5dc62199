"""Ollama's API on the gateway (client/gateway/ollama_api.py), driven by the real `ollama` package
against a real daemon on the demo model; the reference is the native SDK asking the same daemon the
same thing (greedy, so the texts must be equal)."""
from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from gateway_setup import MODEL
from gateway_thread import GatewayThread

ollama = pytest.importorskip("ollama")

CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
GREEDY = {"temperature": 0, "num_predict": 16, "repeat_penalty": 1.0, "seed": 3}


@pytest.fixture(scope="module")
def client(gateway: GatewayThread) -> Any:
    return ollama.Client(host=gateway.url)


def test_list_show_ps_version_and_the_probe(client: Any, gateway: GatewayThread) -> None:
    assert [m.model for m in client.list().models] == [MODEL]
    shown = client.show(MODEL)
    assert shown.details.family == "qwen3" and shown.modelinfo["qwen3.context_length"] > 0
    assert [m.model for m in client.ps().models] == [MODEL]
    with urllib.request.urlopen(f"{gateway.url}/api/version") as r:
        assert json.loads(r.read())["version"]
    with urllib.request.urlopen(f"{gateway.url}/") as r:
        assert r.read() == b"Ollama is running"


def test_chat_streamed_and_whole_match_the_native_sdk(client: Any, native: Any) -> None:
    want = "".join(c.text for c in native.chat(CHAT, max_tokens=16, temperature=0.0, seed=3))
    pieces = list(client.chat(model=MODEL, messages=CHAT, stream=True, options=GREEDY))
    assert "".join(p.message.content for p in pieces) == want
    assert all(not p.done for p in pieces[:-1]) and pieces[-1].done and pieces[-1].done_reason == "length"
    assert pieces[-1].eval_count == 16 and pieces[-1].prompt_eval_count > 0
    whole = client.chat(model=f"{MODEL}:latest", messages=CHAT, stream=False, options=GREEDY)  # Ollama's default tag
    assert whole.message.role == "assistant" and whole.message.content == want and whole.done


def test_generate_is_a_one_turn_chat_unless_raw(client: Any, native: Any) -> None:
    chat = "".join(c.text for c in native.chat([{"role": "user", "content": "def f(x):"}], max_tokens=16,
                                               temperature=0.0))
    assert client.generate(model=MODEL, prompt="def f(x):", options=GREEDY).response == chat
    raw = "".join(c.text for c in native.generate("def f(x):", max_tokens=16, temperature=0.0))
    pieces = list(client.generate(model=MODEL, prompt="def f(x):", raw=True, stream=True, options=GREEDY))
    assert "".join(p.response for p in pieces) == raw and pieces[-1].done


def test_loading_stop_strings_and_errors(client: Any) -> None:
    assert client.generate(model=MODEL, prompt="").done_reason == "load"  # Ollama's "load the model"
    stopped = client.generate(model=MODEL, prompt="def f(x):", raw=True, options={**GREEDY, "stop": ["\n"]})
    assert "\n" not in stopped.response and stopped.done_reason == "stop"
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="llama3", messages=CHAT)
    assert missing.value.status_code == 404 and "llama3" in missing.value.error
    with pytest.raises(ollama.ResponseError) as unsupported:
        client.chat(model=MODEL, messages=CHAT, format={"type": "object", "required": 5})  # a broken schema
    assert unsupported.value.status_code == 400 and "grammar" in unsupported.value.error
    with pytest.raises(ollama.ResponseError) as no_embeddings:
        client.embed(model=MODEL, input="x")
    assert no_embeddings.value.status_code == 404
