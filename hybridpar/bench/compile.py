"""Compiled against eager training steps, and fused against foreach AdamW, in one run (JSON).

    .venv/bin/hybridpar bench compile [--steps 8] [--repeats 2] [--layouts 1x1x1,2x2x1]
                                      [--models default,4x] [--backend inductor] [--precision fp32]
                                      [--json FILE]

Each case trains a model (`default`: the default config's; `4x`: twice its width and FFN width and twice
its heads, four times the decoder layer's parameters) under a layout (TPxPPxDP) for `--steps` steps, eager
or with train.compile; at 1x1x1 also eager with train.fused_adamw on (against off, the foreach path).
Launches alternate case by case, `--repeats` rounds, so a change in the machine's load falls on all alike.
Reported per case: the median over launches of each launch's median step time from step 2 on (the
steady state), tokens/s, the ratio to eager in the same layout and model (eager's time over this one's:
> 1 is faster), the compile overhead — the first step's time less the steady step (per launch: the first
launch of a process tree compiles from scratch, later ones reuse torch's on-disk cache) — the graphs
compiled per rank, the load average (1 min) at each launch's start, and exactness against eager: the
largest difference of a step's loss, and (1x1x1) of any parameter after the last step. Last, per model,
AdamW's step alone, fused against foreach, alternating step by step in one process (`--adamw-rounds`):
a figure the machine's load disturbs far less than whole launches. `--precision bf16` runs every case under
autocast, `copies` with bf16 working copies (train.bf16_weights): the parameters compared at 1x1x1 are then
the fp32 masters.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from hybridpar.bench import emit, layout_config
from hybridpar.config import Config
from hybridpar.topology.spawn import run_ranks

VARIANTS = {  # name -> train settings
    "eager": {"compile": False, "fused_adamw": "off"},
    "compile": {"compile": True, "fused_adamw": "off"},
    "fused_adamw": {"compile": False, "fused_adamw": "on"},
}


def _worker(cfg_dict: dict, steps: int, state_file: str) -> dict:
    import torch

    from hybridpar.dataparallel.copies import MasterAdamW
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    trainer = Trainer(cfg, build_topology(p.dp, p.pp, p.tp, p.backend, p.timeout_s))
    recs = [trainer.step(s) for s in range(steps)]
    if state_file and p.world_size == 1:  # the fp32 masters under working copies (whole at dp 1)
        masters = trainer.opt.views if isinstance(trainer.opt, MasterAdamW) else None
        named = [(n, q if masters is None else masters[i]) for i, (n, q) in enumerate(trainer.mp.parameters())]
        torch.save({n: q.detach() for n, q in named}, state_file)
    c = trainer.mp.compiled
    return {
        "times": [r["step_time_s"] for r in recs],
        "losses": [r["loss"] for r in recs],
        "graphs": c.graphs if c is not None else 0,
    }


PRECISIONS = {"fp32": ("fp32", "autocast"), "bf16": ("bf16", "autocast"), "copies": ("bf16", "copies")}


def case_config(model: str, layout: str, variant: str, backend: str, precision: str = "fp32") -> Config:
    cfg = layout_config(layout)
    cfg.train.precision, cfg.train.bf16_weights = PRECISIONS[precision]
    if model == "4x":
        m = cfg.model
        m.dim, m.ffn_dim, m.n_heads = 2 * m.dim, 2 * m.ffn_dim, 2 * m.n_heads
    for k, v in VARIANTS[variant].items():
        setattr(cfg.train, k, v)
    cfg.train.compile_backend = backend
    return cfg


def _param_diff(a: str, b: str) -> float | None:
    import torch

    if not (Path(a).exists() and Path(b).exists()):
        return None
    x, y = (torch.load(f, weights_only=True) for f in (a, b))
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def adamw_step_times(cfg: Config, rounds: int) -> dict[str, float]:
    """AdamW's step alone over `cfg`'s model, fused against foreach, alternating step by step in one
    process (the same gradients), so the machine's load falls on both alike: median seconds per step."""
    import time

    import torch

    from hybridpar.model.optim import make_optimizer
    from hybridpar.model.registry import build_full_model

    times: dict[str, list[float]] = {"foreach": [], "fused": []}
    opts = {}
    for kind in times:
        model = build_full_model(cfg.model, 0)
        for q in model.parameters():
            q.grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(q.numel()))
        cfg.train.fused_adamw = "on" if kind == "fused" else "off"
        opts[kind] = make_optimizer(model.named_parameters(), cfg.train)
    for r in range(rounds):
        for kind in times if r % 2 == 0 else reversed(list(times)):
            t0 = time.perf_counter()
            opts[kind].step()
            times[kind].append(time.perf_counter() - t0)
    return {k: statistics.median(v[2:]) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench compile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="launches of each case, alternating")
    ap.add_argument("--layouts", default="1x1x1,2x2x1")
    ap.add_argument("--models", default="default,4x")
    ap.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"))
    ap.add_argument("--precision", default="fp32", choices=tuple(PRECISIONS), help="copies: bf16 working copies")
    ap.add_argument("--adamw-rounds", type=int, default=200, help="optimizer steps timed per kind (alternating)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cases = [
        (model, layout, v)
        for model in a.models.split(",")
        for layout in filter(None, a.layouts.split(","))  # --layouts "": AdamW's figures only
        for v in VARIANTS
        if v != "fused_adamw" or layout == "1x1x1"
    ]
    tmp = tempfile.mkdtemp(prefix="bench-compile-")
    # A fresh compile cache (unless one is given): the first round compiles from scratch, the next reuse it.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tmp, "inductor")))
    runs: dict[tuple, list[tuple[dict, float]]] = {c: [] for c in cases}
    for r in range(a.repeats):
        for c in cases:
            cfg = case_config(*c, a.backend, a.precision)
            load = os.getloadavg()[0]
            state = str(Path(tmp, f"{'-'.join(c)}-{r}.pt"))
            out = run_ranks(_worker, cfg.parallel.world_size, cfg.to_dict(), a.steps, state, timeout_s=600)
            runs[c].append((out[0], load))
            print(json.dumps({"case": c, "round": r, "times": out[0]["times"], "load": load}), flush=True)
    records = [_record(a, c, got, runs, tmp) for c, got in runs.items()]
    for model in a.models.split(","):
        load = os.getloadavg()[0]
        t = adamw_step_times(case_config(model, "1x1x1", "eager", a.backend), a.adamw_rounds)
        records.append(
            {"model": model, "variant": "adamw_step_only", "rounds": a.adamw_rounds, "load_avg_1m": load}
            | {f"{k}_step_s": v for k, v in t.items()}
            | {"fused_speedup_vs_foreach": t["foreach"] / t["fused"]}
        )
    emit(records, a.json)
    return 0


