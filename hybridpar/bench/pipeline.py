"""hybridpar's pipeline runtime side by side with torch.distributed.pipelining, in one invocation.

    hybridpar bench pipeline [--mode compute|emulated|both] [--pp 2,4] [--microbatches 8]
        [--schedules gpipe,1f1b,interleaved-1f1b,zb-h1,zb-v] [--virtual-stages 2] [--repeats 5] [--steps 4]
        [--f-ms 20 --b-ms 40 [--w-ms 20]]
        [--window-tail autograd|spin] [--backend gloo|nccl] [--p2p
        auto|process_group|shared_memory] [--cpu-bind none|cores] [--act-kb 256] [--global-batch N] [--ping-pongs 200]
        [--trace-dir DIR] [--json FILE]   (or python -m hybridpar.bench.pipeline)

Per case (mode, schedule, pp) the ranks start once (dp = tp = 1, world = pp); each builds both
implementations over the same process group from the same seed: our `PipelineRuntime` on
`build_schedule(...)`, and torch's `PipelineStage` with the schedule's registered peer
(`ScheduleSpec.torch_peer`: `ScheduleGPipe` / `Schedule1F1B` / `ScheduleInterleaved1F1B` /
`ScheduleInterleavedZeroBubble`, which with one stage per rank is ZB-H1), with the same stage placement
(the schedule's: s on rank s % pp, or ZB-V's V). After a loss and gradient check and
warm-up, timed repeats alternate (ours, torch, ours, ...) so machine noise hits both; a repeat is
`--steps` forward+backward steps (gradients zeroed between steps, no optimizer). Reported: median
steps/s, ratio hybridpar/torch (> 1: ours is faster), bubble 1 - busy / (pp * wall) and the theoretical
bubble. Busy is measured by one instrumentation on both: in emulated mode the length of the stages'
compute windows (`emulated.SleepLog`), in compute mode the time inside the stage modules (`emulated.Timed`; it
cannot see torch's zero-bubble W, so that bubble is not reported).

`compute` runs real Llama stages (uniform partition, default ModelConfig); `emulated` replaces each
stage's compute by fixed-duration windows, mostly slept (labelled emulation, emulated.py; `--window-tail`
chooses what a window's last ms runs), while real activations of about `--act-kb` KiB per microbatch
travel. `--f-ms`/`--b-ms` are one microbatch's forward/backward time on one rank:
with v virtual stages each stage sleeps f/v and b/v, so every schedule does the same work per rank.
Zero-bubble schedules (those that split the backward) split it: B sleeps b - w (the input gradient) and W sleeps w
(the weight gradient), w = `--w-ms`, by default b / 2; other schedules sleep b in one backward.

Prediction (latency.py): in the same ranks and run, the case measures its per-hop costs (hop latency
by ping-pong through the runtime's P2P class; per-action overhead, send/recv posting time, sleep
overshoot, step gap and message posting points from our timed steps), simulates the action lists our
runtime executed under them (pipeline/simulate.py) and reports `sim_step_time_s`, `sim_error`
(sim / measured - 1), the ideal `sim_ideal_step_time_s` and `sim_breakdown_s` (what each term adds).
`--trace-dir DIR` writes DIR/<case>.json per case: one timed step of ours, every rank, beside its
simulation (open in ui.perfetto.dev). Emulated, `critical_path_s` splits our measured steps along
their critical path (critical_path.py): work, window overshoot, hops, intra-rank gaps; it adds up to
the step. `--p2p` picks our runtime's message transport (torch's schedules always use the process
group): `auto` is shared memory between the CPU ranks of this host (pipeline/shm.py).
"""

from __future__ import annotations

import argparse
import sys

