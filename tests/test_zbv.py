"""ZB-V (hybridpar/pipeline/schedules/zb_v.py): the V placement through lowering, validator and simulator, torch's
order action for action, its memory and bubble, and the config rules of `--parallel.schedule zb-v`."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from hybridpar.config import Config
from hybridpar.pipeline.schedules import (
    CONFIG_KEYS,
    Action,
    Op,
    ScheduleError,
    build_schedule,
    compute_schedule,
    format_grid,
    max_in_flight,
    schedule_spec,
    stage_count,
    stages_per_rank,
    validate_schedule,
)
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.pipeline.simulate import Costs, simulate
from hybridpar.resilience.elastic import replan

F, B, W = Op.FORWARD, Op.BACKWARD, Op.WEIGHT
SPEC = schedule_spec("zb-v")


def run(pp: int, m: int, costs: Costs, name: str = "zb-v") -> float:
    spec = schedule_spec(name)
    v = spec.default_virtual_stages
    return simulate(build_schedule(name, pp, v, m), pp, pp * v, costs, ranks=spec.stage_ranks(pp, v))


def test_v_placement_and_messages() -> None:
    sched = build_schedule("zb-v", 4, 2, 7)
    assert SPEC.stage_ranks(4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert {a.stage for a in sched[0]} == {0, 7} and {a.stage for a in sched[3]} == {3, 4}
    comm = [a for acts in sched for a in acts if not a.is_compute]
    # The turn (stage 3 -> 4, both on rank 3) is local: no message carries it.
    assert not any(
        a.stage in (3, 4)
        and a.op in (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B)
        and {a.stage, a.stage + (1 if a.op in (Op.SEND_F,) else -1 if a.op is Op.SEND_B else 0)} == {3, 4}
        for a in comm
    )
    assert Action(3, Op.SEND_F, 0) not in comm and Action(4, Op.SEND_B, 0) not in comm
    assert Action(2, Op.SEND_F, 0) in comm and Action(4, Op.SEND_F, 0) in comm  # rank 2 -> 3 and 3 -> 2
    assert len(comm) == 4 * 6 * 7  # 6 boundaries cross ranks, 2 messages each way per microbatch


def test_validator_checks_the_v_placement() -> None:
    good = build_schedule("zb-v", 2, 2, 3)
    # Under Megatron's loop placement stage 3 would live on rank 1: the same lists are rejected.
    with pytest.raises(
        ScheduleError, match=r"^rank 0: RECV_F3\.0 at position 4 is on the wrong rank " r"\(stage 3 lives on rank 1\)"
    ):
        validate_schedule(good, 2, 4, 3)
    bad = [list(acts) for acts in good]
    i = bad[0].index(Action(3, W, 0))
    bad[0].insert(bad[0].index(Action(3, B, 0)), bad[0].pop(i))
    with pytest.raises(ScheduleError, match=r"rank 0: W3\.0 at position \d+ comes before its B3\.0"):
        validate_schedule(bad, 2, 4, 3, ranks=SPEC.stage_ranks(2, 2))


def test_literal_grid_pp2() -> None:
    # Rank 1 (stages 1 and 2), by the phases of zb_v.py: F1.0 | F2.0 F1.1 | F2.1 B2.0 W2.0 | F1.2 B1.0 W1.0
    # F2.2 B2.1 W2.1 | B1.1 B2.2 B1.2 W1.1 W2.2 W1.2. One idle unit per rank: (p-1) / (6 m + p-1).
    expected = (
        "step  r0    r1\n"
        "   0  F0.0  .\n"
        "   1  F0.1  F1.0\n"
        "   2  F0.2  F2.0\n"
        "   3  F3.0  F1.1\n"
        "   4  B3.0  F2.1\n"
        "   5  W3.0  B2.0\n"
        "   6  F3.1  W2.0\n"
        "   7  B3.1  F1.2\n"
        "   8  W3.1  B1.0\n"
        "   9  B0.0  W1.0\n"
        "  10  W0.0  F2.2\n"
        "  11  F3.2  B2.1\n"
        "  12  B3.2  W2.1\n"
        "  13  W3.2  B1.1\n"
        "  14  B0.1  B2.2\n"
        "  15  W0.1  B1.2\n"
        "  16  B0.2  W1.1\n"
        "  17  W0.2  W2.2\n"
        "  18  .     W1.2"
    )
    assert format_grid(build_schedule("zb-v", 2, 2, 3), 2, 4, ranks=SPEC.stage_ranks(2, 2)) == expected


def _torch_order(pp: int, m: int, rank: int) -> list[str]:
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _ComputationType

    # The method only reads these three attributes: no stage or process group needed.
    fake = SimpleNamespace(pp_group_size=pp, num_stages=2 * pp, _n_microbatches=m)
    ops = ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, rank)
    letter = {
        _ComputationType.FORWARD: "F",
        _ComputationType.BACKWARD_INPUT: "B",
        _ComputationType.BACKWARD_WEIGHT: "W",
    }
    return [f"{letter[a.computation_type]}{a.stage_index}.{a.microbatch_index}" for a in ops if a is not None]


@pytest.mark.parametrize("pp", [2, 3, 4, 5])
def test_same_order_as_torch(pp: int) -> None:
    for m in (2 * pp - 1, 2 * pp, 3 * pp + 1):
        for r, acts in enumerate(compute_schedule("zb-v", pp, 2, m)):
            assert [str(a) for a in acts] == _torch_order(pp, m, r), (pp, m, r)


@pytest.mark.parametrize("pp", [2, 3, 4, 6, 8])
def test_memory_is_1f1b_peak_on_every_rank(pp: int) -> None:
    for m in (2 * pp - 1, 5 * pp):
        for acts in compute_schedule("zb-v", pp, 2, m):
            alive = pending_w = peak = peak_w = 0
            for a in acts:
                alive += {F: 1, B: -1}.get(a.op, 0)
                pending_w += {F: 1, W: -1}.get(a.op, 0)
                peak, peak_w = max(peak, alive), max(peak_w, pending_w)
            assert peak == peak_w == 2 * pp  # chunk activations: pp microbatches of the rank's layers
        assert max_in_flight(build_schedule("zb-v", pp, 2, m)) == 2 * pp


def test_bubble_below_zb_h1_at_the_benchmark_point() -> None:
    # pp=4, m=8, F/B/W 20/20/20 ms per rank (bench: --f-ms 20 --b-ms 40, W = B/2): ZB-V's chunks cost half.
    zbv = run(4, 8, Costs(0.010, 0.010, 0.010))
    zbh1 = run(4, 8, Costs(0.020, 0.020, 0.020), "zb-h1")
    assert zbv.step_time_s == pytest.approx(0.510) and zbh1.step_time_s == pytest.approx(0.540)
    assert zbv.bubble_fraction == pytest.approx(3 / 51) and zbh1.bubble_fraction == pytest.approx(3 / 27)
    assert SPEC.bubble_fraction(4, 2, 8, t_f=0.01, t_b=0.01, t_w=0.01) == pytest.approx(3 / 51)


@pytest.mark.parametrize("seed", range(60))
def test_bubble_formula_for_random_costs(seed: int) -> None:
    rng = random.Random(seed)
    pp = rng.choice([2, 3, 4, 5, 8])
    m = rng.randint(2 * pp - 1, 4 * pp)
    f, b, w = (rng.choice([0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0]) for _ in range(3))
    f, b = min(f, b), max(f, b)  # the formula's domain: B not cheaper than F
    res = run(pp, m, Costs(f, b, w))
    assert res.bubble_fraction == pytest.approx(SPEC.bubble_fraction(pp, 2, m, t_f=f, t_b=b, t_w=w), abs=1e-12)


def test_bubble_formula_refuses_a_backward_cheaper_than_the_forward() -> None:
    with pytest.raises(ValueError, match="zb-v's bubble formula needs t_f <= t_b, got t_f=2.0 > t_b=1.0"):
        SPEC.bubble_fraction(4, 2, 8, t_f=2.0, t_b=1.0, t_w=1.0)


# --- config ----------------------------------------------------------------------------------


def zbv_config(**parallel: object) -> Config:
    cfg = Config()
    cfg.model.n_layers, cfg.train.microbatches = 8, 8
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.schedule = 1, 4, "zb-v"
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def test_config_two_chunks_implied() -> None:
    cfg = zbv_config()
    validate_config(cfg, 4)
    assert cfg.parallel.virtual_stages is None and stages_per_rank(cfg.parallel) == 2 and stage_count(cfg.parallel) == 8
    validate_config(zbv_config(virtual_stages=2), 4)
    for v in (1, 3):
        with pytest.raises(
            ValueError,
            match=f"^parallel.schedule=zb-v runs 2 stages per pipeline rank, got "
            f"parallel.virtual_stages={v}: set parallel.virtual_stages=2 "
            f"\\(the default\\)",
        ):
            validate_config(zbv_config(virtual_stages=v), 4)


def test_config_microbatches_and_layers() -> None:
    cfg = zbv_config()
    cfg.train.microbatches = 6
    with pytest.raises(
        ValueError, match=r"^parallel.schedule=zb-v needs train.microbatches ≥ 2 × parallel.pp - 1 = 7, " r"got 6$"
    ):
        validate_config(cfg, 4)
    cfg = zbv_config()
    cfg.model.n_layers = 6
    with pytest.raises(
        ValueError, match=r"model.n_layers=6 is fewer than parallel.pp × parallel.virtual_stages = " r"4 × 2 = 8 stages"
    ):
        validate_config(cfg, 4)
    assert SPEC.count_problem(4, 8, CONFIG_KEYS) is None
    with pytest.raises(ValueError, match="parallel.schedule=zb-v needs parallel.pp >= 2, got 1"):
        validate_config(zbv_config(pp=1), 1)


def test_config_accepts_live_rebalancing() -> None:
    cfg = zbv_config()
    cfg.balance.mode = "auto"  # the balancer moves layers between V-placed stages (tests/test_rebalance.py)
    validate_config(cfg, 4)


def test_elastic_replan_falls_back_to_zb_h1() -> None:
    cfg = zbv_config()  # pp 4, 8 microbatches, global batch 16
    assert replan(cfg, 2).parallel.schedule == "zb-v"  # pp 2 needs 3 microbatches: kept
    assert replan(cfg, 8).parallel.schedule == "zb-v"  # dp 2: 8 samples per replica, 8 microbatches
    moved = replan(cfg, 12)  # pp 4, dp 3: 5 samples per replica, 5 < 7 microbatches, ZB-H1 needs 4
    assert (moved.parallel.pp, moved.parallel.dp, moved.train.microbatches) == (4, 3, 5)
    assert (moved.parallel.schedule, stages_per_rank(moved.parallel)) == ("zb-h1", 1)