def _record(a: argparse.Namespace, c: tuple, got: list, runs: dict, tmp: str) -> dict:
    model, layout, variant = c
    cfg = case_config(*c, a.backend, a.precision)
    steady = [statistics.median(x["times"][2:]) for x, _ in got]
    t = statistics.median(steady)
    eager_runs = runs[(model, layout, "eager")]
    t_eager = statistics.median(statistics.median(x["times"][2:]) for x, _ in eager_runs)
    loss_diff = max(abs(u - v) for (x, _), (e, _) in zip(got, eager_runs) for u, v in zip(x["losses"], e["losses"]))
    return {
        "model": model,
        "dim": cfg.model.dim,
        "layout": layout,
        "variant": variant,
        "backend": a.backend if variant == "compile" else None,
        "precision": a.precision,
        "steps": a.steps,
        "step_time_s": t,
        "launches_s": steady,
        "tokens_per_s": cfg.train.global_batch * cfg.train.seq_len / t,
        "ratio_vs_eager": t_eager / t,
        "first_step_overhead_s": [x["times"][0] - s for (x, _), s in zip(got, steady)],
        "graphs_per_rank": got[0][0]["graphs"],
        "load_avg_1m": [ld for _, ld in got],
        "max_loss_diff_vs_eager": loss_diff,
        "max_param_diff_vs_eager": _param_diff(
            str(Path(tmp, f"{model}-{layout}-{variant}-0.pt")), str(Path(tmp, f"{model}-{layout}-eager-0.pt"))
        ),
    }
