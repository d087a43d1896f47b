"""Calibrated costs (plan/calibrate.py): the table's parsing and interpolation, the cost model's use of it,
and the measurement through the model's own modules (in this process, one tiny shape)."""

from __future__ import annotations

from dataclasses import astuple, replace

import pytest

from hybridpar.config import Config, ModelConfig
from hybridpar.plan.calibrate import (
    Calibration,
    EndTime,
    LayerTime,
    _local_shard,
    calibrate,
    parse_calibration,
    shapes_for,
    signature,
)
from hybridpar.plan.cost import CostModel, Work, all_reduce_s, busy_comm, placement
from hybridpar.plan.hardware import parse_hardware, to_toml
from hybridpar.plan.step import optimizer_s, predict, stage_costs
from tests.test_plan_cost import cfg_of
from tests.test_plan_cost import hw as cost_hw

SEQ = Config().train.seq_len


def table(model: str | None = None) -> dict:
    return {
        "model": model or signature(Config().model, SEQ),
        "optimizer_layer_us": 1000.0,
        "action_overhead_us": 50.0,
        "layer": [[1, 256, 4000.0, 8000.0, 6000.0, 3000.0], [1, 512, 7000.0, 14000.0, 10000.0, 5000.0]]
        + [[2, 512, 5000.0, 9000.0, 7000.0, 2500.0]],
        "ends": [[256, 40.0, 80.0, 400.0, 800.0], [512, 50.0, 100.0, 700.0, 1400.0]],
    }


def hw(cal: dict | None = None):
    return cost_hw(memory_bandwidth_gbs=30.0, op_overhead_us=5.0, **({"calibration": cal} if cal is not None else {}))


def test_measured_sizes_are_used_as_they_are_and_interpolated_between() -> None:
    cal = parse_calibration(table(), "t")
    assert astuple(cal.layer(1, 512)) == pytest.approx(astuple(LayerTime(1, 512, 7e-3, 14e-3, 10e-3, 5e-3)))
    mid = cal.layer(1, 384)  # halfway
    assert mid.f == pytest.approx(5.5e-3) and mid.w == pytest.approx(4e-3)
    assert cal.layer(1, 1024).f == pytest.approx(13e-3)  # extrapolated along the last two sizes
    assert cal.layer(2, 1024).f == pytest.approx(10e-3)  # one size at this tp: proportional to tokens
    assert cal.layer(4, 512) is None  # not measured at tp=4: the cost model counts FLOPs
    assert astuple(cal.end(512)) == pytest.approx(astuple(EndTime(512, 50e-6, 100e-6, 700e-6, 1400e-6)))


def test_the_table_round_trips_through_the_hardware_file() -> None:
    for t in (table(), table() | {"tp_all_reduce": [[2, 256, 900.0], [2, 512, 1500.0, 3000.0]]}):
        h = hw(t)
        again = parse_hardware(__import__("tomllib").loads(to_toml(h)))
        assert again == h and isinstance(again.calibration, Calibration)
    assert len(again.calibration.collectives) == 2


def test_the_heads_collectives_measured_in_place_replace_the_ring_proportions() -> None:
    cfg = cfg_of(tp=2, m=4)
    tokens = 4 * SEQ  # global batch 16 over 4 microbatches
    per_layer = {"tp_all_reduce": [[2, tokens, 1000.0]]}
    both = {"tp_all_reduce": [[2, tokens, 1000.0, 6000.0]]}
    old, new = CostModel(cfg.model, hw(table() | per_layer)), CostModel(cfg.model, hw(table() | both))
    assert old.hw.calibration.tp_head(2, tokens) is None and new.hw.calibration.tp_head(2, tokens) == 6e-3
    link = placement(cfg.parallel, old.hw).tp
    ratio = cfg.model.vocab_size / cfg.model.dim / 2  # the gather's share in the ring
    assert old.head_comm(cfg.train, 2, tokens, link) == pytest.approx((1e-3 * ratio, 1e-3))
    gather, reduce = new.head_comm(cfg.train, 2, tokens, link)
    assert gather + reduce == pytest.approx(6e-3) and gather / reduce == pytest.approx(ratio)
    extra = predict(new, cfg).step_s - predict(old, cfg).step_s  # 4 microbatches on the one pipeline rank
    assert extra == pytest.approx(4 * (6e-3 - 1e-3 * (ratio + 1)))


