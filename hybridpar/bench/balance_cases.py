"""The layouts and slowdowns of `hybridpar bench balance` (bench/balance.py) and the figures of one run pair.

Layouts (24 layers, global batch 28): pp4 under each schedule (1f1b, interleaved-1f1b with two chunks per
rank, zb-h1, zb-v), dp4 and dp2xpp2. Slowdowns, each from step `ONSET` (emulated: emulate/):

- one: rank 2 at 2x (`--emulate.slowdown`).
- two: rank 2 at 2x and rank 1 at 1.5x (different stages at pp4, different replicas at dp2xpp2).
- spike: rank 2 at 5x for 3 steps only (`--emulate.spike`): the balancer should move nothing.
- drift: rank 2 from 1x to 2.5x and back over `--drift-steps` steps (`--emulate.drift`).
- clean: no slowdown: every decision is a false one.
- slow_link: the link between pipeline ranks 1 and 2 at a tenth of the others' speed
  (`--emulate.slow_link 1:10`, pipeline layouts only); the contender is the adaptive microbatch policy.

The capacity bound of a step is the clean step x N / the summed rank speeds. The clean step is measured by
a run of its own in every repeat (`bound`: the same layout, no slowdown, no balancer), alternating with the
static and the balanced run; the same run's steps before the onset are reported beside it
(`pre_onset_step_s`), as is the emulated costs' own bound (`analytic_step`).
"""

from __future__ import annotations

import statistics
from typing import Any

from hybridpar.config import Config
from hybridpar.emulate.profiles import parse_shaped, shaped_factor
from hybridpar.pipeline.schedules import schedule_spec

ONSET = 10
LAYERS, BATCH = 24, 28  # every layout's model depth and global batch
LAYOUTS: dict[str, dict[str, Any]] = {
    "pp4-1f1b": dict(pp=4, dp=1, schedule="1f1b", v=None, microbatches=4),
    "pp4-interleaved": dict(pp=4, dp=1, schedule="interleaved-1f1b", v=2, microbatches=4),
    "pp4-zb-h1": dict(pp=4, dp=1, schedule="zb-h1", v=None, microbatches=4),
    "pp4-zb-v": dict(pp=4, dp=1, schedule="zb-v", v=2, microbatches=8),
    "dp4": dict(pp=1, dp=4, schedule="1f1b", v=None, microbatches=1),
    "dp2xpp2": dict(pp=2, dp=2, schedule="1f1b", v=None, microbatches=4),
}
CASES: tuple[str, ...] = ("one", "two", "spike", "drift", "clean", "slow_link")
# `--acceptance`: the whole acceptance set, (mode, layout, case) in the order they run, and the
# sizes that keep it to about 20 minutes on a quiet 2-core machine (docs/load-balancing.md): emulated, a
# clean 200-step run under every layout (one launch each: any move in any of them is a false one), a slow
# link, one slow rank under every layout, two (different stages: pp4; different replicas: dp2xpp2), a
# spike, a 300-step drift; then one slow rank in compute mode, beside. Every compute action lasts at least
# `min_action_ms` (zb-v's smallest action holds 3 layers x 3.5 samples; at 0.25 ms per layer its real
# compute and overhead, ~4 ms on a quiet machine, outlasted the emulated 2.6 ms), and the drift has no
# static run (its figure is against the bound).
ACCEPTANCE: tuple[tuple[str, str, str], ...] = (
    *(("emulated", layout, "clean") for layout in LAYOUTS),
    ("emulated", "pp4-1f1b", "slow_link"),
    *(("emulated", layout, "one") for layout in LAYOUTS),
    ("emulated", "pp4-1f1b", "two"),
    ("emulated", "dp2xpp2", "two"),
    ("emulated", "pp4-1f1b", "spike"),
    ("emulated", "pp4-1f1b", "drift"),
    ("compute", "pp4-1f1b", "one"),
)
ACCEPTANCE_DEFAULTS: dict[str, Any] = dict(
    layer_ms=0.2, min_action_ms=8.0, steps=30, rounds=2, block=4, clean_repeats=1, drift_static=False
)


def slow_factors(case: str, drift_steps: int) -> dict[int, float]:
    """Each slowed rank's factor at its worst (for the bound; drift: see `drift_bound`)."""
    return {"one": {2: 2.0}, "two": {2: 2.0, 1: 1.5}, "spike": {2: 5.0}, "drift": {2: 2.5}}.get(case, {})


