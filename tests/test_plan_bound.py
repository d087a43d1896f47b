"""The search's lower bounds (plan/bound.py) and its branch and bound: pure, no processes.

Every bound is checked against the prediction it bounds for every legal layout of small cases (GPU-like
devices, CPU nodes whose ranks share cores, devices of unequal speed), and the pruned search must return the
very list the unpruned one does."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hybridpar.config import Config
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.plan.bound import after_bound
from hybridpar.plan.hardware import parse_hardware
from hybridpar.plan.knobs import all_knobs, config_of
from hybridpar.plan.search import GIB, Planner, plan
from hybridpar.plan.step import optimizer_s, param_gathers, predict, setup
from tests.test_plan_search import Est, params_memory


def hw(nodes: int = 2, per_node: int = 4, **extra):
    return parse_hardware(
        {
            "name": "t",
            "source": "test",
            "nodes": nodes,
            "devices_per_node": per_node,
            "device_memory_gib": 16.0,
            "peak_tflops": {"fp32": 1.0, "bf16": 4.0},
            "intra_node": {"bandwidth_gbs": 100.0, "latency_us": 2.0},
            "inter_node": {"bandwidth_gbs": 5.0, "latency_us": 20.0},
            "memory_bandwidth_gbs": 200.0,
        }
        | extra
    )


HARDWARE = {
    "gpu": hw(),
    "cpu": hw(nodes=1, per_node=8, cores_per_node=2, op_overhead_us=20.0),
    "uneven": hw(speed=[1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.7]),
}
# A GPU whose software overlaps its collectives (plan/gpu_model.py): the bounds must stay below the prediction.
CALIBRATION = {
    "matmul_fraction": 0.8,
    "memory_fraction": 0.85,
    "attention_fraction": 0.4,
    "intra_bus_fraction": 0.8,
    "inter_bus_fraction": 0.9,
    "attention_kernel": "flash",
    "overlap": ["tp_comm", "grad_reduce", "param_gather"],
    "source": "test",
    "date": "2026",
}
OVERLAPPED = hw(gpu_calibration=CALIBRATION)
# ... whose software also sums gradients in the compute precision: bf16 reductions move 2 bytes a parameter.
HALF_SUMS = hw(gpu_calibration=CALIBRATION | {"grad_accumulation": "separate-half"})


ONE = dict(tp=1, pp=1, dp=1, schedule="1f1b", v=1, m=1, zero=0, recompute="none", precision="fp32", partition="params")


def model(n_layers: int = 4, global_batch: int = 8) -> Config:
    cfg = Config()
    cfg.model.n_layers, cfg.train.global_batch = n_layers, global_batch
    return cfg


def layouts(base: Config, h, world: int) -> list[Config]:
    out = []
    for k in all_knobs(base, h, world, h.precisions()):
        cfg = config_of(base, k)
        try:
            validate_config(cfg, world)
        except ValueError:
            continue
        out.append((k, cfg))
    return out


@pytest.mark.parametrize("name", sorted(HARDWARE) + ["overlapped"])
@pytest.mark.parametrize("world", [8])
def test_bounds_never_exceed_the_prediction(name: str, world: int) -> None:
    h, base = HARDWARE.get(name, OVERLAPPED), model()
    planner = Planner(base, h, lambda cfg: [Est(0)] * cfg.parallel.pp)
    checked = 0
    for k, cfg in layouts(base, h, world)[::3]:  # every third: the grid stays quick
        step = predict(planner.model, cfg, planner.actions).step_s
        assert planner.bound(k) <= step * (1 + 1e-9), (name, k)
        end, su = planner.pipeline_bound(cfg)  # the layout's own step bound (_Search.own_beaten)
        assert end + after_bound(planner.model, cfg, su) <= step * (1 + 1e-9), (name, k)
        checked += 1
    assert checked > 20


def test_step_bound_is_the_step_where_the_critical_path_is() -> None:
    """1F1B on equal stages, no messages' cost, no data parallelism: the first and last microbatch's path
    through the stages is the whole pipeline, so the bound meets the prediction."""
    h = hw(nodes=1, intra_node={"bandwidth_gbs": 1e9, "latency_us": 0.0})
    base = model(n_layers=4)
    cfg = config_of(
        base,
        dict(
            tp=1, pp=4, dp=1, schedule="1f1b", v=1, m=8, zero=0, recompute="none", precision="fp32", partition="params"
        ),
    )
    cfg.model.vocab_size = 8  # the first and last stage's extras small
    validate_config(cfg, 4)
    planner = Planner(cfg, h, lambda c: [Est(0)] * 4)
    step = predict(planner.model, cfg, planner.actions)
    bound = planner.step_bound(cfg)
    assert bound <= step.step_s * (1 + 1e-9)
    assert bound == pytest.approx(step.step_s, rel=0.02)


@pytest.mark.parametrize("name", sorted(HARDWARE))
@pytest.mark.parametrize("world,top", [(8, 4)])
def test_pruning_keeps_the_top_list(name: str, world: int, top: int) -> None:
    h, base = HARDWARE[name], model(n_layers=4, global_batch=16)
    memory = params_memory()  # a third of the whole model's state fits a device: tp x pp >= 3 (the memory path)
    h = dataclasses.replace(h, device_memory_gib=memory(config_of(base, ONE))[0].total / GIB / 3)
    pruned = plan(base, h, memory, world=world, top=top)
    full = plan(base, h, memory, world=world, top=top, prune=False)
    assert [(c.label, c.prediction.step_s) for c in pruned.candidates] == [
        (c.label, c.prediction.step_s) for c in full.candidates
    ]
    assert pruned.simulated < full.simulated


def test_context_parallel_bounds_and_pruning() -> None:
    """Layouts with cp (a sequence long enough for the search to try it): every bound below its
    prediction, and the pruned search's list the unpruned one's."""
    h, base = HARDWARE["gpu"], model(n_layers=2, global_batch=4)
    base.train.seq_len = 512
    cps = [(k, cfg) for k, cfg in layouts(base, h, 4) if k["cp"] > 1]
    assert len(cps) > 10
    for hard in (h, OVERLAPPED):  # the ring against the flash kernel's own time on a calibrated GPU too
        planner = Planner(base, hard, lambda cfg: [Est(0)] * cfg.parallel.pp)
        for k, cfg in cps[::4]:
            step = predict(planner.model, cfg, planner.actions).step_s
            assert planner.bound(k) <= step * (1 + 1e-9) and planner.step_bound(cfg) <= step * (1 + 1e-9), k
    fixed = {"parallel.cp": 2, "train.precision": "fp32"}
    pruned, full = (plan(base, h, params_memory(), world=4, top=4, fixed=fixed, prune=p) for p in (True, False))
    assert [(c.label, c.prediction.step_s) for c in pruned.candidates] == [
        (c.label, c.prediction.step_s) for c in full.candidates
    ]


def copies_memory(cfg: Config) -> list[Est]:
    """Fake memory of a rank's weights, gradients and AdamW state: 16 bytes a parameter under autocast, under
    working copies 2 + 4 + 12/dp (bf16 weights, fp32 gradients, masters and moments sliced over dp)."""
    m, p = cfg.model, cfg.parallel
    n = m.n_layers * (4 * m.dim * m.dim + 3 * m.dim * m.ffn_dim) + 2 * m.vocab_size * m.dim
    per = 6 + 12 / p.dp if cfg.train.working_copies else 16
    return [Est(int(n * per / (p.tp * p.pp)))] * p.pp


def test_working_copies_stay_bounded_and_pruning_keeps_the_top_list() -> None:
    """Where autocast does not fit the search tries working copies, which the cost model prices apart (their
    sliced masters at ZeRO 0, their bf16 gathers: cheaper than autocast's at ZeRO-1). Every bound of a bf16
    layout's knobs stays below the copies layout's prediction (also where gradients are reduced in bf16), and the
    pruned search returns the unpruned list."""
    base = model(n_layers=4, global_batch=8)
    # 3.2 bytes a parameter per device: autocast fits at tp x pp = 8 only (dp 1), copies from tp x pp = 4 (dp 2).
    limit = copies_memory(config_of(base, ONE))[0].total / GIB / 5
    knobs = [k for k in all_knobs(base, HARDWARE["gpu"], 8, ("bf16",)) if k["dp"] > 1][::5]
    layouts = [(k, config_of(base, k), config_of(base, {**k, "weights": "copies"})) for k in knobs]
    layouts = [x for x in layouts if not _invalid(x[2], 8)]
    assert len(layouts) > 100
    for h in (HARDWARE["gpu"], HALF_SUMS):
        h = dataclasses.replace(h, device_memory_gib=limit)
        planner = Planner(base, h, copies_memory)
        for k, cfg, copies in layouts:
            step = predict(planner.model, copies, planner.actions).step_s
            assert planner.bound(k) <= step * (1 + 1e-9) and planner.step_bound(cfg) <= step * (1 + 1e-9), k
            end, su = planner.pipeline_bound(copies)  # the copies layout's own bound (_Search.own_beaten)
            assert end + after_bound(planner.model, copies, su) <= step * (1 + 1e-9), k
    fixed = {"train.precision": "bf16"}
    pruned, full = (plan(base, h, copies_memory, world=8, top=4, fixed=fixed, prune=p) for p in (True, False))
    listed = [(c.label, c.prediction.step_s) for c in pruned.candidates]
    assert listed == [(c.label, c.prediction.step_s) for c in full.candidates]
    assert any("copies" in label for label, _ in listed) and pruned.simulated < full.simulated


def _invalid(cfg: Config, world: int) -> bool:
    try:
        validate_config(cfg, world)
    except ValueError:
        return True
    return False


def test_bound_shortcuts_are_the_long_ways() -> None:
    """The step bound's optimizer term, taken at the rank holding the most parameters (the step does not shrink
    with them), is the per-rank maximum it replaced; and a cached layer's costs are the ones computed afresh,
    whatever training settings besides the precision and sequence length the asking layout has."""
    h, base = OVERLAPPED, model(n_layers=6)
    planner = Planner(base, h, lambda cfg: [Est(0)] * cfg.parallel.pp)
    checked = 0
    for k, cfg in layouts(base, h, 8)[::5]:
        p, su = cfg.parallel, setup(planner.model, cfg)
        held = [sum(n for s, n in enumerate(su.stage_params) if su.ranks[s] == r) / p.tp for r in range(p.pp)]
        gathers = param_gathers(p.zero, p.zero3_regather, cfg.train.microbatches)
        each = [
            optimizer_s(planner.model, p.pp, p.dp, p.zero, su.pl.dp, n, p.world_size, gathers, (math.inf, 0.0),
                        cfg.train.precision, cfg.train.working_copies)
            for n in held
        ]  # fmt: skip
        assert su.after_pipeline(planner.model, cfg)[0] == max(each), k
        t = dataclasses.replace(cfg.train, microbatches=cfg.train.microbatches + 1, recompute="full")
        args = (p.tp, 64, su.pl.tp, k["recompute"], False, p.sequence_parallel, None)
        assert planner.model.layer(t, *args) == planner.model._layer(cfg.train, *args), k
        checked += len(set(held)) > 1
    assert checked > 3  # layouts whose ranks hold different parameter counts among them
