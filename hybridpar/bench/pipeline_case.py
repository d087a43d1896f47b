"""One case of `hybridpar bench pipeline` (see pipeline.py): the ranks build both implementations,
check that they agree, measure the per-hop costs and time alternating repeats; `run_case` gathers the
ranks' results into one record with its simulation."""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.batching.order import pipeline_order
from hybridpar.batching.split import split_evenly
from hybridpar.bench.critical_path import Window, critical_path, per_step, windows_of
from hybridpar.bench.emulated import BusyTimer, EmulatedStage, SleepLog, Timed, windowed_loss
from hybridpar.bench.latency import (
    RecordingP2P,
    StepSamples,
    neighbour_links,
    posted_lists,
    posting_points,
    predict,
    round_trips,
    summarize,
)
from hybridpar.config import ModelConfig
from hybridpar.pipeline.runtime import PipelineRuntime, token_cross_entropy
from hybridpar.pipeline.schedules import Action, Op, bubble_fraction_theory, build_schedule, schedule_spec
from hybridpar.pipeline.simulate import sim_trace
from hybridpar.pipeline.trace import Slice, chrome_trace, merge_traces, write_trace
from hybridpar.topology.spawn import run_ranks

if TYPE_CHECKING:
    from hybridpar.topology.mesh import Topology

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
    w_ms: float | None  # schedules that split the backward only: the W share of b_ms (B sleeps b_ms - w_ms)
    act_kb: float | None
    layers: int | None
    seed: int
    timeout_s: float
    ping_pongs: int = 200  # round trips per link for the hop latency
    window_tail: str = "autograd"  # emulated: how a window ends (emulated.TAILS)
    p2p: str = "auto"  # our runtime's message transport (pipeline/shm.py transport_for)
    cpu_bind: str = "none"  # each rank's cores, for both implementations (topology/cpus.py)
    backend: str = "gloo"  # "nccl": one GPU per rank (compute mode on CUDA)

    @property
    def n_stages(self) -> int:
        return self.pp * self.v

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """The pipeline rank of each stage: the schedule's placement, for both implementations."""
        return schedule_spec(self.schedule).stage_ranks(self.pp, self.v)

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
        return EmulatedStage(
            first,
            last,
            EMULATED_VOCAB,
            c.hidden,
            t["F"],
            t["B"],
            seed=c.seed * 1000 + s,
            w_s=t["W"],
            log=log,
            loss_in_window=last,
            tail=c.window_tail,
        ).to(device)
    from hybridpar.model.registry import build_stage
    from hybridpar.pipeline.partition import partition_uniform

    cfg = ModelConfig(n_layers=c.layers)
    return build_stage(cfg, partition_uniform(c.layers, c.n_stages)[s], first, last, c.seed, device)