def case_config(layout: str, case: str, mode: str, a: Any, contender: bool) -> Config:
    """The run of `layout` under `case`: the baseline (`contender` False: static layout, fixed microbatches)
    or the contender (balance auto; for slow_link the adaptive microbatch policy as well)."""
    s = LAYOUTS[layout]
    cfg = Config()
    m, t, p, e = cfg.model, cfg.train, cfg.parallel, cfg.emulate
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim = 32, LAYERS, 4, 2, 64
    p.tp, p.pp, p.dp, p.schedule, p.virtual_stages, p.partition = 1, s["pp"], s["dp"], s["schedule"], s["v"], "uniform"
    t.global_batch, t.microbatches, t.seq_len = BATCH, s["microbatches"], 16
    t.steps = {"drift": ONSET + a.drift_steps + a.measure, "clean": a.clean_steps, "bound": ONSET + a.measure}.get(
        case, a.steps
    )
    t.warmup_steps, t.val_every, t.monitor_every, t.sample_tokens = 2, 0, 0, 0
    cfg.data.max_tokens = 200_000
    e.layer_ms = layer_ms(layout, a) if mode == "emulated" else 0.0
    if case == "one":
        e.slowdown = f"rank=2:2.0@step={ONSET}"
    elif case == "two":
        e.slowdown = f"rank=2:2.0@step={ONSET},rank=1:1.5@step={ONSET}"
    elif case == "spike":
        e.spike = f"rank=2:5.0@step={ONSET}+3"
    elif case == "drift":
        e.drift = f"rank=2:2.5@step={ONSET}+{a.drift_steps}"
    elif case == "slow_link":
        e.slow_link, e.link_ms = "1:10", a.link_ms
        cfg.batching.policy = "adaptive" if contender else "fixed"
    cfg.balance.mode = "auto" if contender or case == "clean" else "off"
    return cfg


def layer_ms(layout: str, a: Any) -> float:
    """The emulated cost per layer and sample of `layout`: `--layer-ms`, raised so that its smallest compute
    action (one chunk's layers x one microbatch's samples) lasts `--min-action-ms` at least (0: off)."""
    s = LAYOUTS[layout]
    chunk = LAYERS // (s["pp"] * (s["v"] or 1)) * (BATCH / s["dp"] / s["microbatches"])  # layer-samples per action
    return max(a.layer_ms, getattr(a, "min_action_ms", 0.0) / chunk)


def rank_work(layout: dict, cfg: Config, rank: int) -> float:
    """Layers x batch share `rank` holds in a balancer layout record (`{"parts", "split"}`; tp 1): the
    direction a move took for that rank."""
    p = cfg.parallel
    spec = schedule_spec(p.schedule)
    ranks = spec.stage_ranks(p.pp, spec.resolve_virtual_stages(p.virtual_stages))
    d, pp_rank = divmod(rank, p.pp)
    return sum(b - a for s, (a, b) in enumerate(layout["parts"][d]) if ranks[s] == pp_rank) * layout["split"][d]


def oscillation(cfg: Config, moves: list[dict], rank: int = 2) -> dict[str, Any]:
    """Moves of a drift run (1x -> peak -> 1x): the shortest gap between two (at least `balance.interval`)
    and how often the direction of the drifting `rank`'s work changed (no oscillation: at most once, at
    the peak — each way monotone)."""
    signs = [rank_work(m["new"], cfg, rank) - rank_work(m["old"], cfg, rank) for m in moves]
    signs = [x for x in signs if x != 0]
    gaps = [b["step"] - a["step"] for a, b in zip(moves, moves[1:])]
    return {
        "min_move_gap": min(gaps, default=None),
        "direction_changes": sum(1 for x, y in zip(signs, signs[1:]) if x * y < 0),
        "work_changes": signs,
    }


def step_times(rows: list[dict]) -> list[float]:
    return [r["step_time_s"] for r in rows if "step_time_s" in r]


def decisions(rows: list[dict]) -> list[dict]:
    return [e for r in rows for e in r.get("balance", []) if e["event"] == "rebalance" and e["applied"]]


def drift_bound(clean_step: float, world: int, drift: str, steps: range) -> float:
    """The capacity bound integrated over `steps`: each step's clean step x N / that step's summed speeds."""
    entries = parse_shaped("drift", drift)
    return sum(clean_step * world / sum(1.0 / shaped_factor(entries, r, s) for r in range(world)) for s in steps)


