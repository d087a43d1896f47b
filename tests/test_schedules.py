"""Tests for hybridpar.pipeline.schedules: generated schedules are complete, deadlock-free and
NCCL-order-correct, and hand-broken schedules are rejected for the right reason."""

from __future__ import annotations

from collections import defaultdict

import pytest

from hybridpar.pipeline.schedules import (
    Action,
    Op,
    ScheduleError,
    add_communication,
    bubble_fraction_theory,
    build_schedule,
    compute_schedule,
    format_grid,
    validate_schedule,
)

F, B = Op.FORWARD, Op.BACKWARD
RECVS = (Op.RECV_F, Op.RECV_B)
SENDS = (Op.SEND_F, Op.SEND_B)


def combos() -> list[tuple[str, int, int, int]]:
    # Every combination the registry allows (each ScheduleSpec, pipeline/schedules/): 1F1B from m = pp, interleaving
    # from pp = 2 in whole rounds of pp microbatches.
    out = []
    for pp in (1, 2, 3, 4, 8):
        for m in range(1, 3 * pp + 2):
            out += [("gpipe", pp, 1, m)] + ([("1f1b", pp, 1, m)] if m >= pp else [])
            if m % pp == 0 and pp > 1:
                out += [("interleaved-1f1b", pp, v, m) for v in (1, 2, 3)]
    return out


COMBOS = combos()


def ids(c: tuple[str, int, int, int]) -> str:
    return f"{c[0]}-pp{c[1]}-v{c[2]}-m{c[3]}"


def grid_rows(grid: str) -> list[list[str]]:
    """Parse format_grid output back into cells (header and footer dropped)."""
    return [line.split()[1:] for line in grid.splitlines()[1:] if not line.startswith("(")]


def gpipe_pp2_m2() -> list[list[Action]]:
    return build_schedule("gpipe", 2, 1, 2)


@pytest.mark.parametrize("lookahead", [0, 1, 3])
@pytest.mark.parametrize("combo", COMBOS, ids=ids)
def test_built_schedules_validate_and_cover(combo: tuple[str, int, int, int], lookahead: int) -> None:
    name, pp, v, m = combo
    n_stages = pp * v
    sched = build_schedule(name, pp, v, m, recv_lookahead=lookahead)
    validate_schedule(sched, pp, n_stages, m)  # idempotent: build already validated
    assert len(sched) == pp
    for r, acts in enumerate(sched):
        compute = [a for a in acts if a.op in (F, B)]
        expected = {Action(s, op, mb) for s in range(r, n_stages, pp) for mb in range(m) for op in (F, B)}
        assert len(compute) == len(expected) and set(compute) == expected
        assert all(a.stage % pp == r for a in acts)  # Megatron's loop placement
        assert compute == compute_schedule(name, pp, v, m)[r]
    n_sends = sum(a.op in SENDS for acts in sched for a in acts)
    n_recvs = sum(a.op in RECVS for acts in sched for a in acts)
    assert n_sends == n_recvs == (0 if pp == 1 else 2 * (n_stages - 1) * m)


