"""Elastic restarts (pure): what a worker does differently when the elastic agent restarted it, and how a
run resumed on a different number of processes picks its new (tp, pp, dp, cp).

Re-plan policy (`replan`), for a world of W processes:
0. cp: keep it if it divides W; otherwise the largest divisor of W below it that splits train.seq_len
   into 2 cp chunks (1 at worst); steps 1-3 then lay out W / cp processes.
1. tp: keep it if it divides W; otherwise the largest divisor of W below it that still divides the
   heads, kv heads, FFN and vocabulary (tensor-parallel peers must hold equal shards).
2. pp: keep it if it divides W / tp and the model has enough layers; otherwise the largest such divisor
   below it. The schedule stays if it is valid for the new pp, layers and microbatches (its registry
   entry's constraints), else its registered fallback (`ScheduleSpec.fallback`: ZB-V to ZB-H1,
   interleaved and ZB-H1 to 1F1B, 1F1B to GPipe), with that schedule's default virtual stages.
3. dp = W / (tp * pp) takes the rest. train.global_batch never changes, and sample order depends only on
   (seed, step), so the run sees the same samples in the same order; microbatches per replica are kept
   if each replica still has that many samples, else lowered; explicit microbatch_sizes and an uneven
   replica split (parallel.replica_batch) are dropped when dp changes (they were sized for the old
   replicas), explicit stage sizes (parallel.stage_layers) when the stage count changes.
With parallel.auto the entry point passes the planner's re-plan instead (`layout_for_world`'s
`replanner`, plan/launch.py): this module stays below the planner and knows nothing of it.
The result is checked with validate_config(cfg, world_size=W) (pipeline/schedules/config_rules.py); the
checkpoint is loaded through DCP, which reshards tp shards and stages by name into the new layout.
"""

from __future__ import annotations

import copy
from typing import Callable

from hybridpar.config import Config
from hybridpar.config.families import tp_split_sizes
from hybridpar.pipeline.schedules import schedule_spec, stage_count, stages_per_rank
from hybridpar.pipeline.schedules.config_rules import validate_config


def resume_mode(cfg: Config, restart_count: int) -> Config:
    """The config a worker runs after `restart_count` restarts by the elastic agent: with
    resilience.resume_on_restart, a restarted worker resumes as with checkpoint.resume=auto (a fresh run,
    restart_count 0, is unchanged)."""
    if restart_count > 0 and cfg.resilience.resume_on_restart and cfg.checkpoint.resume == "off":
        cfg = copy.deepcopy(cfg)
        cfg.checkpoint.resume = "auto"
    return cfg


def _divisors_desc(n: int, at_most: int) -> list[int]:
    return [d for d in range(min(n, at_most), 0, -1) if n % d == 0]


def replan(cfg: Config, world: int) -> Config:
    """A copy of `cfg` laid out for `world` processes by the policy above; ValueError if none is valid."""
    if world < 1:
        raise ValueError(f"cannot re-plan for a world of {world} processes")
    m, p, t = cfg.model, cfg.parallel, cfg.train
    out = copy.deepcopy(cfg)
    q, tr = out.parallel, out.train
    # cp first (context parallelism): kept if it divides the world, else the largest divisor below it
    # that still splits the sequence into 2 cp chunks; the other axes share what is left.
    q.cp = next(d for d in _divisors_desc(world, p.cp) if d == 1 or t.seq_len % (2 * d) == 0)
    cp, world = q.cp, world // q.cp
    shards = tuple(tp_split_sizes(m).values())
    # Sequence parallelism cuts each cp rank's tokens over tp: tp must split them (2 cp chunks each, with cp).
    seq_cut = 2 * cp if cp > 1 else 1
    tps = [
        d
        for d in _divisors_desc(world, p.tp)
        if all(s % d == 0 for s in shards) and (not p.sequence_parallel or t.seq_len % (seq_cut * d) == 0)
    ]
    if not tps:
        raise ValueError(f"no tensor-parallel degree divides world={world} and the model")
    q.tp = tps[0]
    rest = world // q.tp
    for pp in _divisors_desc(rest, p.pp):
        if m.n_layers >= pp * stages_per_rank(p) and rest // pp <= t.global_batch:
            q.pp = pp
            break
    else:
        raise ValueError(
            f"no pipeline degree fits world={world} with tp={q.tp}: model.n_layers={m.n_layers}, "
            f"train.global_batch={t.global_batch}"
        )
    q.dp = rest // q.pp
    per_replica = t.global_batch // q.dp
    tr.microbatches = min(t.microbatches, per_replica)
    if q.dp != p.dp:
        tr.microbatch_sizes = q.replica_batch = None
    spec = schedule_spec(q.schedule)
    while (
        spec.layout_problem(q.pp, stages_per_rank(q))
        or spec.count_problem(q.pp, tr.microbatches)
        or m.n_layers < stage_count(q)
    ) and spec.fallback is not None:
        spec = schedule_spec(spec.fallback)
        q.schedule, q.virtual_stages = spec.name, None if p.virtual_stages is None else spec.default_virtual_stages
    if q.partition == "cost" and q.layer_costs is not None and len(q.layer_costs) != m.n_layers:
        q.partition, q.layer_costs = "params", None
    if q.partition == "layers" and stage_count(q) != stage_count(p):
        q.partition, q.stage_layers = "params", None
    validate_config(out, world_size=world * cp)
    return out


def layout_for_world(
    cfg: Config, world: int, restart_count: int, replanner: Callable[[Config, int], Config] = replan
) -> tuple[Config, str | None]:
    """What an entry point runs on `world` processes: `cfg` after a restart's resume mode and, when
    resuming on another world size with resilience.replan=auto, re-planned by `replanner` (the rule
    above unless the caller passes the planner's); plus a line saying so."""
    cfg = resume_mode(cfg, restart_count)
    if cfg.parallel.world_size == world or cfg.checkpoint.resume == "off" or cfg.resilience.replan == "off":
        return cfg, None
    new = replanner(cfg, world)
    validate_config(new, world_size=world)  # whoever chose it: a layout the run can take
    p, q = cfg.parallel, new.parallel
    cps = (f" cp={p.cp}", f" cp={q.cp}") if max(p.cp, q.cp) > 1 else ("", "")
    note = (
        f"hybridpar: elastic re-plan for {world} processes{' (planner)' if replanner is not replan else ''}: "
        f"tp={p.tp} pp={p.pp} dp={p.dp}{cps[0]} -> "
        f"tp={q.tp} pp={q.pp} dp={q.dp}{cps[1]} ({q.schedule}, {new.train.microbatches} microbatches per replica, "
        f"global batch {new.train.global_batch})"
    )
    return new, note
