"""/metrics through `prometheus_client`, with vLLM's (V1) metric names under a `hybridpar:` prefix and a
`model_name` label, so that dashboards written for vLLM read a hybridpar server after a rename.

Latencies are histograms (they add up across replicas and servers, which percentiles in a gauge do not):
time to first token, inter-token latency (vLLM's time_per_output_token), end-to-end latency and queue
time (router wait + the replica's wait for a seat), each measured by the service as a request's events
arrive. Token and prefix-cache counters are counted from the replicas' reports; the gauges (running,
waiting, KV-cache use) and the router's own state are read when /metrics is scraped.

Every server has a registry of its own (no process-wide default registry): two servers in one process
(tests, benchmarks) never mix their counts.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

P = "hybridpar:"
# vLLM's buckets (vllm/v1/metrics/loggers.py), so that the histograms compare bucket for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
TTFT_BUCKETS += (40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS += (80.0,)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
REQUEST_BUCKETS += (480.0, 960.0, 1920.0, 7680.0)
# Service counters exported as they are (beyond vLLM's set): name -> help.
REQUEST_COUNTERS = {
    "requests_total": "requests accepted",
    "requests_completed": "requests finished",
    "requests_failed": "requests failed",
    "requests_retried": "requests started over on another replica after theirs died",
    "requests_resumed": "half-streamed requests continued on another replica after theirs died",
    "requests_cancelled": "requests given up by their client (timed out, or it left) before the end",
    "requests_rejected": "requests refused (429/503)",
}
REPLICA_GAUGES = {
    "queue_depth": "requests waiting in the replica for a seat",
    "outstanding_requests": "requests placed on the replica",
    "kv_used_tokens": "KV-cache tokens allocated",
    "utilisation": "measured busy fraction",
    "decode_s_per_token": "measured decode seconds per token (EWMA)",
    "prefill_s_per_token": "measured prefill seconds per prompt token (EWMA)",
}


class _State(Collector):
    """What is read at scrape time from the service's statistics(): vLLM's gauges, the request
    counters, and per-replica router state."""

    def __init__(self, model: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.model, self.snapshot = model, snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        m, reps = [self.model], s["replicas"]
        live = [r for r in reps if r["alive"]]
        cap = sum(r["kv_capacity_tokens"] or 0 for r in live)
        kv = sum(r["kv_used_tokens"] for r in live) / cap if cap else 0.0
        for name, help_, v in (
            ("num_requests_running", "requests in the replicas' running batches", s["running"]),
            ("num_requests_waiting", "requests waiting (router queue and replica queues)", s["waiting"]),
            ("kv_cache_usage_perc", "KV-cache use, 1 = full", kv),
            ("replicas_alive", "replicas running", s["replicas_alive"]),
        ):
            g = GaugeMetricFamily(P + name, help_, labels=["model_name"])
            g.add_metric(m, v)
            yield g
        for key, help_ in REQUEST_COUNTERS.items():
            c = CounterMetricFamily(P + key.removesuffix("_total"), help_, labels=["model_name"])
            c.add_metric(m, s["counters"].get(key, 0))
            yield c
        for key, help_ in REPLICA_GAUGES.items():
            g = GaugeMetricFamily(P + "replica_" + key, help_, labels=["model_name", "replica"])
            for i, r in enumerate(reps):
                if r[key] is not None:
                    g.add_metric([self.model, str(i)], r[key])
            yield g
        c = CounterMetricFamily(P + "strategy_decisions", "placements by strategy", labels=["model_name", "strategy"])
        for k, v in sorted(s["strategy_usage"].items()):
            c.add_metric([self.model, k], v)
        yield c


class ServeMetrics:
    """One server's metrics. The observe methods are called from the service's event threads
    (prometheus_client's metrics take their own locks)."""

    def __init__(self, model_name: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = r = CollectorRegistry()  # no auto_describe: the state is read at scrape time only
        lab = ["model_name"]

        def hist(name: str, help_: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(P + name, help_, lab, registry=r, buckets=buckets).labels(model_name)

        def count(name: str, help_: str) -> Any:
            return Counter(P + name, help_, lab, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "time from arrival to the first token", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "time between two tokens of a request", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "time from arrival to the last token", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "time waiting for a replica and a seat", REQUEST_BUCKETS)
        self.prompt_tokens = count("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = count("generation_tokens", "tokens generated")
        self.prefix_queries = count("prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = count("prefix_cache_hits", "prompt tokens found in the prefix cache (not computed)")
        r.register(_State(model_name, snapshot))

    def finished(self, e2e_s: float, queue_s: float, prompt_tokens: int, generated: int) -> None:
        self.e2e.observe(e2e_s)
        self.queue.observe(queue_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)

    def prefix(self, queried: int, hit: int) -> None:
        if queried > 0:
            self.prefix_queries.inc(queried)
        if hit > 0:
            self.prefix_hits.inc(hit)

    def text(self) -> bytes:
        return generate_latest(self.registry)