@pytest.mark.parametrize("combo", COMBOS, ids=ids)
def test_link_order_and_receive_placement(combo: tuple[str, int, int, int]) -> None:
    # Checked independently of validate_schedule: per (src, dst) link the receiver posts in
    # the sender's order, and each receive goes out exactly `lookahead` computes early
    # (or earlier, only when link order forces it).
    name, pp, v, m = combo
    for lookahead in (0, 1, 3):
        sched = build_schedule(name, pp, v, m, recv_lookahead=lookahead)
        sent: dict[tuple[int, int], list[tuple[int, int, str]]] = defaultdict(list)
        got: dict[tuple[int, int], list[tuple[int, int, str]]] = defaultdict(list)
        for r, acts in enumerate(sched):
            consumer = {a: i for i, a in enumerate(a for a in acts if a.op in (F, B))}
            n_compute = 0
            for a in acts:
                if a.op is Op.SEND_F:
                    sent[r, (a.stage + 1) % pp].append((a.stage + 1, a.microbatch, "F"))
                elif a.op is Op.SEND_B:
                    sent[r, (a.stage - 1) % pp].append((a.stage - 1, a.microbatch, "B"))
                elif a.op in RECVS:
                    fwd = a.op is Op.RECV_F
                    src = (a.stage - 1 if fwd else a.stage + 1) % pp
                    got[src, r].append((a.stage, a.microbatch, "F" if fwd else "B"))
                    c = consumer[Action(a.stage, F if fwd else B, a.microbatch)]
                    assert n_compute <= max(0, c - lookahead)
                    if v == 1 or name != "interleaved-1f1b":
                        assert n_compute == max(0, c - lookahead), (r, str(a))
                else:
                    n_compute += 1
        assert sent == got


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", range(1, 26))
def test_1f1b_memory_bound(pp: int, m: int) -> None:
    if m < pp:  # the registry's minimum: 1F1B's warm-up runs one microbatch per rank
        with pytest.raises(ValueError, match=f"schedule=1f1b needs microbatches ≥ pp={pp}, got {m}"):
            compute_schedule("1f1b", pp, 1, m)
        return
    for r, acts in enumerate(compute_schedule("1f1b", pp, 1, m)):
        in_flight = peak = 0
        for a in acts:
            in_flight += 1 if a.op is F else -1
            peak = max(peak, in_flight)
        assert peak == pp - r
    # GPipe, by contrast, stashes every microbatch: the property above is a real constraint.
    assert all(sum(a.op is F for a in acts[:m]) == m for acts in compute_schedule("gpipe", pp, 1, m))


@pytest.mark.parametrize("combo", COMBOS, ids=ids)
def test_warmup_depth(combo: tuple[str, int, int, int]) -> None:
    # Forwards issued before the first backward: warm-up plus the first steady-state F.
    name, pp, v, m = combo
    for r, acts in enumerate(compute_schedule(name, pp, v, m)):
        warmup = {"gpipe": m, "1f1b": pp - r - 1, "interleaved-1f1b": (pp - r - 1) * 2 + (v - 1) * pp}[name]
        first_b = next(i for i, a in enumerate(acts) if a.op is B)
        assert first_b == min(warmup + 1, m * v)


def test_compute_orders_literal() -> None:
    r0 = [str(a) for a in compute_schedule("1f1b", 4, 1, 6)[0]]
    assert r0 == ["F0.0", "F0.1", "F0.2", "F0.3", "B0.0", "F0.4", "B0.1", "F0.5", "B0.2", "B0.3", "B0.4", "B0.5"]
    r3 = [str(a) for a in compute_schedule("1f1b", 4, 1, 4)[3]]
    assert r3 == ["F3.0", "B3.0", "F3.1", "B3.1", "F3.2", "B3.2", "F3.3", "B3.3"]
    # Megatron interleaved, pp=2 v=2 m=4, rank 1: warmup (2-1-1)*2 + (2-1)*2 = 2 forwards.
    r1 = [str(a) for a in compute_schedule("interleaved-1f1b", 2, 2, 4)[1]]
    assert r1 == [
        "F1.0",
        "F1.1",
        "F3.0",
        "B3.0",
        "F3.1",
        "B3.1",
        "F1.2",
        "B1.0",
        "F1.3",
        "B1.1",
        "F3.2",
        "B3.2",
        "F3.3",
        "B3.3",
        "B1.2",
        "B1.3",
    ]


def test_format_grid_gpipe_literal() -> None:
    expected = (
        "step  r0    r1\n"
        "   0  F0.0  .\n"
        "   1  F0.1  F1.0\n"
        "   2  .     F1.1\n"
        "   3  .     B1.0\n"
        "   4  B0.0  B1.1\n"
        "   5  B0.1  ."
    )
    assert format_grid(gpipe_pp2_m2(), 2, 2) == expected


@pytest.mark.parametrize("combo", COMBOS, ids=ids)
def test_simulated_bubble_matches_theory(combo: tuple[str, int, int, int]) -> None:
    # With unit-time F and B, every schedule here attains the textbook bubble exactly.
    name, pp, v, m = combo
    rows = grid_rows(format_grid(build_schedule(name, pp, v, m), pp, pp * v))
    assert rows and all(len(row) == pp for row in rows)
    cells = [c for row in rows for c in row]
    assert cells.count(".") / len(cells) == pytest.approx(bubble_fraction_theory(name, pp, v, m))


