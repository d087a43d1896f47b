"""The cost model (plan/cost.py) and the simulator's shared cores: pure, no processes."""

from __future__ import annotations

import pytest

from hybridpar.config import Config
from hybridpar.pipeline.schedules import build_schedule
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.pipeline.simulate import CoreSharing, Costs, simulate
from hybridpar.plan.cost import ADAMW_BYTES, COPY_BYTES, CostModel, Shape, all_gather_s, all_reduce_s, placement
from hybridpar.plan.hardware import parse_hardware
from hybridpar.plan.step import predict, stage_costs


def hw(**extra):
    return parse_hardware(
        {
            "name": "t",
            "source": "test",
            "nodes": 2,
            "devices_per_node": 4,
            "device_memory_gib": 16.0,
            "peak_tflops": {"fp32": 1.0, "bf16": 4.0},
            "intra_node": {"bandwidth_gbs": 100.0, "latency_us": 1.0},
            "inter_node": {"bandwidth_gbs": 1.0, "latency_us": 50.0},
        }
        | extra
    )


def cfg_of(tp=1, pp=1, dp=1, schedule="1f1b", m=4, **train) -> Config:
    cfg = Config()
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.schedule = tp, pp, dp, schedule
    cfg.train.microbatches = m
    for k, v in train.items():
        setattr(cfg.train, k, v)
    validate_config(cfg, tp * pp * dp)
    return cfg


def test_ring_collectives() -> None:
    h = hw()
    assert all_reduce_s(1e6, 1, h.intra_node, h) == 0.0
    # 2 (n-1) steps of latency + 1/n of the bytes each
    assert all_reduce_s(4e6, 4, h.intra_node, h) == pytest.approx(6 * (1e-6 + 1e6 / 100e9))
    assert all_gather_s(4e6, 4, h.inter_node, h) == pytest.approx(3 * (50e-6 + 1e6 / 1e9))
    slow = hw(collective_latency_us=100.0)  # a collective's own step latency replaces the link's
    assert all_reduce_s(0, 2, slow.intra_node, slow) == pytest.approx(2 * 100e-6)


def test_placement_keeps_tp_inside_a_node_and_names_crossings() -> None:
    h = hw()
    pl = placement(Shape(4, 2, 1), h)  # 8 ranks on 2 nodes of 4: tp fills a node, pp crosses
    assert pl.tp is h.intra_node and pl.pp is h.inter_node and pl.pp_nodes == (0, 1)
    pl = placement(Shape(2, 2, 2), h)  # a replica per node: dp crosses
    assert pl.tp is h.intra_node and pl.pp is h.intra_node and pl.dp is h.inter_node
    pl = placement(Shape(1, 2, 2), h)  # one node
    assert pl.dp is h.intra_node and pl.world is h.intra_node
    speeds = hw(speed=[1.0] * 7 + [0.25])
    assert placement(Shape(1, 2, 4), speeds).pp_speed == (1.0, 0.25)  # rank 7 is pp rank 1 of replica 3


def test_one_device_step_is_the_sum_of_its_actions() -> None:
    cfg = cfg_of(m=4)
    model = CostModel(cfg.model, hw(memory_bandwidth_gbs=10.0))
    pred = predict(model, cfg)
    c = stage_costs(model, cfg, placement(cfg.parallel, model.hw), [range(0, 4)], 4 * cfg.train.seq_len)[0]
    assert pred.pipeline_s == pytest.approx(4 * (c.f.total + c.b.total + c.w.total))
    assert pred.bubble == pytest.approx(0.0, abs=1e-12) and pred.dp_reduce_s == 0.0
    assert pred.step_s > pred.pipeline_s  # the optimizer step and the step's small all-reduces


