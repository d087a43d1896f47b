"""A layout's predicted step: each stage's costs (plan/cost.py) run on the simulator (pipeline/simulate.py, on
`build_schedule`'s output, with the ranks sharing cores where the hardware says they do), then each rank's
data-parallel gradient reductions, then the optimizer step (memory-bound: AdamW's bytes per parameter over the
memory bandwidth, or the calibration's measured time) and the step's closing all-reduces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

from hybridpar.config import Config, ParallelConfig, TrainConfig
from hybridpar.pipeline.schedules import Action, Op, build_schedule, schedule_spec, stage_count, stages_per_rank
from hybridpar.pipeline.sim_program import Program
from hybridpar.pipeline.simulate import CoreSharing, Costs, SimResult, simulate
from hybridpar.plan.collectives import all_gather_s, all_reduce_s, p2p_s, reduce_scatter_s
from hybridpar.plan.cost import (
    ADAMW_BYTES,
    CLIP_BYTES,
    COPY_BYTES,
    F32_BYTES,
    OPS_PER_PARAM_TENSOR,
    CostModel,
    LayerCosts,
    Placement,
    Shape,
    Work,
)
from hybridpar.plan.gpu_model import blocks_p2p, grad_bytes, overlapped
from hybridpar.plan.hardware import Hardware, Link


@dataclass(frozen=True)
class Prediction:
    step_s: float
    pipeline_s: float  # the simulated action lists
    dp_reduce_s: float  # what the gradient all-reduces add after the pipeline
    optimizer_s: float
    bubble: float  # idle fraction of the pipeline part, from the simulation
    compute_s: float  # the busiest rank's compute
    tp_comm_s: float  # of which tensor-parallel collectives and ring attention's exposed hops
    message_bytes: int
    parts: tuple[tuple[int, int], ...]  # (first layer, end) of each stage

    def breakdown(self) -> dict[str, float]:
        return {
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "tp_comm_s": self.tp_comm_s,
            "bubble_s": self.pipeline_s - self.compute_s,
            "dp_reduce_s": self.dp_reduce_s,
            "optimizer_s": self.optimizer_s,
        }


def stage_costs(model: CostModel, cfg: Config, pl: Placement, parts: list[range], tokens: int) -> list[LayerCosts]:
    """F, B, W of every stage for a microbatch of `tokens` tokens, at its pipeline rank's speed."""
    p, t = cfg.parallel, cfg.train
    modes = t.recompute_modes(stage_count(p))
    ranks = schedule_spec(p.schedule).stage_ranks(p.pp, stages_per_rank(p))
    split = schedule_spec(p.schedule).splits_backward
    ring = (p.cp, pl.cp) if pl.cp is not None else None
    # The stages repeat a few kinds (mode, layers, ends, speed), and the layouts of a search a few hundred of
    # these inputs (of the training settings they read the precision and the sequence length: CostModel.layer,
    # end_costs, calibrated): each kind is costed once per search.
    inputs = (t.precision, t.seq_len, p.tp, tokens, pl.tp, split, p.sequence_parallel, ring)
    alike = model._stage_kinds.setdefault(inputs, {})
    out, last = [], len(parts) - 1
    for s, r in enumerate(parts):
        kind = (modes[s], len(r), s == 0, s == last, pl.pp_speed[ranks[s]])
        if kind not in alike:
            alike[kind] = _stage_kind(model, cfg, pl, tokens, kind)
        out.append(alike[kind])
    return out


