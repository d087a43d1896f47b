"""The model's own modules measured in place by the probe (plan/probe.py), every rank at once as a run's
ranks compute: the calibration averaged over the ranks, the tensor-parallel layers and head with their
collectives in groups, and the pipeline runtime's per-action overhead on a real pipeline over the ranks.
Each function is collective over the default group (every rank calls it, in the same order).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

from hybridpar.config import ModelConfig
from hybridpar.plan.calibrate import Calibration

REPEATS = 3  # timed pipeline steps of the action overhead (after two that warm up)


def rank_mean(figures: list[float]) -> list[float]:
    """Each figure averaged over the ranks (collective over the default group)."""
    import torch
    import torch.distributed as dist

    v = torch.tensor(figures, dtype=torch.float64)
    dist.all_reduce(v)
    return (v / dist.get_world_size()).tolist()


def mean_over_ranks(cal: Calibration) -> Calibration:
    """Every rank's calibration of the same shapes, averaged figure by figure (collective)."""
    rows = [*cal.layers, *cal.ends]
    names = [[f.name for f in dataclasses.fields(r) if f.name not in ("tp", "tokens")] for r in rows]
    figures = [getattr(r, k) for r, ks in zip(rows, names) for k in ks] + [cal.optimizer_layer_s, cal.action_overhead_s]
    it = iter(rank_mean(figures))
    mean = [dataclasses.replace(r, **{k: next(it) for k in ks}) for r, ks in zip(rows, names)]
    n = len(cal.layers)
    return dataclasses.replace(
        cal, layers=tuple(mean[:n]), ends=tuple(mean[n:]), optimizer_layer_s=next(it), action_overhead_s=next(it)
    )


