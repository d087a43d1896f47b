"""/metrics: prometheus_client's exposition with vLLM's metric names, read back by prometheus_client's own
parser; every histogram counts each request once (or each token), the counters add the replicas' reports."""

from __future__ import annotations

from typing import Any

import pytest

from hybridpar.config import ModelConfig
from hybridpar.serve.config import ServeConfig

parser = pytest.importorskip("prometheus_client.parser")
MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, ffn_dim=64)


class _Pool:
    def __init__(self, spec: Any, on_event: Any) -> None:
        self.alive = [True] * spec.dp

    def send(self, d: int, msg: dict[str, Any]) -> bool:
        return True


def scrape(svc: Any) -> dict[str, dict[tuple, float]]:
    """{sample name: {label values (without model_name): value}} of the service's /metrics text."""
    out: dict[str, dict[tuple, float]] = {}
    for fam in parser.text_string_to_metric_families(svc.metrics.text().decode()):
        for s in fam.samples:
            assert s.labels.pop("model_name") == "tiny"
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def status(used: int, queried: int, hit: int) -> dict[str, Any]:
    return {
        "type": "status",
        "kv_used_tokens": used,
        "kv_capacity_tokens": 512,
        "queue_depth": 1,
        "queued_tokens": 9,
        "busy_s": 0.0,
        "slots": 8,
        "running": 2,
        "prefix_query_tokens": queried,
        "prefix_hit_tokens": hit,
    }


def test_histograms_count_every_request_and_counters_add_the_reports() -> None:
    from hybridpar.serve.service import Service

    cfg = ServeConfig(source="init:7", dp=2, strategy="round_robin", served_model_name="tiny")
    svc = Service(cfg, MODEL, cfg.source, pool=_Pool)
    reqs = [svc.submit([1, 2, 3], 4, 0.0, 1.0, None) for _ in range(3)]
    svc._on_event(0, status(128, 10, 0))
    svc._on_event(0, status(256, 30, 16))  # cumulative: the counters take the difference
    svc._on_event(1, status(64, 5, 0))
    for i, p in enumerate(reqs):
        rep = svc.router.where[p.id]
        for t in range(i + 1):  # request i streams i + 1 tokens
            svc._on_event(rep, {"type": "token", "id": p.id, "token": t})
        done = {"type": "done", "id": p.id, "reason": "length", "prompt_tokens": 3, "completion_tokens": i + 1}
        svc._on_event(rep, {**done, "queue_s": 0.25})
    m = scrape(svc)
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert m[f"hybridpar:{name}_seconds_count"][()] == 3, name
    assert m["hybridpar:inter_token_latency_seconds_count"][()] == 0 + 1 + 2
    assert m["hybridpar:request_queue_time_seconds_sum"][()] >= 0.75  # the replicas' waits are in it
    assert m["hybridpar:prompt_tokens_total"][()] == 9 and m["hybridpar:generation_tokens_total"][()] == 6
    assert m["hybridpar:prefix_cache_queries_total"][()] == 35 and m["hybridpar:prefix_cache_hits_total"][()] == 16
    assert m["hybridpar:num_requests_running"][()] == 4 and m["hybridpar:num_requests_waiting"][()] == 2
    assert m["hybridpar:kv_cache_usage_perc"][()] == pytest.approx((256 + 64) / 1024)
    assert m["hybridpar:requests_completed_total"][()] == 3
    assert m["hybridpar:replica_outstanding_requests"] == {(("replica", "0"),): 0, (("replica", "1"),): 0}
    # Two servers in one process keep their own counts (a registry each).
    other = Service(cfg, MODEL, cfg.source, pool=_Pool)
    assert scrape(other)["hybridpar:e2e_request_latency_seconds_count"][()] == 0