from hybridpar.bench import emit
from hybridpar.bench.emulated import TAILS
from hybridpar.bench.pipeline_case import Case, run_case
from hybridpar.config import ModelConfig
from hybridpar.config.sections import CPU_BINDINGS
from hybridpar.pipeline.schedules import build_schedule, schedule_names, schedule_spec
from hybridpar.pipeline.shm import TRANSPORTS


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(records: list[dict]) -> str:
    head = (
        f"{'mode':<9}{'schedule':<18}{'pp':>3}{'v':>3}{'m':>4}{'ours st/s':>11}{'torch st/s':>12}"
        f"{'ratio':>8}{'bubble ours':>13}{'torch':>8}{'theory':>8}  loss match"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        match = "-" if r["loss_match"] is None else f"{r['loss_match']} ({r['loss_rel_diff']:.1e})"
        lines.append(
            f"{r['mode']:<9}{r['schedule']:<18}{r['pp']:>3}{r['virtual_stages']:>3}{r['microbatches']:>4}"
            f"{_f(r['hybridpar_steps_per_s'], '.3f'):>11}{_f(r['torch_steps_per_s'], '.3f'):>12}"
            f"{_f(r['ratio'], '.3f'):>8}{_f(r['bubble_measured'], '.3f'):>13}"
            f"{_f(r['torch_bubble_measured'], '.3f'):>8}{_f(r['bubble_theory'], '.3f'):>8}  {match}"
        )
        if r["torch_error"]:
            lines.append(f"{'':<9}torch not run: {r['torch_error']}")
    return "\n".join(lines)


def format_prediction(records: list[dict]) -> str:
    """The simulator fed with the measured per-hop costs vs. the measured step (ours), in ms / us."""
    head = (
        f"{'schedule':<18}{'pp':>3}{'m':>4}{'meas ms':>9}{'sim ms':>9}{'err %':>7}{'ideal':>8}"
        f"{'+lat':>7}{'+shoot':>7}{'+ovh':>7}{'+post':>7}{'+gap':>7}{'hop us':>8}"
        "  overshoot us F/B/W  overhead us F/B/W"
        f"  send/recv us"
    )
    lines = [head, "-" * len(head)]
    us = lambda d: "/".join(f"{d[k] * 1e6:.0f}" if k in d else "-" for k in "FBW")  # noqa: E731
    for r in records:
        bd = r["sim_breakdown_s"]
        lines.append(
            f"{r['schedule']:<18}{r['pp']:>3}{r['microbatches']:>4}{r['measured_step_time_s'] * 1e3:>9.1f}"
            f"{r['sim_step_time_s'] * 1e3:>9.1f}{r['sim_error'] * 100:>7.1f}{bd['ideal'] * 1e3:>8.1f}"
            + "".join(
                f"{bd[k] * 1e3:>7.2f}"
                for k in ("hop_latency", "sleep_overshoot", "action_overhead", "posting_delay", "step_gap")
            )
            + f"{r['hop_latency_s'] * 1e6:>8.0f}  {us(r['sleep_overshoot_s']):>18}"
            f"  {us(r['compute_overhead_s']):>17}  {r['send_overhead_s'] * 1e6:.0f}/{r['recv_overhead_s'] * 1e6:.0f}"
        )
    return "\n".join(lines)


def format_critical(records: list[dict]) -> str:
    """The critical path of our timed steps (emulated records), per step, in ms."""
    head = (
        f"{'schedule':<18}{'pp':>3}{'m':>4}{'step ms':>9}{'work':>8}{'shoot':>7}{'hops':>7}{'n':>4}{'per hop us':>11}"
        f"{'intra':>7}{'n':>4}{'start':>7}{'end':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        cp = r.get("critical_path_s")
        if not cp:
            continue
        lines.append(
            f"{r['schedule']:<18}{r['pp']:>3}{r['microbatches']:>4}{cp['step_s'] * 1e3:>9.1f}"
            f"{cp['work_s'] * 1e3:>8.1f}{cp['overshoot_s'] * 1e3:>7.2f}{cp['hops_s'] * 1e3:>7.2f}"
            f"{cp['n_hops']:>4.0f}{cp['hop_s'] * 1e6:>11.0f}{cp['intra_s'] * 1e3:>7.2f}{cp['n_intra']:>4.0f}"
            f"{cp['start_s'] * 1e3:>7.2f}{cp['end_s'] * 1e3:>7.2f}"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def make_cases(a: argparse.Namespace) -> list[Case]:
    """Every case of the invocation, validated (ValueError naming the problem) before any process starts."""
    modes = ["compute", "emulated"] if a.mode == "both" else [a.mode]
    scheds = [s for s in a.schedules.split(",") if s]
    for name, val in (
        ("--repeats", a.repeats),
        ("--steps", a.steps),
        ("--warmup", a.warmup),
        ("--microbatches", a.microbatches),
        ("--virtual-stages", a.virtual_stages),
        ("--ping-pongs", a.ping_pongs),
    ):
        if val < 1:
            raise ValueError(f"{name} must be at least 1, got {val}")
    if any(p < 2 for p in a.pp):
        raise ValueError(f"--pp values must be at least 2 (a pipeline), got {a.pp}")
    if a.f_ms < 0 or a.b_ms < 0 or a.act_kb <= 0:
        raise ValueError(f"--f-ms/--b-ms must be >= 0 and --act-kb > 0, got {a.f_ms}/{a.b_ms}/{a.act_kb}")
    w_ms = a.b_ms / 2 if a.w_ms is None else a.w_ms
    if not 0 <= w_ms <= a.b_ms:
        raise ValueError(f"--w-ms must be between 0 and --b-ms {a.b_ms}, got {w_ms}")
    if a.backend == "nccl":
        import torch

        if a.mode != "compute" or a.p2p == "shared_memory":
            raise ValueError(f"--backend nccl runs --mode compute over --p2p auto|process_group, got {a.mode}/{a.p2p}")
        if (gpus := torch.cuda.device_count()) < max(a.pp):
            raise ValueError(f"--backend nccl needs one GPU per rank: --pp {max(a.pp)} but {gpus} GPUs here")
    gb = a.global_batch or 2 * a.microbatches
    if gb < a.microbatches:
        raise ValueError(f"--global-batch {gb} is smaller than --microbatches {a.microbatches}")
    specs = {s: schedule_spec(s) for s in scheds}  # ValueError naming an unknown one
    # --virtual-stages applies where the schedule takes any count; the others run their own.
    vs = {s: a.virtual_stages if sp.virtual_stages is None else sp.default_virtual_stages for s, sp in specs.items()}
    layers = a.layers or max([ModelConfig().n_layers] + [p * v for p in a.pp for v in vs.values()])
    cases = []
    for mode in modes:
        for pp in a.pp:
            for s in scheds:
                build_schedule(s, pp, vs[s], a.microbatches)  # raises ValueError for a bad combination
                if mode == "compute" and layers < pp * vs[s]:
                    raise ValueError(f"--layers {layers} is fewer than the {pp * vs[s]} stages of {s} with pp={pp}")
                em = mode == "emulated"
                split = specs[s].splits_backward
                cases.append(
                    Case(
                        mode,
                        s,
                        pp,
                        vs[s],
                        a.microbatches,
                        gb,
                        a.seq_len,
                        a.steps,
                        a.repeats,
                        a.warmup,
                        a.f_ms if em else None,
                        a.b_ms if em else None,
                        w_ms if em and split else None,
                        a.act_kb if em else None,
                        None if em else layers,
                        a.seed,
                        a.timeout,
                        a.ping_pongs,
                        a.window_tail,
                        a.p2p,
                        a.cpu_bind,
                        a.backend,
                    )
                )
    return cases


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="hybridpar bench pipeline", description=__doc__.split("\n\n")[0])
    # In the order --help lists them.
    _add_case_args(ap)
    _add_timing_args(ap)
    _add_rank_args(ap)
    ap.add_argument("--act-kb", type=float, default=256.0, help="emulated activation KiB per microbatch")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step (default 2 x microbatches)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="compute mode: decoder layers (default: ModelConfig's, raised to the most stages)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="bound in seconds on every collective / P2P wait")
    ap.add_argument(
        "--ping-pongs", type=int, default=200, help="round trips per link for the hop latency (spread over the repeats)"
    )
    ap.add_argument(
        "--trace-dir",
        default=None,
        help="write per case DIR/<case>.json: one timed step of ours beside its simulation (Perfetto)",
    )
    ap.add_argument("--json", default=None, help="write the records to FILE ('-': stdout)")
    return ap.parse_args(argv)


def _add_case_args(ap: argparse.ArgumentParser) -> None:
    """Which cases: modes, pipeline sizes, schedules and their microbatches and virtual stages."""
    ap.add_argument("--mode", choices=("compute", "emulated", "both"), default="emulated")
    ap.add_argument(
        "--pp",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[2, 4],
        help="pipeline sizes, comma-separated",
    )
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument(
        "--schedules", default="gpipe,1f1b,interleaved-1f1b", help=f"comma-separated of {', '.join(schedule_names())}"
    )
    ap.add_argument(
        "--virtual-stages",
        type=int,
        default=2,
        help="stages per rank for the schedules that take any count ("
        + ", ".join(s for s in schedule_names() if schedule_spec(s).virtual_stages is None)
        + "); the others run their own",
    )


def _add_timing_args(ap: argparse.ArgumentParser) -> None:
    """How each case is timed, and what an emulated action sleeps."""
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per implementation (median)")
    ap.add_argument("--steps", type=int, default=4, help="steps per repeat")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation (first one checked)")
    ap.add_argument("--f-ms", type=float, default=20.0, help="emulated forward ms per microbatch per rank")
    ap.add_argument("--b-ms", type=float, default=40.0, help="emulated backward ms per microbatch per rank")
    ap.add_argument(
        "--w-ms",
        type=float,
        default=None,
        help="zero-bubble schedules: the weight-gradient share (W) of --b-ms; B sleeps the rest "
        "(default: half of --b-ms)",
    )
    ap.add_argument(
        "--window-tail",
        choices=TAILS,
        default="autograd",
        help="emulated: what a window's last ms runs: tiny autograd work (caches as warm as "
        "after real compute) or a bare spin (see emulated.TAILS)",
    )


def _add_rank_args(ap: argparse.ArgumentParser) -> None:
    """How the ranks run and talk: message transport, CPU cores, process-group backend."""
    ap.add_argument(
        "--p2p",
        choices=TRANSPORTS,
        default="auto",
        help="our runtime's message transport: auto = shared memory between CPU ranks on one "
        "host, else the process group (torch's schedules always use the process group)",
    )
    ap.add_argument(
        "--cpu-bind",
        choices=CPU_BINDINGS,
        default="none",
        help="each rank's CPU cores, for both implementations: none (the OS schedules) or "
        "cores (rank r on its own share; more ranks than cores: core r %% n)",
    )
    ap.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="process group of both implementations: gloo (CPU) or nccl (one GPU per rank, compute mode; "
        "no bubble is measured there, only steps/s)",
    )


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
        print(
            f"[{i + 1}/{len(cases)}] {c.mode} {c.schedule} pp={c.pp} v={c.v} m={c.m} ...", file=sys.stderr, flush=True
        )
        records.append(run_case(c, a.trace_dir))
    print(format_table(records))
    print()
    print(format_prediction(records))
    if crit := format_critical(records):
        print()
        print(crit)
    emit(records, a.json, echo=a.json == "-")
    return 0


if __name__ == "__main__":
    sys.exit(main())
