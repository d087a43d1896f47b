"""Lower bounds on the step time `plan/step.py predict` gives a layout, so that the search can skip what
cannot enter its top list without changing that list (branch and bound).

Two bounds, each no greater than the prediction (tests/test_plan_bound.py checks both against predict):

* `knob_bound`, from the knobs alone (no partition, no schedule): the pipeline ranks' compute over pp (the
  busiest rank does at least the average), or over the node's cores where ranks share them, plus the
  optimizer step of the average rank and the step's closing reductions. The search sorts every layout by
  it and stops at the first that exceeds the k-th best prediction: all later ones exceed it too.
* the step bound, `pipeline_bound` + `after_bound`, from the schedule's compute lists (`ComputeShape`) and
  the layout's stage costs: each rank must wait for its first forward's microbatch to come down the stages
  before it, then run all of its F/B/W one after another, then (when it ends on a backward) wait for that
  microbatch's backward to run down to stage 0 — the simulator's critical path through the first and last
  microbatch, which for 1F1B-like schedules is the whole step. With data parallelism, the rank's last
  stage's gradient all-reduce starts after its last backward. Messages add their latency and transfer
  where a hop crosses ranks. The search computes it only for layouts that got past `knob_bound` and fit in
  memory, and skips the simulation where it exceeds the k-th best.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from hybridpar.config import Config
from hybridpar.pipeline.schedules import Action, Op, stage_count
from hybridpar.pipeline.simulate import Costs
from hybridpar.plan.cost import CostModel, LayerCosts, Placement
from hybridpar.plan.gpu_model import overlapped
from hybridpar.plan.step import Setup, closing_s, grad_sum_s, optimizer_s, reduced_bytes, setup

COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)


@dataclass(frozen=True)
class ComputeShape:
    """Per pipeline rank of a schedule's compute lists: the first and last action and how many of each
    (op, stage) it runs."""

    first: tuple[Action | None, ...]
    last: tuple[Action | None, ...]
    counts: tuple[dict[tuple[Op, int], int], ...]


def compute_shape(compute: list[list[Action]]) -> ComputeShape:
    return ComputeShape(
        tuple(acts[0] if acts else None for acts in compute),
        tuple(acts[-1] if acts else None for acts in compute),
        tuple(dict(Counter((a.op, a.stage) for a in acts)) for acts in compute),
    )


def knob_bound(
    model: CostModel,
    pl: Placement,
    layer: LayerCosts,
    ends: float,
    k: dict,
    share_capacity: float | None,
    copies: tuple[bool, ...] = (False,),
) -> float:
    """Bound from the knobs `k` (tp, pp, dp, m, zero, ...): `layer` is one decoder layer's costs per
    microbatch, `ends` the embedding's and head's work per microbatch, `share_capacity` the summed capacity
    of the nodes' cores (None: devices of their own), `copies` the weights' precisions a layout of these knobs
    may take (working copies or not: the optimizer step of the cheaper is counted)."""
    L = model.m.n_layers
    per_layer = layer.f.total + layer.b.total + layer.w.total
    speed = max(pl.pp_speed)  # a stage runs at its rank's speed: the fastest bounds them all
    work = k["m"] * (per_layer * L + ends) / speed / k["pp"]
    if share_capacity is not None:  # processor sharing: a node computes at most `capacity` ranks' worth
        compute = layer.f.compute + layer.b.compute + layer.w.compute
        work = max(work, k["m"] * compute * L / speed / share_capacity)
    params = model.stage_params([range(0, L)])[0] / (k["tp"] * k["pp"])
    world = k["tp"] * k["pp"] * k["dp"] * k.get("cp", 1)
    # Affine in params (max >= at mean); an overlapped parameter gather counted as wholly hidden.
    opt = min(
        optimizer_s(model, k["pp"], k["dp"], k["zero"], pl.dp, params, world, hidden=(math.inf, 0.0), copies=c)
        for c in copies
    )
    return work + opt + closing_s(model.hw, k["tp"], k["pp"], k["dp"], k["zero"], pl.world)


def after_bound(model: CostModel, cfg: Config, su: Setup, copies: tuple[bool, ...] = ()) -> float:
    """The optimizer step and the small all-reduces after the pipeline, the cheaper of the weights' precisions
    `copies` (none given: the layout's own), every overlapped parameter gather counted as hidden."""
    return min(sum(su.after_pipeline(model, cfg, copies=c)) for c in copies or (None,))


def durations(c: Costs, n: int) -> dict[Op, list[float]]:
    """Each compute op's seconds at each of the `n` stages as the simulator counts them: dispatch, collective
    waits and compute (`Costs.per_stage`'s figures, without its checks: `setup` builds them of its costs)."""
    out = {}
    for op, cost, comm in (
        (Op.FORWARD, c.forward_s, c.forward_comm_s),
        (Op.BACKWARD, c.backward_s, c.backward_comm_s),
        (Op.WEIGHT, c.weight_s, c.weight_comm_s),
    ):
        cost = [float(cost)] * n if isinstance(cost, (int, float)) else cost
        comm = [float(comm)] * n if isinstance(comm, (int, float)) else comm
        out[op] = [c.compute_overhead_s + x + y for x, y in zip(comm, cost)]
    return out


def pipeline_bound(model: CostModel, cfg: Config, shape: ComputeShape) -> tuple[float, Setup]:
    """The step bound less the optimizer step and the small all-reduces after the pipeline, and the layout's
    setup: the part ZeRO does not change (a search shares it between a layout with ZeRO-1 and without)."""
    p = cfg.parallel
    su = setup(model, cfg)
    c, n, ranks = su.sim_costs, stage_count(p), su.ranks
    dur = durations(c, n)
    hop = c.send_overhead_s + c.latency_s + c.transfer_s()
    down = [0.0] * n  # earliest start of stage s's first forward of a microbatch
    for s in range(1, n):
        down[s] = down[s - 1] + dur[Op.FORWARD][s - 1] + (hop if ranks[s - 1] != ranks[s] else 0.0)
    up = [0.0] * n  # from the end of stage s's backward to the end of stage 0's, for one microbatch
    for s in range(1, n):
        up[s] = up[s - 1] + dur[Op.BACKWARD][s - 1] + (hop if ranks[s - 1] != ranks[s] else 0.0)
    end, reduces = 0.0, {}  # the reductions per distinct stage size: the ranks' last stages repeat a few
    for first, last, counts in zip(shape.first, shape.last, shape.counts):
        if first is None or last is None:
            continue
        busy = sum(dur[op][s] * count for (op, s), count in counts.items())
        done = (down[first.stage] if first.op is Op.FORWARD else 0.0) + busy  # its last action ends no sooner
        end = max(end, done + (up[last.stage] if last.op is Op.BACKWARD else 0.0))
        if p.dp * p.cp > 1 and last.op is not Op.FORWARD:
            params = su.stage_params[last.stage] / p.tp
            # The shorter of the reductions with and without ZeRO (the bound is shared by both); from the last
            # action's start where the GPU software reduces buckets during it.
            early = dur[last.op][last.stage] if overlapped(model.hw.gpu_calibration, "grad_reduce") else 0.0
            if params not in reduces:
                gb = reduced_bytes(model.hw, cfg.train)
                reduces[params] = min(grad_sum_s(model.hw, gb * params, p, su.pl, z) for z in (0, 1))
            end = max(end, done - early + reduces[params])
    return end, su
