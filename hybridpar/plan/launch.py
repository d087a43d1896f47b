"""Planning at launch (`--parallel.auto true`): the launcher plans once for the world it starts, before
any worker, prints the choice and the runners-up, writes `<run_dir>/plan.json` and starts the workers on
the chosen layout; an elastic re-plan (a resume on another world size) plans again from that file.

What the user gave stays as given: every planner knob set on the command line or in `--config` (for
`hybridpar.launch(cfg)`: set to other than its default) is held fixed, tp/pp/dp included, and
train.precision (and under bf16 train.bf16_weights) is kept unless parallel.auto_precision asks the planner to
choose it (bf16 and working copies change the numbers a run computes; the other knobs do not). The hardware
is parallel.hardware, or this machine probed once (plan/probe.py, a few seconds: a launch is rare, and a
description measured under the machine's present load beats a built-in guess).

On hardware with a `speed` per device the chosen layout runs as planned: a cost-balanced partition
becomes explicit stage sizes (parallel.stage_layers: the runtime's own cost partition knows no device
speeds), and replicas of unequal speed get shares of the batch in proportion (parallel.replica_batch,
by the load balancer's own rule, balance/repartition.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridpar.balance.live import cost_model
from hybridpar.balance.repartition import Layout, plan_layout
from hybridpar.batching.split import split_evenly
from hybridpar.config import Config
from hybridpar.pipeline.schedules import schedule_spec, stage_count, stages_per_rank
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.plan.hardware import Hardware, load_hardware, parse_hardware
from hybridpar.plan.knobs import KNOB_KEYS
from hybridpar.plan.search import Candidate, Plan, plan
from hybridpar.trainer.build import layer_partition

PLAN_FILE = "plan.json"
TOP = 5  # the choice and its runners-up, printed and recorded
# Every key a chosen layout may set, handed to the workers as flags.
PLANNED = (
    *KNOB_KEYS.values(),
    "parallel.layer_costs",
    "parallel.stage_layers",
    "parallel.replica_batch",
    "train.microbatch_sizes",
    "batching.policy",
    "batching.microbatch_size",
    "parallel.cpu_bind",
)
LAYOUT_KEYS = ("parallel.tp", "parallel.pp", "parallel.dp")
# What planning at launch holds beside the user's keys: no context parallelism, which parallel.auto does not
# run yet (config/validate.py refuses the two together; `hybridpar plan` searches cp).
LAUNCH_HOLDS = {"parallel.cp": 1}


@dataclass
class AutoPlan:
    cfg: Config  # the chosen layout, ready to run
    result: Plan
    hw: Hardware
    fixed: dict[str, Any]  # the user's choices the planner kept


def given_by_value(cfg: Config) -> set[str]:
    """The planner's keys set to other than their defaults (what `hybridpar.launch(cfg)` counts as given)."""
    default = Config()
    return {k for k in KNOB_KEYS.values() if _get(cfg, k) != _get(default, k)}