def _batch(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = EMULATED_VOCAB if c.mode == "emulated" else ModelConfig().vocab_size
    tok = torch.randint(vocab, (c.global_batch, c.seq_len + 1), generator=torch.Generator().manual_seed(c.seed))
    return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()  # (B, T) inputs, (B, T) targets


def _torch_schedule(
    c: Case, stages: dict[int, nn.Module], group: dist.ProcessGroup, device: torch.device, loss_fn
) -> tuple[object | None, str | None]:
    """torch's schedule over this rank's stages, or (None, why torch cannot run this case)."""
    peer = schedule_spec(c.schedule).torch_peer  # a class name: the registry cannot import torch
    if peer is None:
        return None, f"torch.distributed.pipelining has no {c.schedule!r} schedule"
    if c.global_batch % c.m:
        # torch splits the batch itself (tensor_split) and infers every message shape from the first
        # microbatch, so unequal microbatches are not supported.
        return None, f"global batch {c.global_batch} is not divisible by {c.m} microbatches"
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    pstages = [PipelineStage(stages[s], s, c.n_stages, device, group=group) for s in sorted(stages)]
    cls = getattr(ts, peer)
    multi = issubclass(cls, ts.PipelineScheduleMulti)
    try:
        # scale_grads=False: our loss is already sum-CE / tokens-in-batch (torch's default divides by m).
        return cls(pstages if multi else pstages[0], c.m, loss_fn=loss_fn, scale_grads=False), None
    except (ValueError, RuntimeError) as e:
        return None, f"{type(e).__name__}: {e}"


def _case_worker(cd: dict) -> dict:
    """One rank of a case: build both implementations, check them, measure the per-hop costs, time
    alternating repeats."""
    from hybridpar.topology.cpus import bind_local_rank
    from hybridpar.topology.mesh import build_topology

    c = Case(**cd)
    bind_local_rank(c.cpu_bind)  # before the process group starts its threads
    topo = build_topology(1, c.pp, 1, c.backend, c.timeout_s)
    rank = _CaseRank(c, topo)
    res = rank.check()
    rank.timed(res)
    return res


def _zero(mods: dict[int, nn.Module]) -> None:
    for mod in mods.values():
        for p in mod.parameters():
            p.grad = None


class _CaseRank:
    """One rank's share of a case: both implementations over the same stages and batch, and what our
    timed steps recorded (busy times, per-action samples, critical-path windows, posting points)."""

    def __init__(self, c: Case, topo: Topology) -> None:
        self.c, self.topo = c, topo
        r, dev, n = topo.pp_rank, topo.device, c.n_stages
        self.r, self.dev = r, dev
        self.local = local = [s for s, rank in enumerate(c.stage_ranks) if rank == r]  # the same placement for both
        self.emulated = c.mode == "emulated"
        self.timer, self.log = BusyTimer(), SleepLog()
        # Emulated: busy time is the time slept (SleepLog), for both implementations alike; compute: the
        # Timed instrumentation around each stage module.
        wrap = (lambda mod: mod) if self.emulated else (lambda mod: Timed(mod, self.timer))
        self.ours = {s: wrap(_build(c, s, dev, self.log)) for s in local}
        self.theirs = {s: wrap(_build(c, s, dev, self.log)) for s in local}  # same seed: identical parameters
        self.x, self.y = (t.to(dev) for t in _batch(c))
        # The order our runtime runs unequal microbatches in (torch's schedules cannot run them at all).
        self.sizes = pipeline_order(split_evenly(c.global_batch, c.m), c.schedule, c.pp, c.v)
        self.xs, self.ys = list(torch.split(self.x, self.sizes)), list(torch.split(self.y, self.sizes))
        self.scale = 1.0 / (c.global_batch * c.seq_len)

        self.actions = _actions(c)[r]
        self.p2p = RecordingP2P(dev, torch.float32, c.timeout_s, transport=c.p2p)
        # One loss for both, the runtime's; emulated, it runs inside the last stage's windows.
        loss_ours = self.loss_theirs = token_cross_entropy
        if self.emulated and n - 1 in local:
            loss_ours = windowed_loss(self.ours[n - 1], loss_ours)
            self.loss_theirs = windowed_loss(self.theirs[n - 1], self.loss_theirs)
        self.runtime = PipelineRuntime(
            self.ours, n, lambda s: topo.pp_peer(c.stage_ranks[s]), self.p2p, c.hidden, loss_ours
        )
        self.timeline_busy = [0.0, 0.0]  # ours only: [compute actions minus receive waits inside them, W actions]
        self.samples = StepSamples()
        self.last_out = None  # StepOutput of our latest step
        self.posted_at = None  # posting_points of our latest timed step
        self.path_steps: list = []  # ours, every timed step: (start, end, windows, waits) for critical_path
        self.sched, self.torch_error = _torch_schedule(c, self.theirs, topo.group("pp"), dev, self.torch_loss)
        self.first, self.last = 0 in local, n - 1 in local

    def step_ours(self) -> float | None:
        out = self.runtime.run(self.actions, self.xs, self.ys, self.scale)
        self.timeline_busy[0] += sum(t.end - t.start for t in out.timeline if t.action.is_compute) - sum(
            w.end - w.start for w in out.waits
        )
        # W (zero-bubble weight gradients) runs outside autograd, where Timed cannot see it: add its time.
        self.timeline_busy[1] += sum(t.end - t.start for t in out.timeline if t.action.op.value == "W")
        self.last_out = out
        return None if out.loss is None else float(out.loss)

    def torch_loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_theirs(out, target, self.scale)

    def step_torch(self) -> float | None:
        losses: list[torch.Tensor] = []
        kwargs = {"target": self.y, "losses": losses} if self.last else {}
        self.sched.step(*((self.x,) if self.first else ()), return_outputs=False, **kwargs)
        return float(sum(loss.detach() for loss in losses)) if self.last else None

    def collect(self, n0: int, k0: int, ts: float) -> None:
        """Ours, after a timed step that started at `ts`: its per-action costs (its own sleeps from log entry
        `n0` on, and waits), its critical-path windows (emulated) and its posting points (from post `k0`)."""
        out, log = self.last_out, self.log
        te = time.perf_counter()
        self.samples.add_step(out.timeline, out.waits, log.entries[n0:], ts, te)
        if self.emulated:
            k = len(self.path_steps)
            self.path_steps.append(
                (
                    ts,
                    te,
                    [_row(w) for w in windows_of(out.timeline, log.entries[n0:], k)],
                    [_row(Window(w.action, 0.0, w.start, w.end, k)) for w in out.waits],
                )
            )
        self.posted_at = posting_points(out.timeline, self.p2p.posts[k0:])

    def measure(self, step_fn, mods, collect: bool) -> list[float]:
        """One timed repeat of `c.steps` steps: [wall seconds, busy seconds, our timeline's compute seconds]."""
        dist.barrier()
        self.timer.reset()
        self.log.clear()
        self.timeline_busy[:] = [0.0, 0.0]
        t0 = time.perf_counter()
        for _ in range(self.c.steps):
            n0, k0, ts = len(self.log.entries), len(self.p2p.posts), time.perf_counter()
            _zero(mods)
            step_fn()
            if collect:
                self.collect(n0, k0, ts)
            self.p2p.posts.clear()
        self.timer.close()
        busy = self.log.busy_s() if self.emulated else self.timer.busy + self.timeline_busy[1]
        dist.barrier()
        return [time.perf_counter() - t0, busy, self.timeline_busy[0]]

    def check(self) -> dict:
        """The rank's record, begun with one step of each implementation: their losses and how far their
        gradients differ."""
        res: dict = {
            "rank": self.r,
            "device": self.dev.type,
            "torch_error": self.torch_error,
            "loss_ours": None,
            "loss_torch": None,
            "grad_rel_diff": None,
            "ours": [],
            "torch": [],
        }
        _zero(self.ours)
        res["loss_ours"] = self.step_ours()
        if self.sched is not None:
            _zero(self.theirs)
            res["loss_torch"] = self.step_torch()
            diff = ref = 0.0
            for s in self.local:
                for po, pt in zip(self.ours[s].parameters(), self.theirs[s].parameters()):
                    diff = max(diff, float((po.grad - pt.grad).abs().max()))
                    ref = max(ref, float(po.grad.abs().max()))
            res["grad_rel_diff"] = diff / max(ref, 1e-30)
        return res

    def timed(self, res: dict) -> None:
        """Warm-up, then the timed repeats alternating the implementations, each after a slice of the per-hop
        latency measurement; into `res`."""
        from hybridpar.pipeline.p2p import P2P
        from hybridpar.report.step_trace import step_slices

        c, sched = self.c, self.sched
        for _ in range(c.warmup - 1):
            self.step_ours()
            if sched is not None:
                self.step_torch()
        # Per-hop latency on the live group with the runtime's P2P class: a slice before each timed repeat.
        shape = (max(self.sizes), c.seq_len, c.hidden)  # (b, T, hidden): the largest activation message
        probe, rtts = P2P(self.dev, torch.float32, c.timeout_s, transport=c.p2p), {}
        for _ in range(c.repeats):
            round_trips(
                probe,
                self.r,
                neighbour_links(c.stage_ranks),
                self.topo.pp_peer,
                shape,
                dist.barrier,
                max(1, c.ping_pongs // c.repeats),
                into=rtts,
            )
            res["ours"].append(self.measure(self.step_ours, self.ours, True))
            if sched is not None:
                res["torch"].append(self.measure(self.step_torch, self.theirs, False))
        res["round_trips"], res["posted_at"], res["p2p"] = rtts, self.posted_at, self.p2p.transport
        probe.close()
        self.p2p.close()
        res["samples"], res["path_steps"] = self.samples.to_dict(), self.path_steps
        res["trace"] = step_slices(self.last_out, self.r, 0)  # the last timed step of ours


def _row(w: Window) -> list:
    return [w.action.stage, w.action.op.value, w.action.microbatch, w.requested, w.start, w.end, w.step]


def _window(row: list) -> Window:
    return Window(Action(row[0], Op(row[1]), row[2]), *row[3:])


def _critical(c: Case, ranks: list[dict]) -> dict | None:
    """Our timed steps' critical path (emulated) per step: one walk per repeat, over all its steps."""
    steps = list(zip(*(rk["path_steps"] for rk in ranks)))  # steps[k][r]: rank r's step k
    if not steps:
        return None
    paths = []
    for j in range(0, len(steps), c.steps):
        run = steps[j : j + c.steps]
        paths.append(
            critical_path(
                [[_window(x) for st in run for x in st[r][2]] for r in range(c.pp)],
                [[_window(x) for st in run for x in st[r][3]] for r in range(c.pp)],
                min(st[0] for st in run[0]),
                max(st[1] for st in run[-1]),
            )
        )
    return per_step(paths, c.steps)


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
        if schedule_spec(c.schedule).splits_backward and c.mode == "emulated":
            t = _nominal_s(c)
            return bubble_fraction_theory(c.schedule, c.pp, c.v, c.m, t_f=t["F"], t_b=t["B"], t_w=t["W"])
        return bubble_fraction_theory(c.schedule, c.pp, c.v, c.m)
    except ValueError:
        return None


def case_name(c: Case) -> str:
    return f"{c.mode}-{c.schedule}-pp{c.pp}-v{c.v}-m{c.m}"


def _write_trace(c: Case, ranks: list[dict], sim, trace_dir: str) -> str:
    """One timed step of ours (every rank's slices, returned through run_ranks) beside its simulation."""
    measured = chrome_trace(
        [Slice(**row) for rk in ranks for row in rk["trace"]],
        process_name="measured (hybridpar runtime, one timed step)",
        pid=0,
    )
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
    if schedule_spec(c.schedule).splits_backward and c.mode == "compute":
        t_bub = None  # Timed cannot see torch's W (autograd.grad from saved intermediates, no output mark)
    if ranks[0]["device"] == "cuda":
        # Timed reads the host clock around kernel launches, not the kernels: no busy time, no bubble. The
        # steps/s stay right: each repeat ends at a barrier, which waits for the device.
        ours_bub = ours_tl = t_bub = None
    last = ranks[c.stage_ranks[-1]]  # the rank holding the last stage: pp - 1, or 0 in a V
    lo, lt = last["loss_ours"], last["loss_torch"]
    rel = abs(lo - lt) / max(abs(lo), 1e-30) if lt is not None else None
    grads = [rk["grad_rel_diff"] for rk in ranks if rk["grad_rel_diff"] is not None]
    costs = summarize([rk["samples"] for rk in ranks], [rk["round_trips"] for rk in ranks])
    acts = _actions(c)
    pred, sim = predict(
        acts, c.pp, c.stage_ranks, _nominal_s(c), costs, posted_lists(acts, [rk["posted_at"] for rk in ranks])
    )
    if c.mode != "emulated":
        pred["sim_bubble"] = None  # busy is the compute itself: nothing to set apart from overhead
    measured = 1 / ours_sps
    rec = {
        "mode": c.mode,
        "schedule": c.schedule,
        "pp": c.pp,
        "virtual_stages": c.v,
        "microbatches": c.m,
        "global_batch": c.global_batch,
        "seq_len": c.seq_len,
        "steps": c.steps,
        "repeats": c.repeats,
        "f_ms": c.f_ms,
        "b_ms": c.b_ms,
        "w_ms": c.w_ms,
        "window_tail": c.window_tail if c.mode == "emulated" else None,
        "p2p": ranks[0]["p2p"],
        "cpu_bind": c.cpu_bind,
        "backend": c.backend,
        "act_kb": (c.hidden * c.seq_len * math.ceil(c.global_batch / c.m) * 4 / 1024 if c.mode == "emulated" else None),
        "layers": c.layers,
        "hybridpar_steps_per_s": ours_sps,
        "torch_steps_per_s": t_sps,
        "ratio": ours_sps / t_sps if t_sps else None,
        "bubble_measured": ours_bub,
        "hybridpar_bubble_timeline": ours_tl,
        "torch_bubble_measured": t_bub,
        "bubble_theory": _theory(c),
        "loss_hybridpar": lo,
        "loss_torch": lt,
        "loss_rel_diff": rel,
        "loss_match": None if rel is None else rel <= LOSS_RTOL,
        "grad_rel_diff": max(grads) if grads else None,
        "torch_error": ranks[0]["torch_error"],
        "hybridpar_steps_per_s_repeats": ours_all,
        "torch_steps_per_s_repeats": t_all,
        "load_avg_before": list(load_before),
        "load_avg_after": list(load_after),
        "measured_step_time_s": measured,
        **costs,
        **pred,
        "sim_error": pred["sim_step_time_s"] / measured - 1,
        "critical_path_s": _critical(c, ranks),
        "trace_file": _write_trace(c, ranks, sim, trace_dir) if trace_dir else None,
    }
    return rec