def test_matmuls_follow_the_precision_peak_and_tp() -> None:
    model = CostModel(Config().model, hw())
    h = model.hw
    fp32 = model.layer(cfg_of().train, 1, 512, h.intra_node, "none")
    bf16 = model.layer(cfg_of(precision="bf16").train, 1, 512, h.intra_node, "none")
    tp2 = model.layer(cfg_of().train, 2, 512, h.intra_node, "none")
    assert bf16.f.matmul_s == pytest.approx(fp32.f.matmul_s / 4)
    assert tp2.f.matmul_s == pytest.approx(fp32.f.matmul_s / 2) and tp2.f.comm_s > 0 == fp32.f.comm_s
    assert fp32.b.matmul_s + fp32.w.matmul_s == pytest.approx(2 * fp32.f.matmul_s)  # backward = 2 forwards


def test_recomputation_adds_to_the_backward() -> None:
    model = CostModel(Config().model, hw(memory_bandwidth_gbs=10.0, op_overhead_us=5.0))
    t, link = cfg_of().train, model.hw.intra_node
    none, full, sel = (model.layer(t, 1, 512, link, r) for r in ("none", "full", "selective"))
    assert full.b.total == pytest.approx(none.b.total + none.f.total)
    assert none.b.total < sel.b.total < full.b.total and sel.b.matmul_s == none.b.matmul_s


def test_slow_inter_node_link_makes_dp_across_nodes_expensive() -> None:
    fast = hw(inter_node={"bandwidth_gbs": 100.0, "latency_us": 1.0})
    slow = hw()
    cfg = cfg_of(tp=2, pp=2, dp=2, m=4)
    a, b = (predict(CostModel(cfg.model, h), cfg) for h in (fast, slow))
    assert b.dp_reduce_s > a.dp_reduce_s and b.step_s > a.step_s


def test_shared_cores_serialise_work_but_not_waits() -> None:
    pp, m = 4, 8
    acts = build_schedule("1f1b", pp, 1, m)
    alone = simulate(acts, pp, pp, Costs(1.0, 2.0))
    shared = lambda cap: simulate(acts, pp, pp, Costs(1.0, 2.0), sharing=CoreSharing((0,) * pp, (cap,)))  # noqa: E731
    assert shared(float(pp)).step_time_s == alone.step_time_s  # a core each: independent devices
    assert shared(1.0).step_time_s == pytest.approx(3 * m * pp)  # one core: all the work in a row
    assert alone.step_time_s < shared(2.0).step_time_s < shared(1.0).step_time_s
    # A collective wait inside an action takes time but no core: with one core, waits still overlap.
    waits = Costs(1.0, 2.0, forward_comm_s=1.0, backward_comm_s=1.0)
    one = simulate(acts, pp, pp, waits, sharing=CoreSharing((0,) * pp, (1.0,))).step_time_s
    assert 3 * m * pp < one < 3 * m * pp + 2 * m * pp
    with pytest.raises(ValueError, match="node_of"):
        CoreSharing((0, 1), (1.0,))


def test_context_parallel_ring_costs_what_its_hops_outlast_the_attention() -> None:
    """Ring attention's hops (plan/cost.py `ring_s`) at cp4, one 4096-token sample, fp32 at 1 TFLOP/s: a
    rank's 1024 tokens each attend over 4096 (4 x 4096 x 128 FLOPs each: 2.147 ms), a block a quarter of
    that (0.537 ms); its keys and values are 2 x 1024 x 128 fp32 (1 MiB)."""
    h = hw()
    model = CostModel(Config().model, h)
    t = cfg_of(seq_len=4096, global_batch=1, m=1).train
    alone = model.layer(t, 1, 1024, h.intra_node, "none")
    fast = model.layer(t, 1, 1024, h.intra_node, "none", ring=(4, h.intra_node))
    slow = model.layer(t, 1, 1024, h.intra_node, "none", ring=(4, h.inter_node))
    mib, block = 2**20, 1024 * 4 * 4096 * 128 / 1e12 / 4
    # 100 GB/s: every hop hides behind its block; only the accumulator's last hop home shows.
    assert fast.f.comm_s == alone.f.comm_s == 0.0
    assert fast.b.comm_s == pytest.approx(1e-6 + mib / 100e9)
    # 1 GB/s: each of the 3 forward hops outlasts its block; the backward's carry the accumulator too
    # (twice the bytes) against twice the block, then the last hop.
    hop = 50e-6 + mib / 1e9
    assert slow.f.comm_s == pytest.approx(3 * (hop - block))
    assert slow.b.comm_s == pytest.approx(3 * (50e-6 + 2 * mib / 1e9 - 2 * block) + hop)
    assert slow.f.matmul_s == alone.f.matmul_s and slow.w == alone.w  # the compute is the rank's own
    # Full recomputation runs the forward's ring again in the backward.
    assert model.layer(t, 1, 1024, h.intra_node, "full", ring=(4, h.inter_node)).b.comm_s == pytest.approx(
        slow.b.comm_s + slow.f.comm_s
    )


