"""hybridpar's pipeline runtime side by side with torch.distributed.pipelining, in one invocation.

    hybridpar bench pipeline [--mode compute|emulated|both] [--pp 2,4] [--microbatches 8]
        [--schedules gpipe,1f1b,interleaved-1f1b,zb-h1] [--virtual-stages 2] [--repeats 5] [--steps 4]
        [--f-ms 20 --b-ms 40 [--w-ms 20]] [--window-tail autograd|spin] [--act-kb 256] [--global-batch N] [--ping-pongs 200]
        [--trace-dir DIR] [--json FILE]   (or python -m hybridpar.bench.pipeline)

Per case (mode, schedule, pp) the ranks start once (dp = tp = 1, world = pp); each builds both
implementations over the same process group from the same seed: our `PipelineRuntime` on
`build_schedule(...)`, and torch's `PipelineStage` with `ScheduleGPipe` / `Schedule1F1B` /
`ScheduleInterleaved1F1B` / `ScheduleInterleavedZeroBubble` (zb-h1: with one stage per rank it is
ZB-H1, see TORCH_SCHEDULES), same stage placement, s on rank s % pp. After a loss and gradient check and
warm-up, timed repeats alternate (ours, torch, ours, ...) so machine noise hits both; a repeat is
`--steps` forward+backward steps (gradients zeroed between steps, no optimizer). Reported: median
steps/s, ratio hybridpar/torch (> 1: ours is faster), bubble 1 - busy / (pp * wall) and the theoretical
bubble. Busy is measured by one instrumentation on both: in emulated mode the length of the stages'
compute windows (`emulated.SleepLog`), in compute mode the time inside the stage modules (`emulated.Timed`; it
cannot see torch's zero-bubble W, so that bubble is not reported).

`compute` runs real Llama stages (uniform partition, default ModelConfig); `emulated` replaces each
stage's compute by sleeps (labelled emulation, emulated.py) while real activations of about `--act-kb`
KiB per microbatch travel. `--f-ms`/`--b-ms` are one microbatch's forward/backward time on one rank:
with v virtual stages each stage sleeps f/v and b/v, so every schedule does the same work per rank.
Zero-bubble schedules (zb-h1) split the backward: B sleeps b - w (the input gradient) and W sleeps w
(the weight gradient), w = `--w-ms`, by default b / 2; other schedules sleep b in one backward.

Prediction (latency.py): in the same ranks and run, the case measures its per-hop costs (hop latency
by ping-pong through the runtime's P2P class; per-action overhead, send/recv posting time, sleep
overshoot, step gap and message posting points from our timed steps), simulates the action lists our
runtime executed under them (pipeline/simulate.py) and reports `sim_step_time_s`, `sim_error`
(sim / measured - 1), the ideal `sim_ideal_step_time_s` and `sim_breakdown_s` (what each term adds).
`--trace-dir DIR` writes DIR/<case>.json per case: one timed step of ours, every rank, beside its
simulation (open in ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.batching.split import split_evenly
from hybridpar.bench.emulated import TAILS, BusyTimer, EmulatedStage, SleepLog, Timed, windowed_loss
from hybridpar.bench.latency import (RecordingP2P, StepSamples, neighbour_links, posted_lists, posting_points,
                                     predict, round_trips, summarize)
from hybridpar.config import ModelConfig
from hybridpar.pipeline.runtime import PipelineRuntime, token_cross_entropy
from hybridpar.pipeline.schedules import SCHEDULES, Action, build_schedule, bubble_fraction_theory
from hybridpar.pipeline.simulate import sim_trace
from hybridpar.report.trace import Slice, chrome_trace, merge_traces, write_trace
from hybridpar.testing import run_ranks

# zb-h1's peer: torch's ScheduleInterleavedZeroBubble ("ZB1P") with one stage per rank is our ZB-H1
# action for action: `_get_warmup_ops` gives rank r the 1F1B warm-up pp - 1 - r, and
# `_get_1f1b_rank_ops(enable_zero_bubble=True, num_1f1b_microbatches=r)` puts W(j) right after B(j + r)
# (torch 2.13 schedules.py), which is `schedules._defer_weights(order, r)`. One difference remains, in
# torch: stage 0 (whose input needs no gradient) runs nothing at B and its full backward at W.
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble"}
EMULATED_VOCAB = 16
LOSS_RTOL = 1e-5


@dataclass(frozen=True)
class Case:
    mode: str  # "compute" | "emulated"
    schedule: str
    pp: int
    v: int  # virtual stages per rank
    m: int  # microbatches
    global_batch: int
    seq_len: int
    steps: int
    repeats: int
    warmup: int
    f_ms: float | None
    b_ms: float | None
    w_ms: float | None  # zb-h1 only: the W share of b_ms (B sleeps b_ms - w_ms)
    act_kb: float | None
    layers: int | None
    seed: int
    timeout_s: float
    ping_pongs: int = 200  # round trips per link for the hop latency
    window_tail: str = "autograd"  # emulated: how a window ends (emulated.TAILS)

    @property
    def n_stages(self) -> int:
        return self.pp * self.v

    @property
    def hidden(self) -> int:
        if self.mode == "compute":
            return ModelConfig().dim
        b = math.ceil(self.global_batch / self.m)  # the largest microbatch carries act_kb
        return max(1, round(self.act_kb * 1024 / 4 / (b * self.seq_len)))


def _nominal_s(c: Case) -> dict[str, float]:
    """What one F / B / W action sleeps (0 in compute mode): f/v, (b - w)/v, w/v."""
    if c.mode != "emulated":
        return {"F": 0.0, "B": 0.0, "W": 0.0}
    w = c.w_ms or 0.0
    return {"F": c.f_ms / 1e3 / c.v, "B": (c.b_ms - w) / 1e3 / c.v, "W": w / 1e3 / c.v}


def _actions(c: Case) -> list[list[Action]]:
    """Every rank's action list, as the runtime executes it and the simulator replays it."""
    return build_schedule(c.schedule, c.pp, c.v, c.m, 1)