def test_bubble_theory_values() -> None:
    assert bubble_fraction_theory("gpipe", 4, 1, 8) == pytest.approx(3 / 11)
    assert bubble_fraction_theory("1f1b", 8, 1, 32) == pytest.approx(7 / 39)
    assert bubble_fraction_theory("interleaved-1f1b", 4, 2, 8) == pytest.approx(3 / 19)
    assert bubble_fraction_theory("1f1b", 1, 1, 5) == 0.0
    with pytest.raises(ValueError):
        bubble_fraction_theory("interleaved-1f1b", 4, 2, 6)


# --- hand-broken schedules -------------------------------------------------------------


def edit(sched: list[list[Action]], rank: int, fn) -> list[list[Action]]:  # noqa: ANN001
    out = [list(acts) for acts in sched]
    out[rank] = fn(out[rank])
    return out


def without(acts: list[Action], name: str) -> list[Action]:
    assert name in [str(a) for a in acts]
    return [a for a in acts if str(a) != name]


def move_after(acts: list[Action], name: str, anchor: str) -> list[Action]:
    a = next(x for x in acts if str(x) == name)
    acts = without(acts, name)
    i = [str(x) for x in acts].index(anchor)
    return acts[: i + 1] + [a] + acts[i + 1 :]


def assert_rejected(sched: list[list[Action]], pp: int, n_stages: int, m: int, *fragments: str) -> str:
    with pytest.raises(ScheduleError) as info:
        validate_schedule(sched, pp, n_stages, m)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, msg
    assert msg.endswith(format_grid(sched, pp, n_stages))
    assert "\nstep  r0" in msg
    return msg


def test_reject_missing_backward() -> None:
    bad = edit(gpipe_pp2_m2(), 1, lambda a: without(a, "B1.0"))
    assert_rejected(bad, 2, 2, 2, "rank 1: missing B1.0")


def test_reject_duplicated_forward() -> None:
    bad = edit(gpipe_pp2_m2(), 0, lambda a: a + [Action(0, F, 1)])
    assert_rejected(bad, 2, 2, 2, "rank 0: F0.1 appears twice")


def test_reject_wrong_rank() -> None:
    good = build_schedule("1f1b", 4, 1, 4)
    bad = [list(a) for a in good]
    bad[1].remove(Action(1, F, 2))
    bad[2].insert(0, Action(1, F, 2))
    assert_rejected(bad, 4, 4, 4, "rank 2: F1.2 at position 0 is on the wrong rank", "stage 1 lives on rank 1")


def test_reject_out_of_range() -> None:
    bad = edit(gpipe_pp2_m2(), 0, lambda a: a + [Action(0, F, 2)])
    assert_rejected(bad, 2, 2, 2, "rank 0: F0.2", "out of range")


def test_reject_recv_after_consumer() -> None:
    bad = edit(gpipe_pp2_m2(), 1, lambda a: move_after(a, "RECV_F1.1", "F1.1"))
    assert_rejected(bad, 2, 2, 2, "rank 1: RECV_F1.1", "posted after its consumer F1.1")


def test_reject_send_before_producer() -> None:
    bad = edit(gpipe_pp2_m2(), 1, lambda a: move_after(a, "SEND_B1.1", "F1.1"))
    assert_rejected(bad, 2, 2, 2, "rank 1: SEND_B1.1", "before its producer B1.1")


def test_reject_swapped_link_order() -> None:
    good = gpipe_pp2_m2()
    assert [str(a) for a in good[1][:2]] == ["RECV_F1.0", "RECV_F1.1"]
    bad = edit(good, 1, lambda a: [a[1], a[0]] + a[2:])
    assert_rejected(bad, 2, 2, 2, "link rank 0 -> rank 1: message #0 is sent as SEND_F0.0", "posts RECV_F1.1")


def test_reject_swapped_link_order_mixed_directions() -> None:
    # pp=2 v=2: link 0 -> 1 carries activations (stages 0, 2) and gradients (stage 2).
    good = build_schedule("interleaved-1f1b", 2, 2, 2, recv_lookahead=3)
    from_rank0 = [
        i for i, a in enumerate(good[1]) if (a.op is Op.RECV_F and a.stage > 0) or (a.op is Op.RECV_B and a.stage == 1)
    ]
    k = next(k for k, i in enumerate(from_rank0) if good[1][i].op is Op.RECV_B)
    assert k > 0
    i, j = from_rank0[k - 1], from_rank0[k]  # a RECV_F and the RECV_B right after it on the link
    assert good[1][i].op is Op.RECV_F
    bad = edit(good, 1, lambda a: a[:i] + [a[j]] + a[i + 1 : j] + [a[i]] + a[j + 1 :])
    assert_rejected(
        bad, 2, 4, 2, f"link rank 0 -> rank 1: message #{k - 1}", f"posts {good[1][j]} as its receive #{k - 1}"
    )