def test_context_parallel_layout_splits_tokens_and_sums_gradients_over_dp_and_cp() -> None:
    h = hw()
    one, cp2 = cfg_of(dp=2, seq_len=1024, m=2), cfg_of(dp=2, seq_len=1024, m=2)
    cp2.parallel.cp = 2
    validate_config(cp2, 4)
    pl = placement(cp2.parallel, h)
    assert pl.cp is h.intra_node and pl.dp_cp is h.intra_node and pl.pp_nodes == (0,)
    assert placement(Shape(2, 1, 2, 2), h).dp_cp is h.inter_node  # 8 ranks: the replicas on two nodes
    assert placement(Shape(4, 1, 1, 2), h).cp is h.inter_node  # a cp x tp group larger than a node
    model = CostModel(one.model, h)
    a, b = predict(model, one), predict(model, cp2)
    assert b.message_bytes * 2 == a.message_bytes  # a rank's half of each sample's tokens
    assert b.compute_s < 0.6 * a.compute_s  # half the tokens (each attending over the whole sequence)
    assert b.dp_reduce_s > a.dp_reduce_s  # the gradient all-reduce spans dp x cp = 4 ranks, not 2


def test_working_copies_step_their_masters_sliced_and_gather_bf16_weights() -> None:
    """bf16 working copies (dataparallel/copies.py): at every ZeRO level AdamW steps the fp32 masters of the
    rank's 1/dp slice and rounds them into the bf16 weights (ADAMW_BYTES + COPY_BYTES per sliced parameter),
    then all-gathers the bf16 slices (2 bytes a parameter, where autocast's ZeRO gather moves 4); the
    gradients are reduced as under autocast. Checked term by term from the bytes on a 4-replica layout."""
    h = hw(memory_bandwidth_gbs=100.0)
    bw, link = 100e9, h.intra_node
    preds = {}
    for zero in (0, 1, 3):
        for weights in ("autocast", "copies"):
            cfg = cfg_of(dp=4, precision="bf16", bf16_weights=weights)
            cfg.parallel.zero = zero
            preds[zero, weights] = predict(CostModel(cfg.model, h), cfg)
    model = CostModel(cfg.model, h)
    params = model.stage_params([range(cfg.model.n_layers)])[0]
    mine = params / 4
    gather = lambda width: all_gather_s(width * params, 4, link, h)  # noqa: E731
    step = lambda zero, w: preds[zero, w].optimizer_s  # noqa: E731
    # ZeRO 0: autocast steps every parameter and gathers nothing; copies step a quarter and gather 2 bytes each.
    assert step(0, "copies") - step(0, "autocast") == pytest.approx(
        ((ADAMW_BYTES + COPY_BYTES) * mine - ADAMW_BYTES * params) / bw + gather(2)
    )
    # ZeRO-1: the same slice, the rounding pass more and the gather at half the bytes.
    assert step(1, "copies") - step(1, "autocast") == pytest.approx(COPY_BYTES * mine / bw + gather(2) - gather(4))
    # ZeRO-3: every one of its gathers (forward and backward of each of 4 microbatches) reads bf16 slices.
    assert step(3, "copies") - step(3, "autocast") == pytest.approx(
        COPY_BYTES * mine / bw + 8 * (gather(2) - gather(4))
    )
    # The gradients' reduction and the pipeline are those of autocast.
    for zero in (0, 1, 3):
        a, c = preds[zero, "autocast"], preds[zero, "copies"]
        assert (a.dp_reduce_s, a.pipeline_s) == (c.dp_reduce_s, c.pipeline_s)