def _build(c: Case, s: int, device: torch.device, log: SleepLog | None = None) -> nn.Module:
    first, last = s == 0, s == c.n_stages - 1
    if c.mode == "emulated":
        t = _nominal_s(c)
        return EmulatedStage(first, last, EMULATED_VOCAB, c.hidden, t["F"], t["B"], seed=c.seed * 1000 + s,
                             w_s=t["W"], log=log, loss_in_window=last, tail=c.window_tail).to(device)
    from hybridpar.model.llama import build_stage
    from hybridpar.pipeline.partition import partition_uniform

    cfg = ModelConfig(n_layers=c.layers)
    return build_stage(cfg, partition_uniform(c.layers, c.n_stages)[s], first, last, c.seed, device)


def _batch(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = EMULATED_VOCAB if c.mode == "emulated" else ModelConfig().vocab_size
    tok = torch.randint(vocab, (c.global_batch, c.seq_len + 1), generator=torch.Generator().manual_seed(c.seed))
    return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()  # (B, T) inputs, (B, T) targets


def _torch_schedule(c: Case, stages: dict[int, nn.Module], group: dist.ProcessGroup, device: torch.device,
                    loss_fn) -> tuple[object | None, str | None]:
    """torch's schedule over this rank's stages, or (None, why torch cannot run this case)."""
    if c.schedule not in TORCH_SCHEDULES:
        return None, f"torch.distributed.pipelining has no {c.schedule!r} schedule"
    if c.global_batch % c.m:
        # torch splits the batch itself (tensor_split) and infers every message shape from the first
        # microbatch, so unequal microbatches are not supported.
        return None, f"global batch {c.global_batch} is not divisible by {c.m} microbatches"
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    pstages = [PipelineStage(stages[s], s, c.n_stages, device, group=group) for s in sorted(stages)]
    cls = getattr(ts, TORCH_SCHEDULES[c.schedule])
    multi = issubclass(cls, ts.PipelineScheduleMulti)
    try:
        # scale_grads=False: our loss is already sum-CE / tokens-in-batch (torch's default divides by m).
        return cls(pstages if multi else pstages[0], c.m, loss_fn=loss_fn, scale_grads=False), None
    except (ValueError, RuntimeError) as e:
        return None, f"{type(e).__name__}: {e}"


def _case_worker(cd: dict) -> dict:
    """One rank of a case: build both implementations, check them, measure the per-hop costs, time
    alternating repeats."""
    from hybridpar.pipeline.p2p import P2P
    from hybridpar.report.step_trace import step_slices
    from hybridpar.topology.mesh import build_topology

    c = Case(**cd)
    topo = build_topology(1, c.pp, 1, "gloo", c.timeout_s)
    r, dev, n = topo.pp_rank, topo.device, c.n_stages
    local = [k * c.pp + r for k in range(c.v)]  # stage s lives on pp rank s % pp (both implementations)
    emulated = c.mode == "emulated"
    timer, log = BusyTimer(), SleepLog()
    # Emulated: busy time is the time slept (SleepLog), for both implementations alike; compute: the
    # Timed instrumentation around each stage module.
    wrap = (lambda mod: mod) if emulated else (lambda mod: Timed(mod, timer))
    ours = {s: wrap(_build(c, s, dev, log)) for s in local}
    theirs = {s: wrap(_build(c, s, dev, log)) for s in local}  # same seed: identical parameters
    x, y = _batch(c)
    sizes = split_evenly(c.global_batch, c.m)
    xs, ys = list(torch.split(x, sizes)), list(torch.split(y, sizes))
    scale = 1.0 / (c.global_batch * c.seq_len)

    actions = _actions(c)[r]
    p2p = RecordingP2P(dev, torch.float32, c.timeout_s)
    # One loss for both, the runtime's; emulated, it runs inside the last stage's windows.
    loss_ours = loss_theirs = token_cross_entropy
    if emulated and n - 1 in local:
        loss_ours, loss_theirs = windowed_loss(ours[n - 1], loss_ours), windowed_loss(theirs[n - 1], loss_theirs)
    runtime = PipelineRuntime(ours, n, lambda s: topo.pp_peer(s % c.pp), p2p, c.hidden, loss_ours)
    timeline_busy = [0.0, 0.0]  # ours only: [compute actions minus receive waits inside them, W actions]
    samples = StepSamples()
    last_out: list = [None]  # StepOutput of our latest step
    posted_at: list = [None]  # posting_points of our latest timed step

    def step_ours() -> float | None:
        out = runtime.run(actions, xs, ys, scale)
        timeline_busy[0] += (sum(t.end - t.start for t in out.timeline if t.action.is_compute)
                             - sum(w.end - w.start for w in out.waits))
        # W (zero-bubble weight gradients) runs outside autograd, where Timed cannot see it: add its time.
        timeline_busy[1] += sum(t.end - t.start for t in out.timeline if t.action.op.value == "W")
        last_out[0] = out
        return None if out.loss is None else float(out.loss)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_theirs(out, target, scale)

    sched, torch_error = _torch_schedule(c, theirs, topo.group("pp"), dev, loss_fn)
    first, last = 0 in local, n - 1 in local

    def step_torch() -> float | None:
        losses: list[torch.Tensor] = []
        kwargs = {"target": y, "losses": losses} if last else {}
        sched.step(*((x,) if first else ()), return_outputs=False, **kwargs)
        return float(sum(l.detach() for l in losses)) if last else None

    def zero(mods: dict[int, nn.Module]) -> None:
        for mod in mods.values():
            for p in mod.parameters():
                p.grad = None

    def measure(step_fn, mods, collect: bool) -> list[float]:
        dist.barrier()
        timer.reset()
        log.clear()
        timeline_busy[:] = [0.0, 0.0]
        t0 = time.perf_counter()
        for _ in range(c.steps):
            n0, k0, ts = len(log.entries), len(p2p.posts), time.perf_counter()
            zero(mods)
            step_fn()
            if collect:  # ours: per-action costs of this step (the step's own sleeps and waits)
                out = last_out[0]
                samples.add_step(out.timeline, out.waits, log.entries[n0:], ts, time.perf_counter())
                posted_at[0] = posting_points(out.timeline, p2p.posts[k0:])
            p2p.posts.clear()
        timer.close()
        busy = log.busy_s() if emulated else timer.busy + timeline_busy[1]
        dist.barrier()
        return [time.perf_counter() - t0, busy, timeline_busy[0]]

    res: dict = {"rank": r, "torch_error": torch_error, "loss_ours": None, "loss_torch": None,
                 "grad_rel_diff": None, "ours": [], "torch": []}
    zero(ours)
    res["loss_ours"] = step_ours()
    if sched is not None:
        zero(theirs)
        res["loss_torch"] = step_torch()
        diff = ref = 0.0
        for s in local:
            for po, pt in zip(ours[s].parameters(), theirs[s].parameters()):
                diff = max(diff, float((po.grad - pt.grad).abs().max()))
                ref = max(ref, float(po.grad.abs().max()))
        res["grad_rel_diff"] = diff / max(ref, 1e-30)
    for _ in range(c.warmup - 1):
        step_ours()
        if sched is not None:
            step_torch()
    # Per-hop latency on the live group with the runtime's P2P class: a slice before each timed repeat.
    shape = (max(sizes), c.seq_len, c.hidden)  # (b, T, hidden): the largest activation message
    probe, rtts = P2P(dev, torch.float32, c.timeout_s), {}
    for _ in range(c.repeats):
        round_trips(probe, r, neighbour_links(c.pp, c.v), topo.pp_peer, shape, dist.barrier,
                    max(1, c.ping_pongs // c.repeats), into=rtts)
        res["ours"].append(measure(step_ours, ours, True))
        if sched is not None:
            res["torch"].append(measure(step_torch, theirs, False))
    res["round_trips"], res["posted_at"] = rtts, posted_at[0]
    res["samples"] = samples.to_dict()
    res["trace"] = step_slices(last_out[0], r, 0)  # the last timed step of ours
    return res


def _stats(c: Case, ranks: list[dict], key: str) -> tuple[float | None, float | None, float | None, list[float]]:
    """Median steps/s, bubble (busy timer) and bubble (our timeline) over repeats; steps/s per repeat."""
    reps = list(zip(*(rk[key] for rk in ranks)))  # per repeat: one [wall, busy, timeline busy] per rank
    if not reps:
        return None, None, None, []
    walls = [max(x[0] for x in rep) for rep in reps]
    sps = [c.steps / w for w in walls]
    bub = [1 - sum(x[1] for x in rep) / (c.pp * w) for rep, w in zip(reps, walls)]
    tl = [1 - sum(x[2] for x in rep) / (c.pp * w) for rep, w in zip(reps, walls)]
    return statistics.median(sps), statistics.median(bub), statistics.median(tl), sps


def _case_timeout(c: Case) -> float:
    steps = 2 * (c.warmup + c.repeats * c.steps)
    probe = 60 + c.pp * c.ping_pongs * 0.01  # hop latency: a round trip well under 10 ms
    if c.mode == "compute":
        return 120 + probe + steps * 5.0
    step_s = (c.m * c.v + c.pp - 1) * (c.f_ms + c.b_ms) / c.v / 1e3 + 0.05
    return 120 + probe + 3 * steps * step_s


def _theory(c: Case) -> float | None:
    try:
        if c.schedule == "zb-h1" and c.mode == "emulated":
            t = _nominal_s(c)
            return bubble_fraction_theory(c.schedule, c.pp, c.v, c.m, t_f=t["F"], t_b=t["B"], t_w=t["W"])
        return bubble_fraction_theory(c.schedule, c.pp, c.v, c.m)
    except ValueError:
        return None


def case_name(c: Case) -> str:
    return f"{c.mode}-{c.schedule}-pp{c.pp}-v{c.v}-m{c.m}"


def _write_trace(c: Case, ranks: list[dict], sim, trace_dir: str) -> str:
    """One timed step of ours (every rank's slices, returned through run_ranks) beside its simulation."""
    measured = chrome_trace([Slice(**row) for rk in ranks for row in rk["trace"]],
                            process_name="measured (hybridpar runtime, one timed step)", pid=0)
    path = Path(trace_dir) / f"{case_name(c)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trace(merge_traces(measured, sim_trace(sim, "simulated (measured costs)", pid=1)), str(path))
    return str(path)


def run_case(c: Case, trace_dir: str | None = None) -> dict:
    load_before = os.getloadavg()  # the machine's load: other jobs on few cores bend every timing
    ranks = run_ranks(_case_worker, c.pp, asdict(c), timeout_s=_case_timeout(c))
    load_after = os.getloadavg()
    ours_sps, ours_bub, ours_tl, ours_all = _stats(c, ranks, "ours")
    t_sps, t_bub, _, t_all = _stats(c, ranks, "torch")
    if c.schedule == "zb-h1" and c.mode == "compute":
        t_bub = None  # Timed cannot see torch's W (autograd.grad from saved intermediates, no output mark)
    lo, lt = ranks[-1]["loss_ours"], ranks[-1]["loss_torch"]  # rank pp-1 holds the last stage
    rel = abs(lo - lt) / max(abs(lo), 1e-30) if lt is not None else None
    grads = [rk["grad_rel_diff"] for rk in ranks if rk["grad_rel_diff"] is not None]
    costs = summarize([rk["samples"] for rk in ranks], [rk["round_trips"] for rk in ranks])
    acts = _actions(c)
    pred, sim = predict(acts, c.pp, c.n_stages, _nominal_s(c), costs,
                        posted_lists(acts, [rk["posted_at"] for rk in ranks]))
    if c.mode != "emulated":
        pred["sim_bubble"] = None  # busy is the compute itself: nothing to set apart from overhead
    measured = 1 / ours_sps
    rec = {
        "mode": c.mode, "schedule": c.schedule, "pp": c.pp, "virtual_stages": c.v, "microbatches": c.m,
        "global_batch": c.global_batch, "seq_len": c.seq_len, "steps": c.steps, "repeats": c.repeats,
        "f_ms": c.f_ms, "b_ms": c.b_ms, "w_ms": c.w_ms, "window_tail": c.window_tail if c.mode == "emulated" else None,
        "act_kb": (c.hidden * c.seq_len * math.ceil(c.global_batch / c.m) * 4 / 1024
                   if c.mode == "emulated" else None),
        "layers": c.layers,
        "hybridpar_steps_per_s": ours_sps, "torch_steps_per_s": t_sps,
        "ratio": ours_sps / t_sps if t_sps else None,
        "bubble_measured": ours_bub, "hybridpar_bubble_timeline": ours_tl, "torch_bubble_measured": t_bub,
        "bubble_theory": _theory(c),
        "loss_hybridpar": lo, "loss_torch": lt, "loss_rel_diff": rel,
        "loss_match": None if rel is None else rel <= LOSS_RTOL,
        "grad_rel_diff": max(grads) if grads else None,
        "torch_error": ranks[0]["torch_error"],
        "hybridpar_steps_per_s_repeats": ours_all, "torch_steps_per_s_repeats": t_all,
        "load_avg_before": list(load_before), "load_avg_after": list(load_after),
        "measured_step_time_s": measured,
        **costs, **pred,
        "sim_error": pred["sim_step_time_s"] / measured - 1,
        "trace_file": _write_trace(c, ranks, sim, trace_dir) if trace_dir else None,
    }
    return rec


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(records: list[dict]) -> str:
    head = (f"{'mode':<9}{'schedule':<18}{'pp':>3}{'v':>3}{'m':>4}{'ours st/s':>11}{'torch st/s':>12}"
            f"{'ratio':>8}{'bubble ours':>13}{'torch':>8}{'theory':>8}  loss match")
    lines = [head, "-" * len(head)]
    for r in records:
        match = "-" if r["loss_match"] is None else f"{r['loss_match']} ({r['loss_rel_diff']:.1e})"
        lines.append(f"{r['mode']:<9}{r['schedule']:<18}{r['pp']:>3}{r['virtual_stages']:>3}{r['microbatches']:>4}"
                     f"{_f(r['hybridpar_steps_per_s'], '.3f'):>11}{_f(r['torch_steps_per_s'], '.3f'):>12}"
                     f"{_f(r['ratio'], '.3f'):>8}{_f(r['bubble_measured'], '.3f'):>13}"
                     f"{_f(r['torch_bubble_measured'], '.3f'):>8}{_f(r['bubble_theory'], '.3f'):>8}  {match}")
        if r["torch_error"]:
            lines.append(f"{'':<9}torch not run: {r['torch_error']}")
    return "\n".join(lines)


def format_prediction(records: list[dict]) -> str:
    """The simulator fed with the measured per-hop costs vs. the measured step (ours), in ms / us."""
    head = (f"{'schedule':<18}{'pp':>3}{'m':>4}{'meas ms':>9}{'sim ms':>9}{'err %':>7}{'ideal':>8}"
            f"{'+lat':>7}{'+shoot':>7}{'+ovh':>7}{'+post':>7}{'+gap':>7}{'hop us':>8}  overshoot us F/B/W  overhead us F/B/W"
            f"  send/recv us")
    lines = [head, "-" * len(head)]
    us = lambda d: "/".join(f"{d[k] * 1e6:.0f}" if k in d else "-" for k in "FBW")  # noqa: E731
    for r in records:
        bd = r["sim_breakdown_s"]
        lines.append(f"{r['schedule']:<18}{r['pp']:>3}{r['microbatches']:>4}{r['measured_step_time_s'] * 1e3:>9.1f}"
                     f"{r['sim_step_time_s'] * 1e3:>9.1f}{r['sim_error'] * 100:>7.1f}{bd['ideal'] * 1e3:>8.1f}"
                     + "".join(f"{bd[k] * 1e3:>7.2f}" for k in ("hop_latency", "sleep_overshoot", "action_overhead",
                                                               "posting_delay", "step_gap"))
                     + f"{r['hop_latency_s'] * 1e6:>8.0f}  {us(r['sleep_overshoot_s']):>18}"
                       f"  {us(r['compute_overhead_s']):>17}  {r['send_overhead_s'] * 1e6:.0f}/{r['recv_overhead_s'] * 1e6:.0f}")
    return "\n".join(lines)


def make_cases(a: argparse.Namespace) -> list[Case]:
    """Every case of the invocation, validated (ValueError naming the problem) before any process starts."""
    modes = ["compute", "emulated"] if a.mode == "both" else [a.mode]
    scheds = [s for s in a.schedules.split(",") if s]
    for name, val in (("--repeats", a.repeats), ("--steps", a.steps), ("--warmup", a.warmup),
                      ("--microbatches", a.microbatches), ("--virtual-stages", a.virtual_stages),
                      ("--ping-pongs", a.ping_pongs)):
        if val < 1:
            raise ValueError(f"{name} must be at least 1, got {val}")
    if any(p < 2 for p in a.pp):
        raise ValueError(f"--pp values must be at least 2 (a pipeline), got {a.pp}")
    if a.f_ms < 0 or a.b_ms < 0 or a.act_kb <= 0:
        raise ValueError(f"--f-ms/--b-ms must be >= 0 and --act-kb > 0, got {a.f_ms}/{a.b_ms}/{a.act_kb}")
    w_ms = a.b_ms / 2 if a.w_ms is None else a.w_ms
    if not 0 <= w_ms <= a.b_ms:
        raise ValueError(f"--w-ms must be between 0 and --b-ms {a.b_ms}, got {w_ms}")
    gb = a.global_batch or 2 * a.microbatches
    if gb < a.microbatches:
        raise ValueError(f"--global-batch {gb} is smaller than --microbatches {a.microbatches}")
    vs = {s: (a.virtual_stages if s == "interleaved-1f1b" else 1) for s in scheds}
    layers = a.layers or max([ModelConfig().n_layers] + [p * v for p in a.pp for v in vs.values()])
    cases = []
    for mode in modes:
        for pp in a.pp:
            for s in scheds:
                acts = build_schedule(s, pp, vs[s], a.microbatches)  # raises ValueError for a bad combination
                if mode == "compute" and layers < pp * vs[s]:
                    raise ValueError(f"--layers {layers} is fewer than the {pp * vs[s]} stages of {s} with pp={pp}")
                em = mode == "emulated"
                split = any(x.op.value == "W" for x in acts[0])
                cases.append(Case(mode, s, pp, vs[s], a.microbatches, gb, a.seq_len, a.steps, a.repeats, a.warmup,
                                  a.f_ms if em else None, a.b_ms if em else None, w_ms if em and split else None,
                                  a.act_kb if em else None, None if em else layers, a.seed, a.timeout,
                                  a.ping_pongs, a.window_tail))
    return cases


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="hybridpar bench pipeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("compute", "emulated", "both"), default="emulated")
    ap.add_argument("--pp", type=lambda v: [int(x) for x in v.split(",") if x], default=[2, 4], help="pipeline sizes, comma-separated")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b", help=f"comma-separated of {SCHEDULES}")
    ap.add_argument("--virtual-stages", type=int, default=2, help="stages per rank for interleaved-1f1b")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per implementation (median)")
    ap.add_argument("--steps", type=int, default=4, help="steps per repeat")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation (first one checked)")
    ap.add_argument("--f-ms", type=float, default=20.0, help="emulated forward ms per microbatch per rank")
    ap.add_argument("--b-ms", type=float, default=40.0, help="emulated backward ms per microbatch per rank")
    ap.add_argument("--w-ms", type=float, default=None,
                    help="zero-bubble schedules: the weight-gradient share (W) of --b-ms; B sleeps the rest "
                         "(default: half of --b-ms)")
    ap.add_argument("--window-tail", choices=TAILS, default="autograd",
                    help="emulated: what a window's last ms runs: tiny autograd work (caches as warm as "
                         "after real compute) or a bare spin (see emulated.TAILS)")
    ap.add_argument("--act-kb", type=float, default=256.0, help="emulated activation KiB per microbatch")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step (default 2 x microbatches)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=None,
                    help="compute mode: decoder layers (default: ModelConfig's, raised to the most stages)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="bound in seconds on every collective / P2P wait")
    ap.add_argument("--ping-pongs", type=int, default=200,
                    help="round trips per link for the hop latency (spread over the repeats)")
    ap.add_argument("--trace-dir", default=None,
                    help="write per case DIR/<case>.json: one timed step of ours beside its simulation (Perfetto)")
    ap.add_argument("--json", default=None, help="write the records to FILE ('-': stdout)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cases = make_cases(a)
    except ValueError as e:
        print(f"hybridpar: error: {e}", file=sys.stderr)
        return 2
    if not cases:
        print("hybridpar: error: no case to run", file=sys.stderr)
        return 2
    records = []
    for i, c in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {c.mode} {c.schedule} pp={c.pp} v={c.v} m={c.m} ...", file=sys.stderr, flush=True)
        records.append(run_case(c, a.trace_dir))
    print(format_table(records))
    print()
    print(format_prediction(records))
    if a.json == "-":
        print(json.dumps(records, indent=1))
    elif a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from hybridpar.bench.pipeline import main as _main  # workers must pickle as hybridpar.bench.pipeline.*

    sys.exit(_main())