def _get(cfg: Config, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


def constraints(cfg: Config, given: set[str]) -> dict[str, Any]:
    """The planner knobs held fixed; ValueError for what the planner cannot combine with."""
    b, t = cfg.batching, cfg.train
    if b.policy != "fixed" or b.microbatch_size is not None:
        raise ValueError(
            "parallel.auto chooses train.microbatches, which batching.policy=adaptive and batching.microbatch_size "
            "would choose otherwise: drop them (or give train.microbatches to hold it)"
        )
    if "," in t.recompute:
        raise ValueError(
            f"train.recompute={t.recompute!r} gives a mode per stage, but parallel.auto chooses the stages: "
            "give one mode (none, selective, full) or leave it to the planner"
        )
    fixed = {k: _get(cfg, k) for k in KNOB_KEYS.values() if k in given and _get(cfg, k) is not None}
    if not cfg.parallel.auto_precision:
        fixed["train.precision"] = t.precision
        if t.precision == "bf16":  # working copies change the numbers too: the planner tries them only if asked
            fixed["train.bf16_weights"] = t.bf16_weights
    return fixed


def hardware_for(cfg: Config, world: int) -> Hardware:
    if cfg.parallel.hardware is not None:
        return load_hardware(cfg.parallel.hardware)
    from hybridpar.plan.probe import probe

    print(f"hybridpar: parallel.auto: probing this machine with {max(2, world)} processes", flush=True)
    return probe(max(2, world))


def _base(cfg: Config) -> Config:
    """`cfg` without the previous plan's per-stage and per-replica lists (the planner sets the layout)."""
    out = copy.deepcopy(cfg)
    p = out.parallel
    p.stage_layers = p.replica_batch = out.train.microbatch_sizes = None
    if p.partition == "layers":
        p.partition = "params"
    return out


def replica_batch(cfg: Config, hw: Hardware) -> list[int] | None:
    """Each replica's share of the global batch in proportion to its speed on `hw` (the slowest of its
    tensor-parallel devices at each stage, the stages as `cfg` partitions them); None when every replica
    runs at the same speed."""
    p = cfg.parallel
    if hw.speed is None or p.dp == 1:
        return None
    ranks = schedule_spec(p.schedule).stage_ranks(p.pp, stages_per_rank(p))
    speeds = [
        [min(hw.device_speed((d * p.pp + ranks[s]) * p.tp + t) for t in range(p.tp)) for s in range(stage_count(p))]
        for d in range(p.dp)
    ]
    if all(row == speeds[0] for row in speeds):
        return None
    even = Layout.uniform(layer_partition(cfg), split_evenly(cfg.train.global_batch, p.dp))
    layout = plan_layout(
        even, cost_model(cfg), speeds, repartition=False, resplit=True, min_per_replica=cfg.train.microbatches
    )
    return list(layout.split)


def runnable(c: Candidate, hw: Hardware) -> Config:
    """The candidate's config as the runtime must be told it: the planner's cost-balanced stages as
    explicit sizes, and the replicas' shares of the batch on unequal devices."""
    cfg = copy.deepcopy(c.cfg)
    p = cfg.parallel
    if p.partition == "cost":
        p.partition, p.layer_costs, p.stage_layers = "layers", None, [b - a for a, b in c.prediction.parts]
    p.replica_batch = replica_batch(cfg, hw)
    return cfg


def auto_plan(cfg: Config, given: set[str], world: int, hw: Hardware | None = None) -> AutoPlan:
    """Plan `cfg` for `world` processes, holding the `given` keys; ValueError naming the binding constraint
    when nothing fits (the search's own line)."""
    from hybridpar.plan.memory_model import rank_memory

    fixed = constraints(cfg, given)
    hw = hw or hardware_for(cfg, world)
    result = plan(_base(cfg), hw, rank_memory, world=world, top=TOP, fixed={**fixed, **LAUNCH_HOLDS})
    chosen = runnable(result.candidates[0], hw)
    if hw.fills_cores(world) and cfg.parallel.cpu_bind == "none" and "parallel.cpu_bind" not in given:
        chosen.parallel.cpu_bind = "cores"
    validate_config(chosen, world_size=world)
    return AutoPlan(chosen, result, hw, fixed)


def hardware_dict(hw: Hardware) -> dict[str, Any]:
    """`hw` as the dict parse_hardware reads back (absent optional keys left out)."""
    return {k: v for k, v in dataclasses.asdict(hw).items() if v is not None}


def record(ap: AutoPlan, world: int) -> dict[str, Any]:
    """plan.json: the hardware, the user's fixed keys, the layout that runs and the ranked candidates,
    each with its full parallel and train settings and predictions."""
    settings = lambda c: {s: dataclasses.asdict(getattr(c, s)) for s in ("parallel", "train")}  # noqa: E731
    return {
        "world": world,
        "hardware": hardware_dict(ap.hw),
        "fixed": ap.fixed,
        "considered": ap.result.considered,
        "simulated": ap.result.simulated,
        "runs": settings(ap.cfg),
        "candidates": [{**c.to_dict(), "settings": settings(c.cfg)} for c in ap.result.candidates],
    }


def write_record(run_dir: str | Path, rec: dict[str, Any]) -> Path:
    path = Path(run_dir) / PLAN_FILE
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # several nodes' launchers may write the same file: each write whole
    return path


def summary(ap: AutoPlan) -> str:
    """The table of the choice and its runners-up, and the line naming the choice."""
    from hybridpar.plan.main import format_table

    p, t, best = ap.cfg.parallel, ap.cfg.train, ap.result.candidates[0]
    extra = "".join(
        f", {k}={v}"
        for k, v in (
            ("stage_layers", p.stage_layers),
            ("replica_batch", p.replica_batch),
            ("cpu_bind", p.cpu_bind),
            ("sequence_parallel", p.sequence_parallel),
        )
        if v and v != "none"
    )
    kept = ", ".join(f"{k}={v}" for k, v in ap.fixed.items())
    return (
        f"hybridpar: parallel.auto{f' (keeping {kept})' if kept else ''}\n{format_table(ap.result, ap.hw)}\n"
        f"hybridpar: running #1: tp={p.tp} pp={p.pp} dp={p.dp} {p.schedule} x{stages_per_rank(p)}, "
        f"{t.microbatches} microbatches, zero={p.zero}, recompute={t.recompute}, {t.precision}{extra} "
        f"({best.reason})"
    )


def replan_with_planner(cfg: Config, world: int) -> Config:
    """The elastic re-plan under parallel.auto: plan again for `world` on the hardware and with the fixed
    keys the launch recorded in plan.json, tp/pp/dp freed (the world changed) and the precision kept
    (the checkpoint's run goes on computing the same way); where the other fixed keys leave no layout for
    the new world, without them (a run that lost a node goes on rather than stops)."""
    from hybridpar.plan.memory_model import rank_memory

    path = Path(cfg.run_dir) / PLAN_FILE
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
        hw = parse_hardware(rec["hardware"], f"{path} [hardware]")
        fixed = {k: v for k, v in rec["fixed"].items() if k not in LAYOUT_KEYS}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"parallel.auto re-plans for {world} processes from {path}, which the launch should have written "
            f"and cannot be read ({type(e).__name__}: {e}): start with hybridpar train or hybridpar.launch, "
            "or set resilience.replan=off"
        ) from None
    fixed["train.precision"] = cfg.train.precision
    fixed["train.bf16_weights"] = cfg.train.bf16_weights  # as the checkpoint's run computed
    try:
        result = plan(_base(cfg), hw, rank_memory, world=world, top=1, fixed={**fixed, **LAUNCH_HOLDS})
    except ValueError:  # the user's keys do not suit the new world (a schedule that needs pp > 1): go on without
        held = {"train.precision": cfg.train.precision, "train.bf16_weights": cfg.train.bf16_weights, **LAUNCH_HOLDS}
        result = plan(_base(cfg), hw, rank_memory, world=world, top=1, fixed=held)
    return runnable(result.candidates[0], hw)