def test_reject_missing_send() -> None:
    bad = edit(gpipe_pp2_m2(), 0, lambda a: without(a, "SEND_F0.1"))
    assert_rejected(bad, 2, 2, 2, "rank 0: missing SEND_F0.1")


def test_reject_unneeded_comm() -> None:
    # pp=1 with two stages: they share the rank, so any communication is wrong.
    good = add_communication([[Action(0, F, 0), Action(1, F, 0), Action(1, B, 0), Action(0, B, 0)]], 1, 2)
    assert all(a.op in (F, B) for a in good[0])
    validate_schedule(good, 1, 2, 1)
    bad = edit(good, 0, lambda a: a[:1] + [Action(0, Op.SEND_F, 0)] + a[1:])
    assert_rejected(bad, 1, 2, 1, "rank 0: unexpected SEND_F0.0")


def test_reject_deadlock_cycle() -> None:
    # Rank 0 waits at B0.0 for B1.0, but rank 1 must first run F1.1, which needs F0.1,
    # which rank 0 only runs after B0.0: a genuine cycle.
    compute = [
        [Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
        [Action(1, F, 0), Action(1, F, 1), Action(1, B, 0), Action(1, B, 1)],
    ]
    bad = add_communication(compute, 2, 2)
    msg = assert_rejected(
        bad,
        2,
        2,
        2,
        "deadlock: ",
        "rank 0 at B0.0 waits for B1.0 (rank 1), SEND_B1.0 (rank 1)",
        "rank 1 at F1.1 waits for F0.1 (rank 0), SEND_F0.1 (rank 0)",
        "(stuck after 2 steps)",
    )
    assert grid_rows(msg.split("\n", 1)[1]) == [["F0.0", "."], [".", "F1.0"]]


def test_reject_deadlock_on_one_rank() -> None:
    # pp=1 v=2: B0.0 before B1.0 on the same rank can never run.
    compute = [[Action(0, F, 0), Action(1, F, 0), Action(0, B, 0), Action(1, B, 0)]]
    bad = add_communication(compute, 1, 2)
    assert_rejected(bad, 1, 2, 1, "deadlock: rank 0 at B0.0 waits for B1.0 (rank 0)")


# --- argument errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("interleaved", 2, 2, 4), "did you mean 'interleaved-1f1b'"),
        (("1F1B", 2, 1, 4), "did you mean '1f1b'"),
        (("zero-bubble", 2, 1, 4), "unknown schedule 'zero-bubble'"),
        (
            ("1f1b", 2, 2, 4),
            "schedule=1f1b runs 1 stage per pipeline rank, got virtual_stages=2: set "
            "virtual_stages=1 (the default) or schedule=interleaved-1f1b",
        ),
        (("gpipe", 2, 3, 4), "or schedule=interleaved-1f1b"),
        (
            ("interleaved-1f1b", 4, 2, 6),
            "schedule=interleaved-1f1b needs microbatches divisible by pp=4, got 6 " "(6 % 4 = 2)",
        ),
        (("interleaved-1f1b", 1, 2, 4), "schedule=interleaved-1f1b needs pp >= 2, got 1"),
        (("1f1b", 4, 1, 3), "schedule=1f1b needs microbatches ≥ pp=4, got 3"),
        (("1f1b", 0, 1, 4), "pp must be a positive integer"),
        (("1f1b", 2, 1, 0), "microbatches must be a positive integer"),
        (("interleaved-1f1b", 2, 0, 4), "virtual_stages must be a positive integer"),
        (("gpipe", True, 1, 4), "pp must be a positive integer"),
    ],
)
def test_bad_arguments(args: tuple, fragment: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError) as info:
        build_schedule(*args)
    assert fragment in str(info.value)


