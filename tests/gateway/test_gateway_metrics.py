"""/metrics, read with prometheus_client's own parser: the gateway's counters agree with what the
clients were told (usage), the latency histograms count every request and token, the daemon's figures
are there, and a gateway without a daemon says so (ember_daemon_up 0) instead of failing."""
from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from gateway_setup import MODEL
from gateway_thread import GatewayThread
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"{url}/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def fresh_gateway(daemon: Any):  # type: ignore[no-untyped-def]
    gateway = GatewayThread(socket=daemon.socket)  # its own registry: counts start at zero
    yield gateway
    gateway.stop()


def test_counters_and_histograms_agree_with_usage(fresh_gateway: GatewayThread) -> None:
    usages = []
    with openai.OpenAI(base_url=f"{fresh_gateway.url}/v1", api_key="x", max_retries=0) as client:
        for _ in range(2):
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=7,
                                               temperature=0, extra_body={"ignore_eos": True})
            usages.append(r.usage)
        stream = client.completions.create(model=MODEL, prompt="import", max_tokens=9, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usages.append([c for c in stream][-1].usage)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x", max_tokens=1)
    m = scrape(fresh_gateway.url)

    def requests(endpoint: str, status: str) -> float:
        return m.get(("ember_gateway_requests_total", (("endpoint", endpoint), ("status", status))), 0.0)

    assert requests("/v1/chat/completions", "200") == 2 and requests("/v1/completions", "200") == 1
    assert requests("/v1/completions", "404") == 1
    assert m[("ember_gateway_prompt_tokens_total", ())] == sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert m[("ember_gateway_generation_tokens_total", ())] == generated == 2 * 7 + 9
    assert m[("ember_gateway_time_to_first_token_seconds_count", ())] == 3
    assert m[("ember_gateway_request_duration_seconds_count", ())] == 4  # the 404 too: it asked the daemon
    # one interval per token after each request's first frame (one token per frame here)
    assert m[("ember_gateway_inter_token_latency_seconds_count", ())] == generated - 3
    assert m[("ember_gateway_inter_token_latency_seconds_bucket", (("le", "+Inf"),))] == generated - 3
    assert m[("ember_gateway_requests_in_flight", ())] == 0


def test_daemon_figures(fresh_gateway: GatewayThread, native: Any) -> None:
    m = scrape(fresh_gateway.url)
    stats = native.stats()
    assert m[("ember_daemon_up", ())] == 1
    assert m[("ember_requests_running", ())] == 0 and m[("ember_requests_waiting", ())] == 0
    assert m[("ember_kv_blocks_used", ())] + m[("ember_kv_blocks_free", ())] == stats.kv_blocks_used + stats.kv_blocks_free
    assert m[("ember_kv_blocks_free", ())] > 0 and 0 <= m[("ember_prefix_cache_hit_rate", ())] <= 1
    assert m[("ember_preemptions_total", ())] == stats.preemptions
    assert m[("ember_daemon_requests_total", ())] <= stats.requests_total
    assert m[("ember_daemon_cancelled_total", ())] <= stats.cancelled_total
    # no draft here: speculative decoding's figures are there, at zero
    assert m[("ember_spec_plain_tokens_total", ())] == stats.spec_plain_tokens == 0
    assert m[("ember_spec_acceptance_rate", ())] == m[("ember_spec_saved_seconds_per_token", ())] == 0
    assert m[("ember_spec_proposals_per_verification", ())] == stats.spec_mean_proposals == 0


def test_without_a_daemon(tmp_path: Any) -> None:
    gateway = GatewayThread(socket=tmp_path / "nothing.sock")
    try:
        m = scrape(gateway.url)
        assert m[("ember_daemon_up", ())] == 0 and ("ember_kv_blocks_free", ()) not in m
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{gateway.url}/health")
        assert e.value.code == 503 and b"no ember daemon" in e.value.read()
    finally:
        gateway.stop()