def analytic_step(cfg: Config, speeds: float) -> float:
    """Emulated mode's bound from the emulated costs alone: every layer layer_ms per sample forward and
    twice that backward, the work shared by `speeds` (summed rank speeds), stretched by the schedule's
    bubble at uniform costs. It leaves out the real compute and messages, so measured steps sit above it;
    unlike the clean-step bound it does not depend on how loaded the machine was before the onset."""
    p, t = cfg.parallel, cfg.train
    spec = schedule_spec(p.schedule)
    v = spec.resolve_virtual_stages(p.virtual_stages)
    work = cfg.emulate.layer_ms / 1000.0 * 3 * t.global_batch * cfg.model.n_layers
    bubble = spec.bubble_fraction(p.pp, v, t.microbatches) if p.pp > 1 else 0.0
    return work / speeds / (1.0 - bubble)


def figures(
    cfg: Config, case: str, base: list[dict] | None, cont: list[dict], a: Any, bound: list[dict] | None = None
) -> dict[str, Any]:
    """One pair of runs (baseline, contender) as ratios to the capacity bound and to each other; the clean
    step from the `bound` run (None: the contender's steps before the onset)."""
    world, skip = cfg.parallel.world_size, cfg.balance.skip_steps
    tb, tc = step_times(base or []), step_times(cont)
    moves = decisions(cont)
    if case == "clean":
        return {"false_rebalances": len(moves), "steps": len(tc), "step_s": statistics.median(tc[skip:])}
    if case == "slow_link":  # slow from the first step: no clean step to bound it by; contender vs baseline
        sb, sc = statistics.median(tb[-a.measure :]), statistics.median(tc[-a.measure :])
        split = [[r["microbatches"] for r in rows if "microbatches" in r][-1] for rows in (base, cont)]
        return {
            "balanced_over_static": sb / sc,
            "moves": len(moves),
            "static_step_s": sb,
            "balanced_step_s": sc,
            "microbatches_static": split[0],
            "microbatches_adaptive": split[1],
        }
    pre_onset = statistics.median(tc[skip:ONSET])
    clean_step = statistics.median(step_times(bound)[skip:]) if bound else pre_onset
    out: dict[str, Any] = {"clean_step_s": clean_step, "pre_onset_step_s": pre_onset, "moves": len(moves)}
    if cfg.emulate.layer_ms > 0:  # how far the clean step sits above the emulated costs alone
        out["analytic_clean_step_s"] = analytic_step(cfg, world)
    if case == "drift":
        span = range(ONSET, len(tc))
        bound = drift_bound(clean_step, world, cfg.emulate.drift, span)
        # Beside it, the bound from the balanced run's own steps before the onset (same processes, the
        # machine's load of the same minutes: a separate bound run at load 10 measured 0.50 s a clean step
        # where the balanced run's own clean steps took 0.35 s).
        own = drift_bound(pre_onset, world, cfg.emulate.drift, span)
        out |= {
            "balanced_over_ideal": bound / sum(tc[ONSET:]),
            "balanced_over_own_pre_onset_ideal": own / sum(tc[ONSET:]),
            "static_over_ideal": bound / sum(tb[ONSET:]) if tb else None,
            "move_steps": [d["step"] for d in moves],
        } | oscillation(cfg, moves)
    else:
        speeds = world - sum(1.0 - 1.0 / f for f in slow_factors(case, a.drift_steps).values())
        if case == "spike":
            speeds = world  # the measured tail is after the spike: every rank at full speed again
        ideal = clean_step * world / speeds
        sb, sc = statistics.median(tb[-a.measure :]), statistics.median(tc[-a.measure :])
        first = next((d["step"] for d in moves if d["step"] >= ONSET), None)
        if cfg.emulate.layer_ms > 0:
            analytic = analytic_step(cfg, speeds)
            out |= {"balanced_over_analytic": analytic / sc, "static_over_analytic": analytic / sb}
        out |= {
            "balanced_over_ideal": ideal / sc,
            "static_over_ideal": ideal / sb,
            "balanced_over_static": sb / sc,
            "steps_to_rebalance": None if first is None else first - ONSET,
            "static_step_s": sb,
            "balanced_step_s": sc,
        }
    return out