def test_bad_lookahead_and_rank_count() -> None:
    compute = compute_schedule("1f1b", 2, 1, 2)
    with pytest.raises(ValueError, match="recv_lookahead"):
        add_communication(compute, 2, 2, recv_lookahead=-1)
    with pytest.raises(ValueError, match="expected 3 rank lists"):
        add_communication(compute, 3, 3)
    with pytest.raises(ScheduleError, match="expected 3 rank lists"):
        validate_schedule(compute, 3, 3, 2)


def test_action_str() -> None:
    assert str(Action(2, F, 3)) == "F2.3"
    assert str(Action(2, Op.SEND_F, 3)) == "SEND_F2.3"
    assert str(Action(5, Op.RECV_B, 1)) == "RECV_B5.1"


# --- zb-h1 (Qi et al., 2024): split backward, W deferred into bubbles -----------------

W = Op.WEIGHT
ZB_COMBOS = [("zb-h1", pp, 1, m) for pp in (1, 2, 3, 4, 5, 8) for m in range(pp, 3 * pp + 2)]


@pytest.mark.parametrize("lookahead", [0, 1, 3])
@pytest.mark.parametrize("combo", ZB_COMBOS, ids=ids)
def test_zb_h1_validates_and_covers(combo: tuple[str, int, int, int], lookahead: int) -> None:
    name, pp, v, m = combo
    sched = build_schedule(name, pp, v, m, recv_lookahead=lookahead)
    validate_schedule(sched, pp, pp, m)
    for r, acts in enumerate(sched):
        compute = [a for a in acts if a.is_compute]
        assert compute == compute_schedule(name, pp, v, m)[r]
        expected = {Action(r, op, mb) for mb in range(m) for op in (F, B, W)}
        assert len(compute) == 3 * m and set(compute) == expected  # each W exactly once
        pos = {a: i for i, a in enumerate(acts)}
        assert all(pos[Action(r, W, mb)] > pos[Action(r, B, mb)] for mb in range(m))
    # W never communicates: exactly the messages of 1F1B.
    n_comm = sum(not a.is_compute for acts in sched for a in acts)
    assert n_comm == sum(not a.is_compute for acts in build_schedule("1f1b", pp, 1, m, lookahead) for a in acts)


@pytest.mark.parametrize("combo", ZB_COMBOS, ids=ids)
def test_zb_h1_keeps_1f1b_order_and_memory(combo: tuple[str, int, int, int]) -> None:
    _, pp, _, m = combo
    for r, (zb, ref) in enumerate(zip(compute_schedule("zb-h1", pp, 1, m), compute_schedule("1f1b", pp, 1, m))):
        assert [a for a in zb if a.op is not W] == ref
        no_b = no_w = peak_b = peak_w = 0
        for a in zb:
            no_b += {F: 1, B: -1}.get(a.op, 0)
            no_w += {F: 1, W: -1}.get(a.op, 0)
            peak_b, peak_w = max(peak_b, no_b), max(peak_w, no_w)
        assert peak_b == pp - r  # as 1F1B: at most pp - r microbatches before their B
        assert peak_w == pp  # pending W (weights' inputs kept) never above rank 0's 1F1B peak


@pytest.mark.parametrize("combo", ZB_COMBOS, ids=ids)
def test_zb_h1_unit_bubble_matches_theory(combo: tuple[str, int, int, int]) -> None:
    # Lock-step unit time is exactly F = B = W = 1: the bubble is (p-1) / (3m + p-1).
    name, pp, v, m = combo
    rows = grid_rows(format_grid(build_schedule(name, pp, v, m), pp, pp))
    assert len(rows) == 3 * m + pp - 1
    cells = [c for row in rows for c in row]
    assert cells.count(".") / len(cells) == pytest.approx(bubble_fraction_theory(name, pp, v, m))
    assert bubble_fraction_theory(name, pp, v, m) == pytest.approx((pp - 1) / (3 * m + pp - 1))


