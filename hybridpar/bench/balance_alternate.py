"""`hybridpar bench balance`, cases one, two and spike: the balanced layout, the static one and the capacity
bound's clean step measured in alternating blocks of steps inside the same processes.

Separate runs for each of them meet the machine at different loads: on a shared 2-core machine (load 10-40)
the clean step of one run and the balanced step of the next differ by more than what balancing changes, so
the ratio to the bound scattered 0.25-3.3 per repeat. Here one launch first trains as a run does (the
balancer live, the slowdown from `ONSET`: what it decides and when), then stops the balancer and alternates,
`rounds` times, blocks of `block` steps on the balanced layout, on the static (uniform) layout with the
same slowdown, and on the static layout with no slowdown (the clean step), moving layers between blocks
with `Trainer.apply_layout` (the step after a move is not measured). A change of load within a launch then
hits the three alike, round by round. The emulated speeds are set by the bench itself (the runtime's
`stretch` before every step, the factor `emulate.slowdown` and `emulate.spike` give the rank) with the
emulated layer cost attached as a run attaches it (emulate/layer_cost.py).
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from hybridpar.config import Config

VARIANTS = ("balanced", "static", "clean")


def measure_worker(cfg_dict: dict, phase_steps: int, rounds: int, block: int) -> dict[str, Any] | None:
    """One rank's part of a launch (every rank runs it); rank 0 returns the step times of the balancing
    phase, its applied decisions, and each round's blocks (step times, load average at the start)."""
    from hybridpar.emulate.attach import rank_factor
    from hybridpar.emulate.layer_cost import attach_layer_cost
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    topo = build_topology(p.dp, p.pp, p.tp, "gloo", 300.0)
    tr = Trainer(cfg, topo)
    tr.attach(lambda t: attach_layer_cost(t.runtime, cfg.emulate.layer_ms))
    factor = rank_factor(cfg, topo.dims.world_size) or (lambda rank, step: 1.0)
    static, phase, moves = tr.layout, [], []
    for s in range(phase_steps):
        tr.runtime.stretch = factor(topo.rank, s)
        rec = tr.step(s)
        phase.append(rec["step_time_s"])
        moves += [e for e in rec.get("balance", []) if e["event"] == "rebalance" and e["applied"]]
    balanced, tr.balancer = tr.layout, None
    slow = factor(topo.rank, phase_steps - 1)  # the slowdown the phase ended on (a spike's is over)
    setting = {"balanced": (balanced, slow), "static": (static, slow), "clean": (static, 1.0)}
    out: list[dict[str, Any]] = []
    s = phase_steps
    for r in range(rounds):
        for name in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:  # each variant first once in three rounds
            layout, stretch = setting[name]
            load = os.getloadavg()[0]
            if tr.layout != layout:
                tr.apply_layout(layout)
            times = []
            for i in range(block + 1):
                tr.runtime.stretch = stretch
                t = tr.step(s)["step_time_s"]
                s += 1
                if i:  # the first step after a move allocates afresh: not measured
                    times.append(t)
            out.append({"round": r, "variant": name, "step_s": times, "load_average": load})
    if topo.rank != 0:
        return None
    parts = [[[x.start, x.stop] for x in d] for d in balanced.parts]
    return {"phase_step_s": phase, "moves": moves, "blocks": out, "balanced_parts": parts}


def alternate_figures(
    res: dict[str, Any], speeds: float, world: int, onset: int, emulated_s: float | None = None
) -> dict[str, Any]:
    """The launch's figures: per round, the balanced and the static block's median step against that
    round's bound; medians over the rounds, and each round's. The bound is the clean block's median x N /
    `speeds`, except that, given `emulated_s` (the clean step's emulated compute, bubble included:
    balance_cases.analytic_step), only that part is scaled: the rest of a step (gradient reduction,
    optimizer, real work outside the compute actions) is no slower for a slow rank's compute, and scaling
    it too put the bound above what any layout reaches (dp4 at load 30: balanced 1.07 of it)."""
    by = {(b["round"], b["variant"]): statistics.median(b["step_s"]) for b in res["blocks"]}
    # The quietest step of each block too: the load only adds time to a step whose compute is an emulated
    # floor, so a block's minimum is its least disturbed step (a view robust to bursts of the neighbours').
    least = {(b["round"], b["variant"]): min(b["step_s"]) for b in res["blocks"]}
    per = []
    for r in sorted({r for r, _ in by}):
        bound, quiet = (_bound(x[(r, "clean")], world / speeds, emulated_s) for x in (by, least))
        per.append(
            {
                "balanced_over_ideal": bound / by[(r, "balanced")],
                "static_over_ideal": bound / by[(r, "static")],
                "balanced_over_static": by[(r, "static")] / by[(r, "balanced")],
                "quiet_balanced_over_ideal": quiet / least[(r, "balanced")],
                "quiet_static_over_ideal": quiet / least[(r, "static")],
                "clean_step_s": by[(r, "clean")],
                "balanced_step_s": by[(r, "balanced")],
                "static_step_s": by[(r, "static")],
            }
        )
    out: dict[str, Any] = {k: statistics.median(x[k] for x in per) for k in per[0]}
    first = next((d["step"] for d in res["moves"] if d["step"] >= onset), None)
    out |= {
        "moves": len(res["moves"]),
        "steps_to_rebalance": None if first is None else first - onset,
        "balanced_parts": res["balanced_parts"],
        "rounds": per,
        "block_load_averages": [b["load_average"] for b in res["blocks"]],
    }
    return out


def _bound(clean_s: float, stretch: float, emulated_s: float | None) -> float:
    """The capacity bound from a clean step: all of it x `stretch` (N / summed speeds), or with its
    emulated compute known, the rest as it is plus that compute x `stretch`."""
    scaled = clean_s if emulated_s is None else min(clean_s, emulated_s)
    return clean_s + scaled * (stretch - 1.0)
