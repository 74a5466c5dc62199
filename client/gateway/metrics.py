"""GET /metrics: the gateway's own counters and latency histograms, and the daemon's StatsReport, in
Prometheus' text format (prometheus_client).

Two sources, one page:
- what the gateway sees (`ember_gateway_*`): HTTP requests by endpoint and status, prompt and generated
  tokens, time to first token, inter-token latency and request duration as the HTTP client sees them
  (from the request's arrival), requests in flight;
- what the daemon counts (`ember_*`), read with a Stats request on each scrape (no polling in between):
  running and waiting requests, KV blocks used and free, the prefix cache's hit rate, preemptions, and
  the daemon's own totals. `ember_daemon_up` is 0 (and the rest absent) when the daemon does not answer.

A registry per gateway (not prometheus_client's global one), so that several gateways in one process
(the tests) do not collide. Speculative decoding has its acceptance and what it saves a token
(`ember_spec_*`); MoE figures (cold share, swaps) are in `ember status`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ember.protocol.messages import StatsReport

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    def __init__(self, in_flight: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ember_gateway_requests", "HTTP requests answered, by endpoint and status "
                                "(499: the client went away first)", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ember_gateway_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("ember_gateway_generation_tokens", "Tokens generated and sent", registry=r)
        self.ttft = Histogram("ember_gateway_time_to_first_token_seconds", "From a request's arrival to its first "
                              "token", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("ember_gateway_inter_token_latency_seconds", "Between two tokens of a stream",
                             buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("ember_gateway_request_duration_seconds", "From a generation request's arrival "
                                  "to its end", buckets=DURATION_BUCKETS, registry=r)
        Gauge("ember_gateway_requests_in_flight", "Generation requests the gateway carries now",
              registry=r).set_function(lambda: float(in_flight()))
        self._daemon = DaemonCollector()
        r.register(self._daemon)

    def render(self, report: StatsReport | None) -> bytes:
        """The page, with `report` (None: the daemon did not answer) as the daemon's figures."""
        self._daemon.report = report
        return generate_latest(self.registry)


class DaemonCollector(Collector):
    """The daemon's StatsReport as metrics: gauges for what is now, counters for totals."""

    def __init__(self) -> None:
        self.report: StatsReport | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.report
        yield GaugeMetricFamily("ember_daemon_up", "1 when the daemon answered this scrape's Stats request",
                                value=0.0 if s is None else 1.0)
        if s is None:
            return
        figures = (
            (GaugeMetricFamily, "ember_requests_running", "Requests in the running batch", s.active),
            (GaugeMetricFamily, "ember_requests_waiting", "Requests admitted and not running yet", s.queued),
            (GaugeMetricFamily, "ember_kv_blocks_used", "KV cache blocks held by sequences", s.kv_blocks_used),
            (GaugeMetricFamily, "ember_kv_blocks_free", "KV cache blocks free (cached prefixes included)",
             s.kv_blocks_free),
            (GaugeMetricFamily, "ember_prefix_cache_hit_rate", "Share of full prompt blocks found in the prefix cache",
             s.prefix_hit_rate),
            (GaugeMetricFamily, "ember_daemon_clients", "Connections with requests or a logits ring", s.clients),
            (GaugeMetricFamily, "ember_daemon_generation_tokens_per_second",
             "Tokens generated per second over the last 10 s", s.tokens_per_s),
            (GaugeMetricFamily, "ember_daemon_uptime_seconds", "Seconds since the daemon started", s.uptime_s),
            (CounterMetricFamily, "ember_preemptions", "Sequences evicted for KV memory and recomputed later",
             s.preemptions),
            (CounterMetricFamily, "ember_daemon_requests", "Generates admitted by the daemon (all its clients)",
             s.requests_total),
            (CounterMetricFamily, "ember_daemon_generation_tokens", "Tokens generated by the daemon (all its clients)",
             s.tokens_total),
            (CounterMetricFamily, "ember_daemon_cancelled", "Requests cancelled (a client, a vanished client, shutdown)",
             s.cancelled_total),
            (CounterMetricFamily, "ember_daemon_busy", "Generates refused because the daemon's queue was full",
             s.busy_total),
            (CounterMetricFamily, "ember_daemon_errors", "Error replies of any code", s.errors_total),
            (GaugeMetricFamily, "ember_spec_acceptance_rate", "Share of draft tokens the models kept",
             s.spec_acceptance_rate),
            (GaugeMetricFamily, "ember_spec_tokens_per_verification", "Tokens a verification pass yields "
             "(0: none ran)", s.spec_mean_accepted_length),
            (GaugeMetricFamily, "ember_spec_proposals_per_verification", "The k speculation chose: draft tokens "
             "a verification pass checked (0: none ran)", s.spec_mean_proposals),
            (CounterMetricFamily, "ember_spec_plain_tokens", "Tokens decoded without speculating although a draft "
             "was loaded (it measured slower)", s.spec_plain_tokens),
            (GaugeMetricFamily, "ember_spec_saved_seconds_per_token", "What speculating saves a token, as last "
             "measured (negative: what it costs)", s.spec_saved_s_per_token),
        )
        for family, name, doc, value in figures:
            yield family(name, doc, value=float(value))