@pytest.mark.parametrize(
    "tp, pp, dp, zero, calls",
    [(1, 1, 1, 0, 2), (1, 1, 2, 0, 2), (1, 1, 2, 1, 3), (2, 1, 1, 0, 3), (1, 2, 1, 0, 3), (2, 2, 2, 1, 5)],
)
def test_a_measured_step_sync_is_shared_by_the_steps_closing_reductions(tp, pp, dp, zero, calls) -> None:
    # The probe times three (two over every rank, one for the clip norm); a step makes two plus one per
    # dimension whose ranks hold different parts of the gradient: tp, pp, and dp under ZeRO-1.
    cfg = cfg_of(tp=tp, pp=pp, dp=dp, m=4)
    cfg.parallel.zero = zero
    base = predict(CostModel(cfg.model, hw(table())), cfg)
    timed = predict(CostModel(cfg.model, replace(hw(table()), step_sync_us=9000.0)), cfg)
    world = placement(cfg.parallel, hw()).world
    formula = calls * all_reduce_s(8, tp * pp * dp, world, hw())
    assert timed.step_s - base.step_s == pytest.approx(9e-3 * calls / 3 - formula)
    assert timed.optimizer_s - base.optimizer_s == pytest.approx(9e-3 * calls / 3 - formula)


def test_replicas_arriving_apart_delay_the_data_parallel_reduction() -> None:
    late_hw = replace(hw(table()), sync_wait=((2, 0.0, 0.0), (2, 1e6, 1e6)))  # waits as long as it computed
    for dp, pp in ((2, 1), (2, 2), (1, 2)):
        cfg = cfg_of(pp=pp, dp=dp, m=4)
        base = predict(CostModel(cfg.model, hw(table())), cfg)
        late = predict(CostModel(cfg.model, late_hw), cfg)
        if dp == 1:  # nothing waits for replicas
            assert late == base
        elif pp == 1:  # one rank computing one stage (no tp: its busy time is its work): waits that long
            assert late.step_s - base.step_s == pytest.approx(base.compute_s)
            assert late.dp_reduce_s - base.dp_reduce_s == pytest.approx(base.compute_s)
        else:  # each rank waits for its own work after its last backward: at most the busiest rank's
            assert 0 < late.step_s - base.step_s <= base.compute_s + 1e-12


def test_collectives_measured_on_shared_cores_keep_their_cores_busy() -> None:
    assert busy_comm(Work(1.0, 0.5, 0.25, 3.0), 2.0) == Work(1.0, 0.5, 1.75, 0.0)
    assert busy_comm(Work(1.0, comm_s=3.0), None) == Work(1.0, comm_s=3.0)
    coll = hw(table() | {"tp_all_reduce": [[2, 4 * SEQ, 1000.0, 2000.0]]})  # 4 sequences per microbatch
    shared = replace(coll, cores_per_node=2.0)  # 4 devices a node
    assert CostModel(Config().model, shared).comm_stretch(Config().train) == 2.0
    assert CostModel(Config().model, coll).comm_stretch(Config().train) is None  # cores of their own

    def step(cfg: Config, as_wait: bool) -> float:
        model = CostModel(cfg.model, shared)
        if as_wait:  # the simulator's idle wait, during which other ranks get the cores
            model.comm_stretch = lambda t: None
        return predict(model, cfg).step_s

    # One pipeline rank standing for every rank: all are busy, so work or wait costs the same.
    cfg = cfg_of(tp=2, dp=2, m=4)
    assert step(cfg, False) == pytest.approx(step(cfg, True))
    # Two: a rank in a collective no longer lends its cores to the other stage's ranks.
    cfg = cfg_of(tp=2, pp=2, m=4)
    assert step(cfg, False) > step(cfg, True) * 1.02


