"""Request router (pure): each strategy's choice from measured state, hybrid's thresholds, no request
lost when replicas are busy, statistics."""

from __future__ import annotations

import pytest

from hybridpar.serve.router import Overloaded, Request, Router, RouterConfig, Unavailable, percentile


def req(i: int, prompt: int = 10, out: int = 10) -> Request:
    return Request(f"q{i}", prompt, out)


def placed(router: Router, r: Request, now: float = 0.0) -> int:
    ((got, rep),) = router.submit(r, now)
    assert got is r
    return rep


def test_round_robin_cycles_and_skips_busy_replicas() -> None:
    rt = Router(3, RouterConfig("round_robin", max_outstanding=2))
    assert [placed(rt, req(i)) for i in range(5)] == [0, 1, 2, 0, 1]
    # replicas 0 and 1 are at their limit: the next two go to 2, then everything waits
    assert placed(rt, req(5)) == 2
    assert rt.submit(req(6), 0.0) == []
    assert rt.statistics()["pending"] == 1


def test_load_balanced_picks_fewest_outstanding_tokens() -> None:
    rt = Router(2, RouterConfig("load_balanced"))
    assert placed(rt, req(0, 100, 100)) == 0
    assert [placed(rt, req(i, 10, 10)) for i in range(1, 4)] == [1, 1, 1]  # 60 tokens < 200 on replica 0
    rt.finished("q0", 1.0)
    assert placed(rt, req(9)) == 0


def test_performance_optimized_uses_measured_latency_and_request_mix() -> None:
    rt = Router(2, RouterConfig("performance_optimized"))
    # Before any measurement both replicas are equal: it balances load.
    assert [placed(rt, req(i)) for i in range(2)] == [0, 1]
    # Replica 0 measured fast at prefill, slow at decode; replica 1 the other way round.
    rt.finished("q0", 1.0, prefill_s_per_token=0.001, decode_s_per_token=0.05)
    rt.finished("q1", 1.0, prefill_s_per_token=0.004, decode_s_per_token=0.01)
    assert placed(rt, req(2, prompt=500, out=5)) == 0  # prefill-heavy
    assert placed(rt, req(3, prompt=5, out=100)) == 1  # decode-heavy
    stats = rt.statistics()["replicas"]
    assert stats[0]["routed"] == {"prefill_heavy": 2} and stats[1]["routed"] == {"prefill_heavy": 1, "decode_heavy": 1}


def test_performance_optimized_sends_less_to_a_slower_replica() -> None:
    rt = Router(2, RouterConfig("performance_optimized"))
    for i in range(2):
        placed(rt, req(i))
    rt.finished("q0", 1.0, 0.01, 0.01)
    rt.finished("q1", 1.0, 0.02, 0.02)  # replica 1 measured twice as slow
    reps = [placed(rt, req(i)) for i in range(2, 32)]
    assert reps.count(0) == 20 and reps.count(1) == 10  # 2 : 1, as the measured speeds


def test_memory_aware_picks_most_kv_headroom() -> None:
    rt = Router(2, RouterConfig("memory_aware"))
    rt.report(0, kv_used=900, kv_capacity=1000, queue_depth=0, queued_tokens=0, busy_s=0.0, now=0.0)
    rt.report(1, kv_used=200, kv_capacity=1000, queue_depth=0, queued_tokens=0, busy_s=0.0, now=0.0)
    assert placed(rt, req(0, 400, 400)) == 1  # 0.2 < 0.9
    assert placed(rt, req(1, 100, 100)) == 0  # replica 1 now holds 200 used + 800 placed: 1.0 > 0.9
    rt.report(1, kv_used=300, kv_capacity=1000, queue_depth=0, queued_tokens=0, busy_s=0.0, now=1.0)
    assert placed(rt, req(2, 100, 100)) == 1  # its report says the placed request took only 100 slots


