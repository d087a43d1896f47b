"""Tests for hybridpar.pipeline.simulate: textbook bubbles come out exactly, the link model adds
hand-computed amounts, zb-h1 beats 1F1B, and schedules that cannot run are refused."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from hybridpar.pipeline.schedules import (
    Action,
    Op,
    ScheduleError,
    add_communication,
    bubble_fraction_theory,
    build_schedule,
    compute_schedule,
)
from hybridpar.pipeline.simulate import Costs, SimResult, sim_trace, simulate

F, B, W = Op.FORWARD, Op.BACKWARD, Op.WEIGHT
PP_M = [(pp, m) for pp in (1, 2, 3, 4, 8) for m in (1, 2, 5, 8, 16)]
PP_M_1F1B = [(pp, m) for pp, m in PP_M if m >= pp]  # 1F1B's warm-up needs a microbatch per rank
TEXTBOOK = [("gpipe", pp, m) for pp, m in PP_M] + [("1f1b", pp, m) for pp, m in PP_M_1F1B]


def run(name: str, pp: int, m: int, costs: Costs, v: int = 1, lookahead: int = 1) -> SimResult:
    return simulate(build_schedule(name, pp, v, m, lookahead), pp, pp * v, costs)


def ev(res: SimResult, name: str) -> tuple[float, float]:
    e = next(e for e in res.events if str(e.action) == name)
    return e.start, e.end


@pytest.mark.parametrize("name, pp, m", TEXTBOOK)
def test_textbook_bubble_exact(name: str, pp: int, m: int) -> None:
    res = run(name, pp, m, Costs(forward_s=1.0, backward_s=1.0))
    assert abs(res.bubble_fraction - (pp - 1) / (m + pp - 1)) < 1e-9
    assert res.busy_s == [2.0 * m] * pp


@pytest.mark.parametrize("pp, m", PP_M_1F1B)
@pytest.mark.parametrize("f, b", [(1.0, 1.0), (1.0, 2.0), (0.3, 0.7)])
def test_1f1b_step_time(pp: int, m: int, f: float, b: float) -> None:
    res = run("1f1b", pp, m, Costs(f, b))
    assert res.step_time_s == pytest.approx((m + pp - 1) * (f + b), abs=1e-9)


@pytest.mark.parametrize("pp, v", [(2, 2), (2, 3), (4, 2), (4, 3), (3, 2)])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_interleaved_bubble(pp: int, v: int, k: int) -> None:
    # Each of the v chunks does 1/v of a stage's work: the bubble shrinks v-fold, i.e.
    # (p-1)/v microbatch-times over a total of m + (p-1)/v (Narayanan et al., 2021).
    m = k * pp
    res = run("interleaved-1f1b", pp, m, Costs(1.0 / v, 1.0 / v), v=v)
    assert abs(res.bubble_fraction - (pp - 1) / (v * m + pp - 1)) < 1e-9
    assert res.step_time_s == pytest.approx(2 * (m + (pp - 1) / v), abs=1e-9)
    assert res.bubble_fraction == pytest.approx(bubble_fraction_theory("interleaved-1f1b", pp, v, m))


def test_latency_pp2_m1_hand_computed() -> None:
    # One microbatch (GPipe; 1F1B would need two): rank 0: RECV_B0.0 F0.0 SEND_F0.0 B0.0,
    # rank 1: RECV_F1.0 F1.0 B1.0 SEND_B1.0.
    c = Costs(1.0, 2.0, latency_s=0.5, send_overhead_s=0.1, recv_overhead_s=0.05, compute_overhead_s=0.01)
    res = run("gpipe", 2, 1, c)
    # rank 0: RECV_B [0, .05], F0.0 [.05, 1.06], SEND_F [1.06, 1.16] -> arrives 1.66.
    # rank 1: RECV_F [0, .05], F1.0 [1.66, 2.67], B1.0 [2.67, 4.68], SEND_B [4.68, 4.78]
    # -> arrives 5.28; rank 0: B0.0 [5.28, 7.29].
    assert ev(res, "F0.0") == pytest.approx((0.05, 1.06))
    assert ev(res, "F1.0") == pytest.approx((1.66, 2.67))
    assert ev(res, "SEND_B1.0") == pytest.approx((4.68, 4.78))
    assert ev(res, "B0.0") == pytest.approx((5.28, 7.29))
    assert res.step_time_s == pytest.approx(7.29)
    waits = {str(e.action): e.wait_s for e in res.events if e.wait_s > 0}
    assert waits == pytest.approx({"F1.0": 1.61, "B0.0": 5.28 - 1.16})
    assert res.busy_s == [3.0, 3.0]  # overheads are not busy time
    assert res.bubble_fraction == pytest.approx(1 - 6 / (2 * 7.29))
    # Latency alone: each of the 2 hops on the critical path adds it once.
    base = run("gpipe", 2, 1, Costs(1.0, 2.0)).step_time_s
    assert run("gpipe", 2, 1, Costs(1.0, 2.0, latency_s=0.5)).step_time_s == pytest.approx(base + 1)


def test_link_serialises_transfers_hand_computed() -> None:
    # gpipe pp=2 m=2, F = B = 1, 1000-byte messages at 500 B/s (2 s each), latency 0.5.
    # rank 0 posts SEND_F0.0 at 1 and SEND_F0.1 at 2; receives are posted at 0. Transfer 0
    # holds link 0->1 over [1, 3] -> arrives 3.5. Transfer 1 waits for the link: [3, 5] -> 5.5
    # (4.5 if transfers could overlap). Latency is pipelined: it starts at 3, not at 3.5.
    # rank 1: F1.0 [3.5, 4.5], F1.1 [5.5, 6.5], B1.0 [6.5, 7.5], B1.1 [7.5, 8.5].
    # Link 1->0: SEND_B1.0 at 7.5 -> [7.5, 9.5] -> 10; SEND_B1.1 at 8.5 -> [9.5, 11.5] -> 12.
    # rank 0: B0.0 [10, 11], B0.1 [12, 13].
    c = Costs(1.0, 1.0, latency_s=0.5, bandwidth_Bps=500.0, message_bytes=1000)
    res = run("gpipe", 2, 2, c)
    arr = {str(a): t for a, t in res.arrivals.items()}
    assert arr == pytest.approx({"SEND_F0.0": 3.5, "SEND_F0.1": 5.5, "SEND_B1.0": 10.0, "SEND_B1.1": 12.0})
    assert ev(res, "F1.1") == pytest.approx((5.5, 6.5))
    assert ev(res, "B0.1") == pytest.approx((12.0, 13.0))
    assert res.step_time_s == pytest.approx(13.0)


def test_transfer_waits_for_receive_post() -> None:
    # NCCL p2p is a rendezvous: a late receive delays the transfer. With lookahead 0, rank 1
    # of 1F1B pp=2 m=2 posts RECV_F1.1 only after SEND_B1.0. F1.0 starts when the first
    # activation lands (1 + 0.25), B1.0 [2.25, 3.25], RECV_F1.1 [3.25, 3.75]: the activation
    # rank 0 sent at 2 leaves only at 3.75 and lands at 4.0, where F1.1 starts.
    c = Costs(1.0, 1.0, latency_s=0.25, recv_overhead_s=0.5)
    res = run("1f1b", 2, 2, c, lookahead=0)
    acts = [str(a) for a in build_schedule("1f1b", 2, 1, 2, recv_lookahead=0)[1]]
    assert acts.index("RECV_F1.1") == acts.index("SEND_B1.0") + 1
    assert ev(res, "SEND_F0.1")[1] == pytest.approx(2.0)
    assert ev(res, "RECV_F1.1") == pytest.approx((3.25, 3.75))
    assert res.arrivals[Action(0, Op.SEND_F, 1)] == pytest.approx(4.0)
    assert ev(res, "F1.1")[0] == pytest.approx(4.0)


@pytest.mark.parametrize("seed", range(6))
def test_timeline_invariants(seed: int) -> None:
    rng = random.Random(seed)
    name = rng.choice(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
    pp = rng.choice([2, 3, 4])
    v = 2 if name == "interleaved-1f1b" else 1
    m = pp * rng.randint(1, 3)
    c = Costs(
        [rng.uniform(0.5, 2) for _ in range(pp * v)],
        [rng.uniform(0.5, 2) for _ in range(pp * v)],
        rng.uniform(0, 1),
        latency_s=rng.uniform(0, 0.3),
        bandwidth_Bps=1e9,
        message_bytes=rng.randint(0, 10**8),
        send_overhead_s=0.01,
        recv_overhead_s=0.02,
        compute_overhead_s=0.03,
    )
    sched = build_schedule(name, pp, v, m, rng.randint(0, 3))
    res = simulate(sched, pp, pp * v, c)
    assert Counter(e.action for e in res.events) == Counter(a for acts in sched for a in acts)
    for r in range(pp):
        mine = [e for e in res.events if e.rank == r]
        assert [e.action for e in mine] == sched[r]  # list order, one thread per rank
        t = 0.0
        for e in mine:  # the timeline tiles: wait, then the action, back to back
            assert e.wait_s >= 0 and e.start == pytest.approx(t + e.wait_s) and e.end >= e.start
            t = e.end
    done = {e.action: e for e in res.events}
    xfer = c.message_bytes / c.bandwidth_Bps
    for send, t in res.arrivals.items():
        recv = Action(
            send.stage + (1 if send.op is Op.SEND_F else -1),
            Op.RECV_F if send.op is Op.SEND_F else Op.RECV_B,
            send.microbatch,
        )
        assert t >= max(done[send].end, done[recv].end) + c.latency_s + xfer - 1e-9
    assert res.step_time_s == pytest.approx(max(e.end for e in res.events))
    assert 0 <= res.bubble_fraction < 1


# --- zb-h1 ------------------------------------------------------------------------------


def test_zb_h1_beats_1f1b_pp4_m8() -> None:
    # Same work per microbatch: 1F1B's backward (2) is zb-h1's B (1) + W (1).
    one = run("1f1b", 4, 8, Costs(1.0, 2.0))
    zb = run("zb-h1", 4, 8, Costs(1.0, 1.0, 1.0))
    assert one.step_time_s == pytest.approx(33.0) and zb.step_time_s == pytest.approx(27.0)
    assert zb.bubble_fraction <= 0.6 * one.bubble_fraction
    assert zb.bubble_fraction == pytest.approx(3 / 27) and one.bubble_fraction == pytest.approx(9 / 33)
    # Bubble time itself is a third of 1F1B's (Qi et al., 2024): 3 vs 9 units per rank.
    assert (zb.step_time_s - 24) * 3 == pytest.approx(one.step_time_s - 24)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zb_h1_unit_costs_match_theory(pp: int) -> None:
    for m in (pp, 2 * pp, 3 * pp + 1):
        res = run("zb-h1", pp, m, Costs(1.0, 1.0, 1.0))
        assert abs(res.bubble_fraction - (pp - 1) / (3 * m + pp - 1)) < 1e-9
        assert res.bubble_fraction == pytest.approx(bubble_fraction_theory("zb-h1", pp, 1, m))


@pytest.mark.parametrize("seed", range(40))
def test_zb_h1_theory_for_uneven_costs(seed: int) -> None:
    rng = random.Random(seed)
    pp = rng.choice([2, 3, 4, 5, 8])
    m = rng.randint(pp, 4 * pp)
    f, b, w = (rng.choice([0.25, 0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(3))
    res = run("zb-h1", pp, m, Costs(f, b, w))
    theory = bubble_fraction_theory("zb-h1", pp, 1, m, t_f=f, t_b=b, t_w=w)
    assert abs(res.bubble_fraction - theory) < 1e-9, (pp, m, f, b, w)


# --- per-stage costs ------------------------------------------------------------------


def test_slowest_stage_dominates() -> None:
    # Stage 2 costs 3x: 1F1B runs at its pace, m (F2 + B2) = 144, plus the fill through stages
    # 0-1 (F = 1 each) and the drain back through them (B = 2 each): 150.
    c = Costs([1.0, 1.0, 3.0, 1.0], [2.0, 2.0, 6.0, 2.0])
    res = run("1f1b", 4, 16, c)
    assert res.step_time_s == pytest.approx(150.0)
    assert res.busy_s == [48.0, 48.0, 144.0, 48.0]
    idle = [res.step_time_s - b for b in res.busy_s]
    assert idle.index(min(idle)) == 2
    uniform = run("1f1b", 4, 16, Costs(3.0, 6.0))
    assert res.step_time_s < uniform.step_time_s  # the others being faster still helps a bit


def test_cost_vector_length_and_values_checked() -> None:
    with pytest.raises(ValueError, match="forward_s has 3 entries for 4 stages"):
        run("1f1b", 4, 4, Costs([1.0, 1.0, 1.0], 1.0))
    with pytest.raises(ValueError, match="latency_s"):
        Costs(1.0, 1.0, latency_s=-1.0)
    with pytest.raises(ValueError, match="bandwidth_Bps"):
        Costs(1.0, 1.0, bandwidth_Bps=0.0)


def test_compute_overhead_is_bubble() -> None:
    res = run("1f1b", 1, 2, Costs(1.0, 1.0, compute_overhead_s=0.25))
    assert res.step_time_s == pytest.approx(5.0)
    assert res.bubble_fraction == pytest.approx(0.2)


# --- schedules that cannot run ----------------------------------------------------------


def test_deadlock_cycle_raises() -> None:
    compute = [
        [Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
        [Action(1, F, 0), Action(1, F, 1), Action(1, B, 0), Action(1, B, 1)],
    ]
    with pytest.raises(ScheduleError) as info:
        simulate(add_communication(compute, 2, 2), 2, 2, Costs(1.0, 1.0))
    msg = str(info.value)
    assert msg.startswith("deadlock: ")
    assert "rank 0 at B0.0 waits for message SEND_B1.0 from rank 1" in msg
    assert "rank 1 at F1.1 waits for message SEND_F0.1 from rank 0" in msg


def test_deadlock_on_one_rank_and_w_before_b() -> None:
    bad = [[Action(0, F, 0), Action(1, F, 0), Action(0, B, 0), Action(1, B, 0)]]
    with pytest.raises(ScheduleError, match=r"rank 0 at B0.0 waits for B1.0 \(rank 0\)"):
        simulate(bad, 1, 2, Costs(1.0, 1.0))
    bad = [[Action(0, F, 0), Action(0, W, 0), Action(0, B, 0)]]
    with pytest.raises(ScheduleError, match=r"rank 0 at W0.0 waits for B0.0"):
        simulate(bad, 1, 1, Costs(1.0, 1.0, 1.0))


def test_missing_comm_raises() -> None:
    # Compute-only lists have no messages: rank 1 waits forever for its activation.
    with pytest.raises(ScheduleError, match="F1.0 waits for message SEND_F0.0"):
        simulate(compute_schedule("1f1b", 2, 1, 2), 2, 2, Costs(1.0, 1.0))
    # A receive that nobody sends to (message never consumed either).
    bad = [list(a) for a in build_schedule("gpipe", 2, 1, 1)]
    bad[1].insert(0, Action(1, Op.RECV_F, 3))
    with pytest.raises(ScheduleError, match="without a matching send/receive: SEND_F0.3"):
        simulate(bad, 2, 2, Costs(1.0, 1.0))
    with pytest.raises(ScheduleError, match="does not belong"):
        simulate([[Action(1, F, 0)], []], 2, 2, Costs(1.0, 1.0))


def test_many_actions() -> None:
    """A schedule of over 10^4 actions simulates whole: every rank's work counted (speed is the
    benchmarks' business, not a test's)."""
    sched = build_schedule("interleaved-1f1b", 8, 4, 64)
    n = sum(map(len, sched))
    assert n > 10**4
    res = simulate(sched, 8, 32, Costs(1.0, 2.0, latency_s=0.1))
    assert res.busy_s == pytest.approx([64 * 4 * 3.0] * 8)  # 64 microbatches x 4 chunks x (F 1 + B 2)
    assert res.step_time_s > max(res.busy_s)


# --- trace ------------------------------------------------------------------------------


def test_sim_trace_has_waits_and_tracks() -> None:
    res = run("1f1b", 2, 2, Costs(1.0, 2.0, latency_s=0.5, send_overhead_s=0.1))
    trace = sim_trace(res)
    json.dumps(trace)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in xs} == {0, 1}
    assert len([e for e in xs if e["cat"] != "wait"]) == len(res.events)
    waits = [e for e in xs if e["cat"] == "wait"]
    assert len(waits) == sum(e.wait_s > 0 for e in res.events) > 0
    f10 = next(e for e in xs if e["name"] == "F1.0")
    w = next(e for e in waits if e["args"]["before"] == "F1.0")
    assert w["ts"] + w["dur"] == pytest.approx(f10["ts"])
    assert {e["cat"] for e in xs} == {"compute", "comm", "wait"}
    names = {e["args"].get("name") for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"simulated", "rank 0", "rank 1"} <= names


def test_late_posting_delays_arrival_hand_computed() -> None:
    # zb-h1, pp=2, m=2, unit F/B/W: rank 1 runs F1.0 [1,2] B1.0 [2,3] F1.1 [3,4] B1.1 [4,5] W1.0 W1.1
    # [5,7]; rank 0's B0.1 starts when SEND_B1.1 arrives (5), and the step ends at 7. Posted only
    # after the two Ws (a runtime that flushes its queue at the step's end), it arrives at 7: rank 0
    # runs B0.1 [7,8] and W0.1 [8,9].
    acts = build_schedule("zb-h1", 2, 1, 2)
    assert simulate(acts, 2, 2, Costs(1.0, 1.0, 1.0)).step_time_s == pytest.approx(7.0)
    late = Action(1, Op.SEND_B, 1)
    moved = [acts[0], [a for a in acts[1] if a != late] + [late]]
    res = simulate(moved, 2, 2, Costs(1.0, 1.0, 1.0))
    assert res.step_time_s == pytest.approx(9.0)
    assert ev(res, "B0.1") == pytest.approx((7.0, 8.0))
    assert res.arrivals[late] == pytest.approx(7.0)