def _stage_kind(model: CostModel, cfg: Config, pl: Placement, tokens: int, kind: tuple) -> LayerCosts:
    """`stage_costs` of one kind of stage: (recomputation, layers, holds the embedding, holds the head, speed)."""
    p = cfg.parallel
    mode, layers, first, final, speed = kind
    split = schedule_spec(p.schedule).splits_backward
    ring = (p.cp, pl.cp) if pl.cp is not None else None
    cal = model.calibrated(cfg.train)
    action = Work(cal.action_overhead_s / cal.core_share if cal is not None else 0.0)  # the runtime's own, per action
    lay = model.layer(cfg.train, p.tp, tokens, pl.tp, mode, split, p.sequence_parallel, ring)
    f, b, w = lay.f.times(layers) + action, lay.b.times(layers) + action, lay.w.times(layers)
    w = w + action if split else w
    embed, head = model.end_costs(cfg.train, p.tp, tokens, pl.tp)
    for extra in ([embed] if first else []) + ([head] if final else []):
        f, b, w = f + extra.f, b + extra.b, w + extra.w
    return LayerCosts(f.times(1 / speed), b.times(1 / speed), w.times(1 / speed))


def sharing(p: Shape | ParallelConfig, hw: Hardware, pl: Placement) -> CoreSharing | None:
    """Ranks sharing cores: each simulated pipeline rank stands for its tp (x cp) ranks and the replicas on
    its node, all computing at once, so a node's cores per pipeline rank are cores / (tp x replicas)."""
    if hw.cores_per_node is None:
        return None
    inner = p.tp * p.cp  # the ranks each simulated pipeline rank stands for in one replica
    replicas_per_node = max(1, min(p.dp, hw.devices_per_node // (inner * p.pp)))
    nodes = max(pl.pp_nodes) + 1
    return CoreSharing(pl.pp_nodes, (hw.cores_per_node / (inner * replicas_per_node),) * nodes)


class Setup(NamedTuple):
    """What a layout's simulation runs on: its placement, stages, per-stage costs and simulator costs."""

    pl: Placement
    parts: list[range]
    costs: list[LayerCosts]
    sim_costs: Costs
    share: CoreSharing | None
    ranks: tuple[int, ...]
    stage_params: list[int]
    msg: int

    def after_pipeline(
        self, model: CostModel, cfg: Config, hidden: list[float] | None = None, copies: bool | None = None
    ) -> tuple[float, float]:
        """(The optimizer step of the slowest rank, the step's small all-reduces). `hidden`: per pipeline rank,
        what an overlapped parameter gather may hide behind (`optimizer_s`); None: all of it, a lower bound.
        `copies`: the weights' precision (working copies or not) in place of the layout's."""
        p, pl = cfg.parallel, self.pl
        held = [0] * p.pp  # each rank's parameters, summed in stage order as before
        for s in range(stage_count(p)):
            held[self.ranks[s]] += self.stage_params[s]
        rank_params = [n / p.tp for n in held]
        if hidden is None:  # every rank alike but its parameters, in which the step does not shrink: the most
            rank_params = [max(rank_params)]  # holds the slowest's (the same float: rounding keeps order)
        world, c = p.world_size, model.counts
        gathers = param_gathers(p.zero, p.zero3_regather, cfg.train.microbatches)
        first = [(c.layer + (c.embed if r == self.ranks[0] else 0)) / p.tp for r in range(p.pp)]  # needed first
        opt = max(
            optimizer_s(
                model,
                p.pp,
                p.dp,
                p.zero,
                pl.dp,
                n,
                world,
                gathers,
                (math.inf, 0.0) if hidden is None else (hidden[r], first[r]),
                cfg.train.precision,
                cfg.train.working_copies if copies is None else copies,
                cfg.train.fused_adamw,
            )
            for r, n in enumerate(rank_params)
        )
        return opt, closing_s(model.hw, p.tp, p.pp, p.dp, p.zero, pl.world)


def closing_s(hw: Hardware, tp: int, pp: int, dp: int, zero: int, link: Link) -> float:
    """A step's closing reductions: the loss and flags, the step time and peak over every rank, then the
    clip norm's square over each dimension whose ranks hold different parts of the gradient
    (grads.clip_grad_norm: tp, pp, and dp under ZeRO-1). Each is a third of `step_sync_us` where the
    hardware has it (a CPU host's probe times three in place), else a small all-reduce over every rank."""
    calls = 2 + (tp > 1) + (pp > 1) + (dp > 1 and zero >= 1)
    if hw.step_sync_us is not None:
        return hw.step_sync_us * 1e-6 * calls / 3
    return calls * all_reduce_s(8, tp * pp * dp, link, hw)


def handoff(hw: Hardware, p: ParallelConfig, pl: Placement, msg: int) -> tuple[int, float, float]:
    """A pipeline hand-off of `msg` bytes per tp rank: (bytes on the pipeline's link, the receiver's all-gather
    after arrival, what the sender waits). Where the GPU software blocks (gpu_model.P2PS) the sender waits for its
    transfer, and without sequence parallelism each tp rank sends its 1/tp slice, all-gathered by the receiving
    stage's tp ranks; elsewhere the whole message, posted and left to complete."""
    if not blocks_p2p(hw.gpu_calibration) or p.pp == 1:
        return msg, 0.0, 0.0
    sliced = p.tp > 1 and not p.sequence_parallel
    wire = msg // p.tp if sliced else msg
    gather = all_gather_s(msg, p.tp, pl.tp, hw) if sliced else 0.0
    return wire, gather, p2p_s(wire, pl.pp, hw)


def setup(model: CostModel, cfg: Config) -> Setup:
    """The simulator's inputs for the layout `cfg` (equal microbatches: the per-replica batch over
    train.microbatches, rounded up; under context parallelism a rank's 1/cp of their tokens)."""
    p, t = cfg.parallel, cfg.train
    pl = model.placed(p)
    parts = model.parts(cfg, pl)
    tokens = math.ceil(t.global_batch / p.dp / t.microbatches) * t.seq_len // p.cp
    # Layouts that differ in dp and microbatches but not in a rank's tokens share their stages' costs: a search
    # asks for thousands of layouts with a few hundred distinct keys. Of the training settings the costs read
    # the precision, the sequence length (CostModel.layer, ends, calibrated) and the recomputation; of the
    # partition only its stages' layer counts; of the placement the tp, pp and cp links and the ranks' speeds.
    v = stages_per_rank(p)
    key = (p.schedule, p.pp, v, p.tp, p.cp, p.sequence_parallel, pl.tp, pl.pp, pl.cp, pl.pp_speed, tokens)
    key += (t.precision, t.seq_len, t.recompute)
    key += (tuple(map(len, parts)),)
    if key not in model._stages:
        model._stages[key] = _stage_inputs(model, cfg, pl, parts, tokens)
    costs, sim_costs, ranks, stage_params, msg = model._stages[key]
    return Setup(pl, parts, costs, sim_costs, sharing(p, model.hw, pl), ranks, stage_params, msg)


def _stage_inputs(
    model: CostModel, cfg: Config, pl: Placement, parts: list[range], tokens: int
) -> tuple[list[LayerCosts], Costs, tuple[int, ...], list[int], int]:
    """`setup`'s per-stage part: the stages' costs, the simulator's costs, each stage's rank and parameters, and
    the hand-off's bytes per tp rank."""
    hw, p, t = model.hw, cfg.parallel, cfg.train
    costs = stage_costs(model, cfg, pl, parts, tokens)
    spec = schedule_spec(p.schedule)
    split = spec.splits_backward
    msg = tokens * model.m.dim * (2 if t.precision == "bf16" else 4)
    msg //= p.tp if p.sequence_parallel else 1  # sequence parallelism: a tp rank's slice of the sequence
    wire, gather, send = handoff(hw, p, pl, msg)
    st = model.comm_stretch(t)
    busy: dict[int, LayerCosts] = {}  # stage_costs repeats one object per kind of stage
    sim = [busy[id(c)] if id(c) in busy else busy.setdefault(id(c), c.busy(st)) for c in costs]
    sim_costs = Costs(
        forward_s=tuple(c.f.compute for c in sim),
        backward_s=tuple(c.b.compute if split else c.b.compute + c.w.compute for c in sim),
        weight_s=tuple(c.w.compute for c in sim) if split else 0.0,
        forward_comm_s=tuple(c.f.comm_s for c in sim),
        backward_comm_s=tuple(c.b.comm_s if split else c.b.comm_s + c.w.comm_s for c in sim),
        weight_comm_s=tuple(c.w.comm_s for c in sim) if split else 0.0,
        latency_s=pl.pp.latency_us * 1e-6 + gather,
        bandwidth_Bps=hw.link_bps(pl.pp),
        message_bytes=wire,
        send_overhead_s=send,
    )
    ranks = spec.stage_ranks(p.pp, stages_per_rank(p))
    return costs, sim_costs, ranks, model.stage_params(parts), msg


def predict(
    model: CostModel,
    cfg: Config,
    actions: Callable[[str, int, int, int], list[list[Action]] | Program] | None = None,
    sims: dict[tuple, SimResult] | None = None,
) -> Prediction:
    """Predicted step of the layout `cfg` describes (`setup`); `actions(schedule, pp, v, m)` may be a
    cache of `build_schedule`, `sims` a cache of simulations (layouts that differ only in what follows
    the pipeline share one)."""
    hw, p, t = model.hw, cfg.parallel, cfg.train
    su = setup(model, cfg)
    m = t.microbatches
    build = actions or (lambda name, pp, v, mb: build_schedule(name, pp, v, mb, p.recv_lookahead))
    key = (p.schedule, p.pp, stages_per_rank(p), m, su.sim_costs, su.share)
    sim = (sims or {}).get(key) or simulate(
        build(p.schedule, p.pp, stages_per_rank(p), m),
        p.pp,
        stage_count(p),
        su.sim_costs,
        ranks=su.ranks,
        sharing=su.share,
    )
    if sims is not None:
        sims[key] = sim
    if key not in model._last:
        model._last[key] = sim_marks(sim)
    work = [
        m * sum(c.f.compute + c.b.compute + c.w.compute for s, c in enumerate(su.costs) if su.ranks[s] == r)
        for r in range(p.pp)
    ]
    # The gradients a stage's backward produces last: its first layer's, and the embedding's on the first stage.
    tail = [model.counts.layer + (model.counts.embed if s == 0 else 0) for s in range(len(su.parts))]
    end, reduce_extra = _dp_reductions(sim, model._last[key], cfg, hw, su.pl, su.stage_params, tail, su.ranks, work)
    marks = model._last[key]
    opt, fixed = su.after_pipeline(model, cfg, [marks.first_forward.get(r, 0.0) for r in range(p.pp)])
    busiest = max(range(p.pp), key=lambda r: sim.busy_s[r])
    tp_comm = m * sum(c.f.comm_s + c.b.comm_s + c.w.comm_s for s, c in enumerate(su.costs) if su.ranks[s] == busiest)
    return Prediction(
        step_s=end + opt + fixed,
        pipeline_s=sim.step_time_s,
        dp_reduce_s=reduce_extra,
        optimizer_s=opt + fixed,
        bubble=sim.bubble_fraction,
        compute_s=sim.busy_s[busiest],
        tp_comm_s=tp_comm,
        message_bytes=su.msg,
        parts=tuple((r.start, r.stop) for r in su.parts),
    )


class SimMarks(NamedTuple):
    """What the step's collectives around the pipeline wait for, from a simulation."""

    last_end: dict[int, float]  # stage -> when its last backward (B or W) action ends
    last_start: dict[int, float]  # stage -> when that action starts
    first_forward: dict[int, float]  # pipeline rank -> when its first forward ends


def sim_marks(sim: SimResult) -> SimMarks:
    end: dict[int, float] = {}
    start: dict[int, float] = {}
    first: dict[int, float] = {}
    for e in sim.events:
        st = e.action.stage
        if e.action.op in (Op.BACKWARD, Op.WEIGHT) and e.end >= end.get(st, 0.0):
            end[st], start[st] = e.end, e.start
        elif e.action.op is Op.FORWARD:
            first[e.rank] = min(first.get(e.rank, math.inf), e.end)
    return SimMarks(end, start, first)


def grad_reduce_s(hw: Hardware, nbytes: float, dp: int, link: Link, zero: int) -> float:
    """A stage's data-parallel gradient reduction: an all-reduce, or under ZeRO-1 on a GPU a reduce-scatter
    (each rank keeps the sum of its own slice, as dataparallel/grads.py and Megatron's distributed
    optimizer do). The CPU path keeps the all-reduce its probe's collective figures were measured on."""
    if zero >= 1 and hw.gpu_calibration is not None:
        return reduce_scatter_s(nbytes, dp, link, hw)
    return all_reduce_s(nbytes, dp, link, hw)


def grad_sum_s(hw: Hardware, nbytes: float, p: Shape | ParallelConfig, pl: Placement, zero: int) -> float:
    """A stage's gradient sum over its data-parallel replicas and, under context parallelism, its cp peers
    (which hold the same parameters and the gradients of other tokens): one all-reduce over the dp x cp
    ranks; under ZeRO-1/2 first the cp sum, then dp's reduction of the slices (dataparallel/grads.py)."""
    if p.cp == 1 or pl.cp is None or pl.dp_cp is None:
        return grad_reduce_s(hw, nbytes, p.dp, pl.dp, zero)
    if zero >= 1 and p.dp > 1:
        return all_reduce_s(nbytes, p.cp, pl.cp, hw) + grad_reduce_s(hw, nbytes, p.dp, pl.dp, zero)
    return all_reduce_s(nbytes, p.dp * p.cp, pl.dp_cp, hw)


def _dp_reductions(
    sim: SimResult,
    marks: SimMarks,
    cfg: Config,
    hw: Hardware,
    pl: Placement,
    stage_params: list[int],
    tail_params: list[int],
    ranks: tuple[int, ...],
    work: list[float],
) -> tuple[float, float]:
    """(when the last rank's gradient reductions end, how much later that is than the pipeline): each
    stage's reduction starts at its last backward action's end (or its start, where the GPU software
    reduces buckets as that action produces them: gpu_model.OVERLAPS, and then ends no sooner than that
    action's end plus the reduction of the gradients it produces last, `tail_params`) and runs after the
    rank's earlier ones. A rank's first one also waits for its replicas, which reach
    it apart after the step's `work` (its compute seconds) where ranks share cores (`Hardware.sync_wait_s`):
    nothing synchronises replicas before it."""
    p = cfg.parallel
    if p.dp * p.cp == 1:
        return sim.step_time_s, 0.0
    early = overlapped(hw.gpu_calibration, "grad_reduce")
    gb = reduced_bytes(hw, cfg.train)
    free = [0.0] * p.pp
    waited: set[int] = set()
    for s in sorted(marks.last_end, key=marks.last_end.get):
        r = ranks[s]
        wait = 0.0 if r in waited else hw.sync_wait_s(p.dp * p.cp, work[r])
        waited.add(r)
        start = marks.last_start[s] if early else marks.last_end[s]
        reduce = grad_sum_s(hw, gb * stage_params[s] / p.tp, p, pl, p.zero)
        last = grad_sum_s(hw, gb * tail_params[s] / p.tp, p, pl, p.zero) if early else 0.0
        free[r] = max(free[r] + wait + reduce, start + wait + reduce, marks.last_end[s] + last)
    end = max([sim.step_time_s] + free)
    return end, end - sim.step_time_s


def reduced_bytes(hw: Hardware, t: TrainConfig) -> int:
    """Bytes a parameter of the gradients the data-parallel reduction moves: fp32 sums (under working copies
    too: each bf16 weight gradient is summed into an fp32 one) unless the GPU software sums them in the
    compute precision (gpu_model.grad_bytes)."""
    return grad_bytes(hw.gpu_calibration, 2 if t.precision == "bf16" else 4)


def param_gathers(zero: int, regather: str, microbatches: int) -> int:
    """All-gathers of a rank's parameters per step: ZeRO-1 and 2 one after the optimizer step; ZeRO-3
    (dataparallel/zero3.py) one per use: per microbatch in its forward and again in its backward, or once
    per step where gathered parameters are kept (regather=step)."""
    if zero < 3:
        return 1
    return 1 if regather == "step" else 2 * microbatches


def optimizer_s(
    model: CostModel,
    pp: int,
    dp: int,
    zero: int,
    link: Link,
    params: float,
    world: int = 1,
    gathers: int = 1,
    hidden: tuple[float, float] = (0.0, 0.0),
    precision: str = "fp32",
    copies: bool = False,
    fused_adamw: str = "auto",
) -> float:
    """AdamW over a rank's `params` parameters (its 1/dp slice under ZeRO-1, then the slices' all-gather
    over `link`), plus clipping's pass over the gradients; the rank holds 1/pp of the layers. Every rank
    of the `world` steps at once: where a node's ranks outnumber its cores they share them. `gathers`:
    how many all-gathers of the parameters the step makes (`param_gathers`; ZeRO-3's, counted here whole,
    as if the prefetch hid none of them: the planner then picks ZeRO-3 only where memory requires it).
    `copies` (bf16 working copies, dataparallel/copies.py): AdamW steps the fp32 masters of the rank's 1/dp
    slice at every ZeRO level (ZeRO 0 too), rounds them into the bf16 weights (COPY_BYTES more per parameter
    of the slice) and all-gathers the bf16 slices (2 bytes a parameter where autocast's fp32 gather moves 4;
    under ZeRO-3 its gathers read bf16 slices too).
    Where the GPU software overlaps the step's one gather (gpu_model.OVERLAPS: the compute-precision weights,
    dispatched at the next step's start), only what exceeds `hidden` = (the rank's time to its first
    forward's end, the parameters that forward needs first), and no less than those parameters' gather,
    is counted."""
    hw = model.hw
    stretch = 1.0 if hw.cores_per_node is None else max(1.0, min(world, hw.devices_per_node) / hw.cores_per_node)
    sliced = zero >= 1 or copies
    mine = params / dp if sliced else params
    counted = model.optimizer_bytes(precision, copies, fused_adamw)  # hybridpar's own AdamW where counted
    per_param = (ADAMW_BYTES + (COPY_BYTES if copies else 0)) if counted is None else counted
    bw = hw.memory_bps()
    memory = 0.0 if bw is None else (per_param * mine + CLIP_BYTES * params) / bw
    tensors = model.m.n_layers * model.layer_tensors / pp + 3
    ops = tensors * OPS_PER_PARAM_TENSOR * hw.op_overhead_us * 1e-6
    width = 2 if copies else F32_BYTES  # the bytes a parameter its gathers move
    gather = gathers * all_gather_s(width * params, dp, link, hw) if sliced else 0.0
    if sliced and zero < 3 and overlapped(hw.gpu_calibration, "param_gather"):
        width = 4 if precision == "fp32" else 2
        hide, first = hidden
        gather = max(all_gather_s(width * first, dp, link, hw), all_gather_s(width * params, dp, link, hw) - hide)
    cal = hw.calibration
    if cal is not None and cal.fits(model.m):  # measured per layer's worth of parameters (AdamW's bytes)
        bytes_ratio = per_param / ADAMW_BYTES  # exactly 1 without working copies: the probe timed AdamW alone
        return stretch * cal.optimizer_layer_s / cal.core_share * mine / model.counts.layer * bytes_ratio + gather
    return stretch * (memory + ops) + gather