@pytest.mark.parametrize(
    "setup,expected",
    [
        ("memory", "memory_aware"),
        ("busy", "performance_optimized"),
        ("imbalance", "load_balanced"),
        ("calm", "blend"),
    ],
)
def test_hybrid_follows_measured_state(setup: str, expected: str) -> None:
    rt = Router(2, RouterConfig("hybrid"))
    for i in range(2):
        rt.report(i, 0, 1000, 0, 0, busy_s=0.0, now=0.0)
    if setup == "memory":
        rt.report(0, 850, 1000, 0, 0, busy_s=0.0, now=1.0)
    elif setup == "busy":
        rt.report(1, 0, 1000, 0, 0, busy_s=0.9, now=1.0)  # busy 90% of the last second
    elif setup == "imbalance":
        placed(rt, req(0, 100, 100))  # 200 vs 0 outstanding tokens: imbalance 1.0
    rt.usage.clear()
    placed(rt, req(9))
    assert rt.usage == {f"hybrid:{expected}": 1, expected: 1}


def test_hybrid_thresholds_are_configurable() -> None:
    rt = Router(2, RouterConfig("hybrid", memory_pressure=0.95))
    rt.report(0, 850, 1000, 0, 0, busy_s=0.0, now=0.0)
    rt.report(1, 850, 1000, 0, 0, busy_s=0.0, now=0.0)
    placed(rt, req(0))
    assert "hybrid:memory_aware" not in rt.usage


def test_no_request_is_lost_when_replicas_are_busy() -> None:
    rt = Router(2, RouterConfig("load_balanced", max_outstanding=1, max_pending=3))
    out = [p for i in range(5) for p in rt.submit(req(i), float(i))]
    assert [r.id for r, _ in out] == ["q0", "q1"]
    with pytest.raises(Overloaded, match="max_outstanding=1"):
        rt.submit(req(5), 5.0)  # 3 waiting already: refused loudly, not dropped
    done: list[str] = []
    t = 10.0
    while out:
        r, rep = out.pop(0)
        done.append(r.id)
        out += rt.finished(r.id, t)  # each completion places the oldest waiting request
        t += 1
    assert done == ["q0", "q1", "q2", "q3", "q4"]
    st = rt.statistics()
    assert st["completed"] == 5 and st["pending"] == 0
    # q_i was submitted at t=i and finished at t=10+i: the time spent waiting in the router counts
    assert sorted(rt.latencies) == [10.0] * 5


@pytest.mark.parametrize("strategy", ["round_robin", "load_balanced", "hybrid"])
def test_dead_replica_gets_nothing_and_its_unsent_requests_move(strategy: str) -> None:
    rt = Router(3, RouterConfig(strategy, max_outstanding=2, max_pending=8))
    out = [p for i in range(8) for p in rt.submit(req(i), float(i))]
    assert len(out) == 6 and rt.statistics()["pending"] == 2
    on1 = [r.id for r, rep in out if rep == 1]
    assert rt.down(1) == on1 and rt.down(1) == on1  # idempotent
    # Say the first was sent (it fails, freeing its place) and the second was not (it moves).
    more = rt.finished(on1[0], 10.0)
    assert more == []  # a dead replica's freed place takes nothing from the queue
    assert rt.requeue(on1[1]) == [] and rt.requeue(on1[1]) == []  # live replicas full: it waits, first
    assert [r.id for r, _ in rt.pending] == [on1[1], "q6", "q7"]
    freed = next(r.id for r, rep in out if rep == 0)
    ((moved, rep),) = rt.finished(freed, 11.0)
    assert (moved.id, rep) == (on1[1], 0)  # placed again, on a live replica, before newer requests
    assert rt.submitted_at[on1[1]] == float(int(on1[1][1:]))  # its latency still counts from submission
    # Finish everything: each waiting request lands on a live replica, none is lost.
    todo = [(r.id, p) for r, p in out if p != 1 and r.id != freed] + [(moved.id, rep)]
    while todo:
        rid, p = todo.pop(0)
        assert p != 1
        todo += [(r.id, p) for r, p in rt.finished(rid, 12.0)]
    assert rt.completed == 8 and not rt.pending and not rt.where
    st = rt.statistics()
    assert [r["alive"] for r in st["replicas"]] == [True, False, True] and st["replicas"][1][
        "outstanding_requests"
    ] == 0
    assert rt.abandon() == []  # replicas live: the queue is kept


