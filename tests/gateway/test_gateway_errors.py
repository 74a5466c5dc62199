"""Errors through the openai SDK: each raised as the SDK's exception type for its status (400, 401, 404,
413, 429, 503), with the daemon's reason in the message, and nothing lost: the gateway serves on."""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from gateway_setup import API_KEY, MODEL
from gateway_thread import GatewayThread

PROMPT = "def fibonacci(n):"


def keyed(gateway: GatewayThread, key: str | None = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key or "", max_retries=0, timeout=60)


def still_serves(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens == 2


@pytest.mark.parametrize("body,says", [
    ({"temperature": -1.0}, "temperature must be in"),  # the daemon's range and words
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"n": 17}, "n must be in [1, 16]"),
    ({"logit_bias": {"x1": 3}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"99999999": 3}}, "token ids must be in"),
    ({"max_tokens": 100000}, "over the limit of 4096"),  # the daemon's limits.max_tokens
    ({"stop": ["s"] * 40}, "stop strings: 40 is over the limit"),
])
def test_bad_values_are_bad_request_with_the_reason(client: openai.OpenAI, body: dict[str, Any], says: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=body.pop("max_tokens", 4), extra_body=body)
    assert e.value.status_code == 400 and says in e.value.message and e.value.type == "invalid_request_error"
    still_serves(client)


def test_a_prompt_over_the_context_is_context_length_exceeded(client: openai.OpenAI) -> None:
    """OpenAI's code and wording, which litellm (ContextWindowExceededError) and LangChain look for; by
    the text's size before tokenizing, and by its tokens after."""
    for prompt in ("x" * 300_000, list(range(1, 3000)) * 2):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)  # type: ignore[arg-type]
        assert e.value.code == "context_length_exceeded" and "maximum context length is" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def f(x): " * 3000}])
    assert e.value.code == "context_length_exceeded" and "However, your prompt resulted in" in e.value.message
    still_serves(client)


def test_unknown_model_and_path_are_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found" and "gpt-9" in e.value.message and MODEL in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.post("/no/such/path", cast_to=object, body={})
    with pytest.raises(openai.NotFoundError):  # streamed: refused before the stream starts
        client.completions.create(model="gpt-9", prompt="x", stream=True)


def test_api_key(keyed_gateway: GatewayThread) -> None:
    with keyed(keyed_gateway, "sk-wrong") as client, pytest.raises(openai.AuthenticationError) as e:
        client.models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key" and "Incorrect API key" in e.value.message
    with keyed(keyed_gateway) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        still_serves(client)
    with pytest.raises(urllib.error.HTTPError) as missing:  # the openai SDK always sends one
        urllib.request.urlopen(f"{keyed_gateway.url}/v1/models")
    assert missing.value.code == 401 and b"No API key provided" in missing.value.read()
    with pytest.raises(urllib.error.HTTPError) as scrape:
        urllib.request.urlopen(f"{keyed_gateway.url}/metrics")
    assert scrape.value.code == 401
    with urllib.request.urlopen(f"{keyed_gateway.url}/health") as r:  # liveness probes carry no key
        assert r.status == 200


def test_oversize_body_is_413_before_it_is_read(keyed_gateway: GatewayThread) -> None:
    with keyed(keyed_gateway) as client:
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt="x" * 100_000, max_tokens=1)
        assert e.value.status_code == 413 and "at most 65536 bytes" in e.value.message
        still_serves(client)


def test_daemon_busy_is_429_with_its_reason(client: openai.OpenAI, native: Any) -> None:
    streams = [native.generate(PROMPT, max_tokens=3000, ignore_eos=True) for _ in range(6)]  # 3 running, 3 queued
    try:
        deadline = time.monotonic() + 10
        while (s := native.stats()).active + s.queued < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert e.value.status_code == 429 and e.value.code == "busy" and "queue" in e.value.message
    finally:
        for stream in streams:
            stream.close()
    still_serves(client)


def test_gateway_limit_on_requests_is_429(keyed_gateway: GatewayThread) -> None:
    with keyed(keyed_gateway) as client:
        held = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3000, stream=True,
                                          extra_body={"ignore_eos": True}) for _ in range(2)]  # max_requests=2
        try:
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert e.value.code == "gateway_busy" and "--max-requests" in e.value.message
        finally:
            for stream in held:
                stream.close()
        deadline = time.monotonic() + 10  # the slots come back once the daemon confirms the cancellations
        while True:
            try:
                return still_serves(client)
            except openai.RateLimitError:
                assert time.monotonic() < deadline
                time.sleep(0.05)


def test_no_daemon_is_503(tmp_path: Any) -> None:
    gateway = GatewayThread(socket=tmp_path / "nothing.sock")
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.InternalServerError) as e:
                client.completions.create(model=MODEL, prompt="x", max_tokens=1)
            assert e.value.status_code == 503 and "no ember daemon" in e.value.message
            with pytest.raises(openai.InternalServerError):
                client.models.list()
    finally:
        gateway.stop()


def http(url: str, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_http_manners_slash_405_options_and_utf8(gateway: GatewayThread) -> None:
    """A trailing slash is the same path; a wrong method is 405 with `Allow`; OPTIONS answers `Allow`
    (no CORS headers unless origins are allowed); a body that is not UTF-8 is 400, not 500."""
    status, _, body = http(f"{gateway.url}/v1/models/")
    assert status == 200 and MODEL.encode() in body
    status, headers, body = http(f"{gateway.url}/v1/chat/completions")
    assert status == 405 and headers["Allow"] == "POST" and b'"error"' in body
    status, headers, _ = http(f"{gateway.url}/v1/chat/completions", "OPTIONS", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert status == 204 and headers["Allow"] == "OPTIONS, POST" and "Access-Control-Allow-Origin" not in headers
    bad = b'{"model": "ember-demo", "prompt": "\xff\xfe", "max_tokens": 2}'
    status, _, body = http(f"{gateway.url}/v1/completions", "POST", bad, {"Content-Type": "application/json"})
    assert status == 400 and b"not valid UTF-8" in body


def test_cors_for_allowed_origins_streams_included(daemon: Any) -> None:
    """--cors-origin: the preflight (without the API key) and every response to that origin, a stream's
    too, carry the CORS headers; another origin gets none."""
    gateway = GatewayThread(socket=daemon.socket, api_key=API_KEY, cors_origins=("http://localhost:3000",))
    try:
        page = {"Origin": "http://localhost:3000"}
        status, headers, _ = http(f"{gateway.url}/v1/chat/completions", "OPTIONS", headers={
            **page, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"})
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        assert headers["Access-Control-Allow-Methods"] == "OPTIONS, POST"
        assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        body = b'{"model": "ember-demo", "prompt": "def f(x):", "max_tokens": 2, "stream": true}'
        status, headers, data = http(f"{gateway.url}/v1/completions", "POST", body, {
            **page, "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        assert data.rstrip().endswith(b"data: [DONE]")
        status, headers, _ = http(f"{gateway.url}/v1/models", headers={"Origin": "http://evil.example"})
        assert status == 401 and "Access-Control-Allow-Origin" not in headers
    finally:
        gateway.stop()
