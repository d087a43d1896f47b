"""`hybridpar bench serve`: its pure parts, its refusals, and one small run end to end."""

from __future__ import annotations

import json

import pytest

from hybridpar.bench.serve import main, make_trace, pool_runs


def test_trace_is_seeded_poisson_with_short_and_long_requests():
    a, b = make_trace(400, 50.0, 3), make_trace(400, 50.0, 3)
    assert a == b and a != make_trace(400, 50.0, 4)
    gaps = [y["t"] - x["t"] for x, y in zip(a, a[1:])]
    assert all(g >= 0 for g in gaps)
    assert 0.8 / 50 < sum(gaps) / len(gaps) < 1.2 / 50  # mean inter-arrival 1/rate
    lengths = [len(r["prompt"]) for r in a]
    assert min(lengths) >= 8 and max(lengths) <= 160 and any(n < 25 for n in lengths) and any(n >= 64 for n in lengths)
    assert all(t["t"] == 0.0 for t in make_trace(5, 0.0, 0))  # rate 0: a burst


def test_pooled_runs_take_percentiles_over_every_request():
    runs = [
        {
            "strategy": "hybrid",
            "latencies": [1.0, 2.0],
            "tokens": 10,
            "wall_s": 2.0,
            "completed": 2,
            "failed": 1,
            "p99_s": 2.0,
            "routed_per_replica": [1, 2],
            "strategy_usage": {"a": 1},
        },
        {
            "strategy": "hybrid",
            "latencies": [3.0, 4.0],
            "tokens": 30,
            "wall_s": 2.0,
            "completed": 2,
            "failed": 0,
            "p99_s": 4.0,
            "routed_per_replica": [2, 0],
            "strategy_usage": {"a": 2, "b": 1},
        },
    ]
    p = pool_runs(runs)
    assert p["mean_s"] == 2.5 and p["tokens_per_s"] == 10.0 and p["completed"] == 4 and p["failed"] == 1
    assert p["routed_per_replica"] == [3, 2] and p["strategy_usage"] == {"a": 3, "b": 1}
    assert p["p99_s_per_repeat"] == [2.0, 4.0] and p["repeats"] == 2


@pytest.mark.parametrize(
    "args",
    [
        ["--replicas", "1"],
        ["--slow", "0.5"],
        ["--load", "0"],
        ["--requests", "0"],
        ["--strategies", "nope"],
        ["--throughput", "--pp", "0"],
        ["--throughput", "--rate-rps", "-1"],
        ["--throughput", "--rate-rps", "nan"],
        ["--scenario", "soak", "--clients", "0"],
        ["--scenario", "soak", "--client-timeout-s", "0"],
    ],
)
def test_bad_input_is_refused_before_any_process(args, capsys):
    assert main(args) == 2
    assert "hybridpar bench serve: error:" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_small_run_end_to_end(tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert main(["--requests", "6", "--strategies", "round_robin,hybrid", "--repeats", "1", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["capacity_rps"] > 0 and rec["mode"] == "emulated: replica 1 2.0x slower"
    assert [r["strategy"] for r in rec["results"]] == ["round_robin", "hybrid"]
    for r in rec["results"]:
        assert r["completed"] + r["failed"] == 6 and r["completed"] > 0
        assert r["p50_s"] <= r["p99_s"] and r["tokens_per_s"] > 0
        assert sum(r["routed_per_replica"]) >= r["completed"]
    assert rec["hybrid_p99_over_round_robin_p99"] > 0


def test_shared_prefix_trace_draws_requests_from_a_few_long_prefixes():
    from hybridpar.bench.serve_scenarios import prefix_trace

    a = prefix_trace(64, 10.0, 1, prefixes=4, prefix_len=32)
    assert a == prefix_trace(64, 10.0, 1, prefixes=4, prefix_len=32) and a != prefix_trace(64, 10.0, 2)
    heads = {tuple(r["prompt"][:32]) for r in a}
    assert len(heads) == 4 and all(40 <= len(r["prompt"]) <= 56 and 4 <= r["max_tokens"] <= 8 for r in a)
    with pytest.raises(SystemExit):  # argparse refuses an unknown scenario
        main(["--scenario", "nope"])