def test_no_live_replica_refuses_and_abandons_the_queue() -> None:
    rt = Router(2, RouterConfig("round_robin", max_outstanding=1))
    out = [p for i in range(4) for p in rt.submit(req(i), 0.0)]
    assert [rep for _, rep in out] == [0, 1]
    assert rt.down(0) == ["q0"] and rt.down(1) == ["q1"]
    assert rt.requeue("q0") == [] and rt.requeue("q1") == []  # nowhere to go: back in the queue
    assert [r.id for r in rt.abandon()] == ["q1", "q0", "q2", "q3"] and rt.statistics()["pending"] == 0
    with pytest.raises(Unavailable, match="no replica is running"):
        rt.submit(req(9), 1.0)


def test_statistics_and_percentiles() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile(list(range(1, 101)), 99) == 99
    rt = Router(2, RouterConfig("round_robin"))
    for i in range(4):
        placed(rt, req(i), now=0.0)
    for i in range(4):
        rt.finished(f"q{i}", float(i + 1))
    rt.report(1, 10, 100, queue_depth=3, queued_tokens=40, busy_s=0.0, now=5.0)
    st = rt.statistics()
    assert st["strategy_usage"] == {"round_robin": 4}
    assert st["latency_s"] == {"p50": 2.0, "p90": 4.0, "p99": 4.0, "n": 4}
    assert [r["queue_depth"] for r in st["replicas"]] == [0, 3]


def test_bad_router_config_is_refused() -> None:
    with pytest.raises(ValueError, match="strategy='fastest'"):
        Router(2, RouterConfig("fastest"))
    with pytest.raises(ValueError, match="imbalance=1.5"):
        Router(2, RouterConfig(imbalance=1.5))
    with pytest.raises(ValueError, match="n_replicas=0"):
        Router(0)
    rt = Router(1)
    placed(rt, req(0))
    with pytest.raises(ValueError, match="already in flight"):
        rt.submit(req(0), 0.0)


def test_cache_aware_follows_the_longest_cached_prefix_within_its_slack() -> None:
    from hybridpar.serve.prefix import block_hashes

    rt = Router(3, RouterConfig("cache_aware", cache_slack=3, max_outstanding=16))
    system = list(range(40))  # a shared prefix of 2 full blocks of 16 (+ 8 tokens)
    assert block_hashes(system + [1], 16) == block_hashes(system + [2], 16)  # equal whole blocks, equal hashes
    assert len(block_hashes(system, 16)) == 2 and block_hashes([1] * 15, 16) == ()

    def ask(i: int, prompt: list[int]) -> int:
        return placed(rt, Request(f"c{i}", len(prompt), 4, block_hashes(prompt, 16)))

    first = ask(0, system + [100])  # nothing cached anywhere: hybrid places it
    assert rt.usage["cache_aware:hybrid"] == 1
    assert ask(1, system + [101]) == first and rt.usage["cache_aware:prefix"] == 1  # its prefix is there
    other = ask(2, list(range(500, 540)))  # another prefix: hybrid balances it to a less loaded replica
    assert other != first
    # The longer match wins over the shorter: a prompt sharing 2 blocks with `first`, 1 with `other`.
    rt.prefix.placed(other, block_hashes(system[:16], 16))
    assert ask(3, system + [102]) == first
    # Slack: `first` holds 3 outstanding, a replica holds 0: 3 beyond the least loaded, too busy.
    assert ask(4, system + [103]) != first and rt.usage["cache_aware:hybrid"] == 3
    rt.down(first)  # a dead replica's cache is forgotten with it
    assert rt.prefix.matched(first, block_hashes(system, 16)) == 0


def test_prefix_index_forgets_least_recently_used_blocks_at_the_replicas_capacity() -> None:
    from hybridpar.serve.prefix import PrefixIndex

    ix = PrefixIndex(1)
    ix.resize(0, 3)
    ix.placed(0, (1, 2))
    ix.placed(0, (1, 3))  # 1 used again: 2 is now the least recent
    ix.placed(0, (4,))
    assert ix.matched(0, (1, 3)) == 2 and ix.matched(0, (1, 2)) == 1 and ix.matched(0, (4,)) == 1
    assert ix.best((9,), [0], {0: 0}, 4) is None  # nothing cached: the caller balances