def test_zb_h1_literal_orders_and_grid() -> None:
    r = [" ".join(map(str, acts)) for acts in compute_schedule("zb-h1", 4, 1, 8)]
    assert r[0] == (
        "F0.0 F0.1 F0.2 F0.3 B0.0 W0.0 F0.4 B0.1 W0.1 F0.5 B0.2 W0.2 F0.6 B0.3 W0.3 "
        "F0.7 B0.4 W0.4 B0.5 W0.5 B0.6 W0.6 B0.7 W0.7"
    )
    assert r[3] == (
        "F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3 W3.0 F3.4 B3.4 W3.1 F3.5 B3.5 W3.2 "
        "F3.6 B3.6 W3.3 F3.7 B3.7 W3.4 W3.5 W3.6 W3.7"
    )
    expected = (
        "step  r0    r1\n"
        "   0  F0.0  .\n"
        "   1  F0.1  F1.0\n"
        "   2  .     B1.0\n"
        "   3  B0.0  F1.1\n"
        "   4  W0.0  B1.1\n"
        "   5  F0.2  W1.0\n"
        "   6  B0.1  F1.2\n"
        "   7  W0.1  B1.2\n"
        "   8  B0.2  W1.1\n"
        "   9  W0.2  W1.2"
    )
    assert format_grid(build_schedule("zb-h1", 2, 1, 3), 2, 2) == expected


def test_zb_h1_theory_values() -> None:
    assert bubble_fraction_theory("zb-h1", 4, 1, 8) == pytest.approx(3 / 27)
    # Paper: (p-1)(F+B-W) = 3 * 1.5 for W = 0.5; fraction 4.5 / (8 * 2.5 + 4.5).
    assert bubble_fraction_theory("zb-h1", 4, 1, 8, t_w=0.5) == pytest.approx(4.5 / 24.5)
    # W larger than F or B cannot hide more than the (p-1) max(F, B) floor.
    assert bubble_fraction_theory("zb-h1", 4, 1, 8, t_w=2.0) == pytest.approx(3 / 35)
    # Costs change nothing for the others (full backward = t_b + t_w there).
    assert bubble_fraction_theory("1f1b", 4, 1, 8, t_b=5.0) == pytest.approx(3 / 11)
    assert bubble_fraction_theory("zb-h1", 1, 1, 3) == 0.0
    with pytest.raises(ValueError, match="costs must be"):
        bubble_fraction_theory("zb-h1", 4, 1, 8, t_w=-1.0)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("zb-h1", 2, 2, 4), "schedule=zb-h1 runs 1 stage per pipeline rank, got virtual_stages=2"),
        (("zb-h1", 4, 1, 3), "schedule=zb-h1 needs microbatches ≥ pp=4, got 3"),
        (("zb_h1", 2, 1, 4), "did you mean 'zb-h1'"),
    ],
)
def test_zb_h1_bad_arguments(args: tuple, fragment: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError) as info:
        build_schedule(*args)
    assert fragment in str(info.value)


def zb_pp2_m2() -> list[list[Action]]:
    return build_schedule("zb-h1", 2, 1, 2)


def test_reject_w_before_its_b() -> None:
    good = zb_pp2_m2()
    bad = edit(good, 1, lambda a: move_after(a, "W1.0", "F1.0"))
    i = [str(a) for a in bad[1]].index("W1.0")
    msg = assert_rejected(bad, 2, 2, 2, f"rank 1: W1.0 at position {i} comes before its B1.0 at {i + 2}")
    # The unit-time grid also knows W waits for its B: rank 1 is stuck at W1.0.
    assert msg.endswith("(stuck after 2 steps)")


def test_reject_missing_w() -> None:
    bad = edit(zb_pp2_m2(), 0, lambda a: without(a, "W0.1"))
    assert_rejected(bad, 2, 2, 2, "rank 0: missing W0.1 (the schedule splits backwards into B and W)")


def test_reject_duplicated_w() -> None:
    bad = edit(zb_pp2_m2(), 1, lambda a: a + [Action(1, W, 0)])
    assert_rejected(bad, 2, 2, 2, "rank 1: W1.0 appears twice")


def test_reject_w_on_other_rank() -> None:
    good = zb_pp2_m2()
    bad = [list(a) for a in good]
    bad[1].remove(Action(1, W, 1))
    bad[0].append(Action(1, W, 1))
    assert_rejected(bad, 2, 2, 2, "rank 0: W1.1", "on the wrong rank")


def test_reject_lone_w_in_unsplit_schedule() -> None:
    # One W turns the schedule into a split one: then every other (stage, mb) lacks its W.
    bad = edit(gpipe_pp2_m2(), 0, lambda a: a + [Action(0, W, 1)])
    assert_rejected(bad, 2, 2, 2, "rank 0: missing W0.0")


def test_w_str() -> None:
    assert str(Action(0, W, 3)) == "W0.3"
    assert Action(0, W, 3).is_compute