def test_a_slower_collective_bandwidth_caps_the_links() -> None:
    h = hw()
    slow = replace(h, collective_bandwidth_gbs=h.intra_node.bandwidth_gbs / 4)
    fast = replace(h, collective_bandwidth_gbs=h.intra_node.bandwidth_gbs * 4)
    big = 64 << 20
    assert all_reduce_s(big, 4, h.intra_node, fast) == all_reduce_s(big, 4, h.intra_node, h)  # the link's, then
    hops = 2 * 3 * h.collective_latency_us * 1e-6 if h.collective_latency_us is not None else 0.0
    moved = all_reduce_s(big, 4, h.intra_node, h) - (hops or 2 * 3 * h.intra_node.latency_us * 1e-6)
    assert all_reduce_s(big, 4, h.intra_node, slow) - all_reduce_s(big, 4, h.intra_node, h) == pytest.approx(3 * moved)


def test_measured_tp_all_reduces_replace_the_link_formula() -> None:
    """A tensor-parallel all-reduce measured in place (4x the idle link's figure on a CPU host) is what
    each layer's two forward and two backward all-reduces and the embedding's cost; other tp sizes,
    and bf16, keep the formula."""
    t, plain = cfg_of().train, CostModel(Config().model, hw(table()))
    model = CostModel(Config().model, hw(table() | {"tp_all_reduce": [[2, 256, 900.0], [2, 512, 1500.0]]}))
    link = model.hw.intra_node
    assert model.calibrated(t).tp_all_reduce(2, 384) == pytest.approx(1200e-6)  # interpolated
    assert model.calibrated(t).tp_all_reduce(4, 512) is None
    lay = model.layer(t, 2, 512, link, "none")
    assert lay.f.comm_s == pytest.approx(2 * 1500e-6) and lay.b.comm_s == pytest.approx(2 * 1500e-6)
    assert model.ends(t, 2, 512, link)[0].comm_s == pytest.approx(1500e-6)
    assert model.layer(t, 4, 512, link, "none").f.comm_s == plain.layer(t, 4, 512, link, "none").f.comm_s
    bf16 = cfg_of(precision="bf16").train
    assert model.layer(bf16, 2, 512, link, "none").f.comm_s == plain.layer(bf16, 2, 512, link, "none").f.comm_s