def tp_layers(cal: Calibration, model: ModelConfig, seq_len: int, shapes: list, rounds: int) -> list[dict]:
    """Collective over the default group: per tp > 1 of `shapes` dividing the world, the model's own
    tensor-parallel layers (a stack of `calibrate.STACK` at most, their collectives included) run
    forward and backward in groups of tp consecutive ranks (global ranks run tp fastest), every group
    at once, as a step's layers run: per layer, the mean wall seconds of a forward and its backward
    (averaged over the ranks) beside the CPU seconds the calibration measured for its shard alone
    (`cal`, the same on every rank). What the collectives add to a step is the difference (`in_step`):
    on a CPU host more than the calls alone take, since gloo's threads wake for each and burn CPU that
    the other ranks' compute lacks (calibrate.py's docstring has the figures)."""
    import torch
    import torch.distributed as dist

    from hybridpar.model.registry import build_stage
    from hybridpar.pipeline.runtime import token_cross_entropy
    from hybridpar.plan.calibrate import STACK, _metered

    world, me = dist.get_world_size(), dist.get_rank()
    cpu = {(r.tp, r.tokens): (r.f, r.b) for r in cal.layers}
    ends = {r.tokens: r for r in cal.ends}
    depth = min(model.n_layers, STACK)
    groups: dict[int, Any] = {}
    out = []
    for tp, b in sorted({(tp, b) for tp, b in shapes if 1 < tp <= world and world % tp == 0}):
        if tp not in groups:  # every rank creates every group, in the same order (new_group is collective)
            mine = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
            groups[tp] = mine[me // tp]
        forward = _metered(build_stage(model, list(range(depth)), False, False, 0, torch.device("cpu"), groups[tp]))
        g = torch.randn(b, seq_len, model.dim)
        ids = torch.randint(0, model.vocab_size, (b, seq_len))
        head = _metered(build_stage(model, [], False, True, 0, torch.device("cpu"), groups[tp]))
        fresh = lambda: torch.randn(b, seq_len, model.dim, requires_grad=True)  # noqa: E731
        layers_s = _mean_wall(lambda x: torch.autograd.backward(forward(x), g), fresh, rounds)
        head_s = _mean_wall(lambda x: token_cross_entropy(head(x), ids, 1.0).backward(), fresh, rounds)
        wall, head_wall = rank_mean([layers_s / depth, head_s])
        end = ends[b * seq_len]
        out.append(
            {
                "tp": tp,
                "tokens": b * seq_len,
                "wall": wall,
                "work": sum(cpu[tp, b * seq_len]),
                "head_wall": head_wall,
                "head_work": end.head_f + end.head_b,
            }
        )
    return out


def _mean_wall(run: Callable[[Any], Any], make: Callable[[], Any], rounds: int) -> float:
    """Mean wall seconds of `run(make())` (the input made untimed) over `rounds` calls after one that
    warms up, from a barrier; a fixed count on every rank: a group's collectives pair up call for call."""
    import torch.distributed as dist

    dist.barrier()
    walls = []
    for k in range(rounds + 1):
        x = make()
        t0 = time.perf_counter()
        run(x)
        if k:
            walls.append(time.perf_counter() - t0)
    return statistics.fmean(walls)


def action_overhead(p2p: Any, model: ModelConfig, seq_len: int, batch: int, seconds: float) -> float:
    """Collective over the default group: what the pipeline runtime costs per compute action beyond the
    action's own work, in CPU seconds, averaged over the ranks. Each rank holds one decoder layer as a
    stage of a pipeline over all ranks and times it alone (forward and backward on fresh input, as
    calibrate.py does); then the real runtime runs 1F1B over 2 x ranks microbatches of `batch`
    sequences through `p2p`, and the process's CPU time of a step (its transport threads too) less the
    layer's work is spread over the step's compute actions. That holds what a step adds around its
    layers: messages, bookkeeping, and caches refilled after each wait, which a layer timed in a loop
    never sees (0.35-0.55 ms per action on the 2-core development machine, where handing a tensor to
    autograd takes 20 us)."""
    import torch
    import torch.distributed as dist

    from hybridpar.model.registry import build_stage
    from hybridpar.pipeline.activation_meter import ActivationMeter
    from hybridpar.pipeline.runtime import PipelineRuntime
    from hybridpar.pipeline.schedules import build_schedule
    from hybridpar.plan.calibrate import _forward_backward_s, _metered

    world, me = dist.get_world_size(), dist.get_rank()
    stage = build_stage(model, [0], False, False, 0, torch.device("cpu"))
    shape = (batch, seq_len, model.dim)
    fresh = lambda: torch.randn(shape, requires_grad=True)  # noqa: E731
    f, b = _forward_backward_s(_metered(stage), fresh, torch.randn(shape), min(seconds, 0.25))
    stage.zero_grad(set_to_none=True)
    runtime = PipelineRuntime({me: stage}, world, lambda s: s, p2p, model.dim, lambda y, t, k: y.square().mean() * k)
    runtime.meter = ActivationMeter()
    runtime.meter.lent = p2p.lent
    m = 2 * world
    actions = build_schedule("1f1b", world, 1, m)[me]
    xs = [torch.randn(shape) if me == 0 else None for _ in range(m)]
    ys = [torch.zeros(batch, seq_len, dtype=torch.long)] * m
    cpu = []
    for k in range(REPEATS + 2):  # the same count on every rank: the messages pair up
        runtime.meter.reset(stage.parameters())
        t0 = time.process_time()
        runtime.run(actions, xs, ys, 1.0)
        if k >= 2:  # two steps warm up
            cpu.append(time.process_time() - t0)
        stage.zero_grad(set_to_none=True)
    return rank_mean([max(0.0, (statistics.median(cpu) - m * (f + b)) / (2 * m))])[0]


def in_step(row: dict[str, float], ranks: int, cores: float) -> dict[str, float]:
    """One tensor-parallel all-reduce's share of what a layer's collectives add to a step beyond the
    compute the simulator already stretches for shared cores (`tp_layers`: a layer's forward and
    backward, two all-reduces each, in place, less their CPU so stretched); likewise the head's two
    collectives (beyond the unsharded head's calibrated CPU, which the cost model charges it)."""
    stretch = max(1.0, ranks / cores)
    extra = row["wall"] - stretch * row["work"]
    head = row.get("head_wall", 0.0) - stretch * row.get("head_work", 0.0)
    return {"tp": row["tp"], "tokens": row["tokens"], "all_reduce": max(0.0, extra / 4), "head": max(0.0, head)}