@pytest.mark.parametrize(
    "change, message",
    [
        ({"layer": [[1, 512, 1.0]]}, "layer must be a non-empty list of \\[6 numbers"),
        ({"ends": []}, "ends must be a non-empty list"),
        ({"optimizer_layer_us": -1}, "optimizer_layer_us must be a number >= 0"),
        ({"model": 3}, "model must be"),
        ({"extra": 1}, "needs the keys .* got .*'extra'"),
        ({"core_share": 0.0}, "core_share must be a number in \\(0, 1\\]"),
        ({"tp_all_reduce": [[2, 512]]}, "tp_all_reduce must be a non-empty list of \\[3-4 numbers"),
    ],
)
def test_bad_tables_are_named(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hw(table() | change)


def test_foreign_load_stretches_the_measured_cpu_times() -> None:
    half = parse_calibration(table() | {"core_share": 0.5}, "t")
    assert half.layer(1, 512).f == pytest.approx(14e-3) and half.end(512).head_b == pytest.approx(2800e-6)


def test_calibrated_layers_replace_flops_and_keep_the_collectives() -> None:
    t, plain = cfg_of().train, CostModel(Config().model, hw())
    model = CostModel(Config().model, hw(table()))
    link = model.hw.intra_node
    lay = model.layer(t, 1, 512, link, "none")
    assert (lay.f.compute, lay.b.compute, lay.w.compute) == pytest.approx((7e-3, 14e-3, 0.0))
    split = model.layer(t, 1, 512, link, "none", split=True)
    assert (split.b.compute, split.w.compute) == pytest.approx((10e-3, 5e-3))
    tp2, flops = model.layer(t, 2, 512, link, "none"), plain.layer(t, 2, 512, link, "none")
    assert tp2.f.compute == pytest.approx(5e-3) and tp2.f.comm_s == flops.f.comm_s > 0
    full = model.layer(t, 1, 512, link, "full")
    assert full.b.compute == pytest.approx(21e-3)
    # Outside the measured shapes, precision or model: FLOPs, as without a table.
    assert model.layer(t, 4, 512, link, "none") == plain.layer(t, 4, 512, link, "none")
    bf16 = cfg_of(precision="bf16").train
    assert model.layer(bf16, 1, 512, link, "none") == plain.layer(bf16, 1, 512, link, "none")
    other = CostModel(ModelConfig(dim=256, n_heads=4, ffn_dim=704), hw(table()))
    assert other.calibrated(t) is None


def test_a_calibrated_one_device_step_adds_up_the_measured_times() -> None:
    cfg = cfg_of(m=4)  # 4 sequences of 128 tokens per microbatch: the 512-token rows
    model = CostModel(cfg.model, hw(table()))
    c = stage_costs(model, cfg, placement(cfg.parallel, model.hw), [range(0, 4)], 512)[0]
    action = 50e-6
    assert c.f.compute == pytest.approx(4 * 7e-3 + action + 50e-6 + 700e-6)
    assert c.b.compute == pytest.approx(4 * 14e-3 + action + 100e-6 + 1400e-6)
    pred = predict(model, cfg)
    assert pred.pipeline_s == pytest.approx(4 * (c.f.total + c.b.total))
    layers = cfg.model.n_layers + (model.counts.embed + model.counts.head) / model.counts.layer
    opt = optimizer_s(model, 1, 1, 0, model.hw.intra_node, layers * model.counts.layer)
    assert opt == pytest.approx(1e-3 * layers)


def test_shapes_follow_the_splits_the_search_can_make() -> None:
    m = Config().model  # 4 heads
    assert shapes_for(m, 4, 4) == [(tp, b) for tp in (1, 2, 4) for b in (1, 2, 4)]
    assert {tp for tp, _ in shapes_for(m, 16, 3)} == {1}


def test_local_shard_keeps_one_ranks_slice() -> None:
    import torch

    from hybridpar.model.registry import build_stage

    m = Config().model
    stage = build_stage(m, [0], False, False, 0, torch.device("cpu"))
    _local_shard(stage, 2)
    attn = stage.layers["0"].self_attn
    assert attn.q_proj.weight.shape == (m.dim // 2, m.dim) and attn.o_proj.weight.shape == (m.dim, m.dim // 2)
    assert stage(torch.randn(1, 8, m.dim)).shape == (1, 8, m.dim)


def test_calibrate_times_the_real_modules() -> None:
    m = ModelConfig(dim=32, n_layers=2, n_heads=2, ffn_dim=64)
    cal = calibrate(m, 16, [(1, 1), (2, 1)], seconds=0.0)
    assert cal.model == signature(m, 16) and [(r.tp, r.tokens) for r in cal.layers] == [(1, 16), (2, 16)]
    assert all(x > 0 for r in cal.layers for x in (r.f, r.b, r.b_input, r.w))
    assert all(x > 0 for x in (cal.ends[0].embed_f, cal.ends[0].head_b, cal.optimizer_layer_s, cal.action_overhead_s))
    assert parse_calibration(__import__("tomllib").loads(cal.to_toml())["calibration"], "t").layers[0].tp == 1


def test_a_calibrated_host_is_planned_in_the_precision_it_timed() -> None:
    """The calibration times fp32 only, and on a CPU host a FLOP peak says nothing of bf16's speed: the
    planner offers fp32 there, and bf16 only where the user holds it."""
    from hybridpar.plan.memory_model import rank_memory
    from hybridpar.plan.search import plan

    base, h = Config(), hw(table())
    assert hw().precisions() == ("fp32", "bf16") and h.precisions() == ("fp32",)
    free = plan(base, h, rank_memory, world=2, top=50).candidates
    assert {c.cfg.train.precision for c in free} == {"fp32"}
    held = plan(base, h, rank_memory, world=2, top=5, fixed={"train.precision": "bf16"}).candidates
    assert held and {c.cfg.train.precision for c in held} == {"bf16"}
