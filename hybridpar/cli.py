"""`hybridpar` command line. `hybridpar train` validates the config in this process (no worker is
started for a bad one), then runs torch's own elastic launcher (`torch.distributed.run`, i.e.
torchrun) on `python -m hybridpar.run.worker` (the trainer, tied to this launcher first). torchrun's
flags (--nproc-per-node, --nnodes, --node-rank, --rdzv-endpoint, --max-restarts, …) pass through
unchanged; everything else is ours."""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from hybridpar.config import Config, help_text, parse_args
from hybridpar.config.keys import _owner

if TYPE_CHECKING:
    from hybridpar.plan.launch import AutoPlan

USAGE = """usage: hybridpar [--version] [--help]
       hybridpar train [torchrun flags] [--config FILE] [--run-dir DIR] [--overwrite]
                       [--section.key VALUE ...]

Trains a Llama-family model (--model.family gpt2 for GPT-2) on the embedded default (the Python
standard library's source, byte-level) with tp=2 x pp=2 unless told otherwise. torchrun flags such
as --nproc-per-node, --nnodes, --node-rank, --rdzv-endpoint and --max-restarts are passed to
torch.distributed.run. --parallel.auto true plans the layout for the world it gets (--parallel.hardware
FILE, or this machine probed), holding the keys you give, prints the choice and the runners-up and writes
<run-dir>/plan.json (docs/planner.md, "Planning at launch").

       hybridpar serve [--help] [--source PATH] ...     (OpenAI-compatible server, see `hybridpar serve --help`)
       hybridpar export SOURCE --out DIR [--step N]     (a run, checkpoint or step as a Hugging Face directory)
       hybridpar data train-tokenizer|prepare [--help]  (a byte-level BPE tokenizer; a corpus as token files)
       hybridpar report RUN_DIR [--compare OTHER_RUN] [--out FILE]  (one HTML file: plots, stability figures)
       hybridpar plan (--hardware FILE | --probe) [--world N] [--top 10] [--json FILE] [--help]  (choose a layout)
       hybridpar plan --probe --hardware DATASHEET.toml --out FILE  (on a CUDA host: its GPU calibration measured)
       hybridpar rendezvous [--port 29400] [--host 127.0.0.1] [--help]  (a multi-node run's store, outside its nodes)
       hybridpar bench pipeline [--help] [args ...]   (our pipeline runtime vs torch.distributed.pipelining)
       hybridpar bench serve [--help] [args ...]      (request placement strategies under Poisson load)
       hybridpar bench microbatch [--help] [args ...] (every fixed microbatch split vs the adaptive policy)
       hybridpar bench chaos [--help] [args ...]      (random-fault soak; sync vs async checkpoint cost)
       hybridpar bench balance [--help] [args ...]    (static layout vs live load balancing, one rank 2x slow)
       hybridpar bench memory_accuracy [--help] [args ...]  (bytes per rank by component, measured vs the model)
       hybridpar bench plan_accuracy [--help] [args ...]    (the planner's predicted step times vs measured runs)
       hybridpar bench --help                         (every benchmark: step time, precision, recompute, ...)
"""


def _torchrun_options() -> dict[str, bool]:
    """torchrun's option strings -> whether the option takes a value."""
    from torch.distributed.run import get_args_parser

    opts: dict[str, bool] = {}
    for action in get_args_parser()._actions:
        for s in action.option_strings:
            if s not in ("-h", "--help", "-m", "--module"):
                opts[s] = action.nargs != 0
    return opts


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate torchrun's flags from hybridpar's (ours are --config, --run-dir and --section.key)."""
    known = _torchrun_options()
    ours: list[str] = []
    theirs: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in known and "." not in name:
            theirs.append(arg)
            if known[name] and "=" not in arg and i + 1 < len(argv):
                theirs.append(argv[i + 1])
                i += 1
        else:
            ours.append(arg)
        i += 1
    return theirs, ours


def _ours_by_name(argv: list[str]) -> list[str]:
    """The options that are surely hybridpar's (`--section.key`, --config, --run-dir, --resume, --trace)
    with their values, found without torchrun's option table."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if name.startswith("--") and (
            "." in name or name in ("--config", "--run-dir", "--run_dir", "--resume", "--trace")
        ):
            out.append(arg)
            if "=" not in arg and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out.append(argv[i + 1])
    return out


def _flag(args: list[str], *names: str) -> str | None:
    for i, a in enumerate(args):
        key, _, val = a.partition("=")
        if key in names:
            return val if val else (args[i + 1] if i + 1 < len(args) else None)
    return None


def _launch_key(theirs: list[str]) -> str:
    """What names one launch of several nodes, the same on every node of it: torchrun's rendezvous
    backend, id and endpoint (static rendezvous: the master's address and port)."""
    backend = _flag(theirs, "--rdzv-backend", "--rdzv_backend") or "static"
    if backend == "static":
        where = f"{_flag(theirs, '--master-addr', '--master_addr')}:{_flag(theirs, '--master-port', '--master_port')}"
    else:
        where = _flag(theirs, "--rdzv-endpoint", "--rdzv_endpoint") or ""
    return f"{backend}|{_flag(theirs, '--rdzv-id', '--rdzv_id') or 'none'}|{where}"


def _set_flag(args: list[str], names: tuple[str, ...], value: str) -> list[str]:
    """`args` with the value of the flag `names` replaced (appended if absent)."""
    out, i = [], 0
    while i < len(args):
        key = args[i].split("=", 1)[0]
        if key in names:
            i += 1 if "=" in args[i] else 2
            continue
        out.append(args[i])
        i += 1
    return out + [names[0], value]


def launch_train(argv: list[str]) -> int:
    from hybridpar.run.launcher import (
        elastic_note,
        end_launch,
        outcome,
        planned_flags,
        report_plan,
        restart_note,
        start_launch,
        stop_on_permanent_failure,
    )
    from hybridpar.run.preflight import preflight, preflight_config
    from hybridpar.topology.nodes import node_rank_problem, tp_node_problem

    overwrite = "--overwrite" in argv  # a launcher flag: workers (and their restarts) must never see it
    argv = [a for a in argv if a != "--overwrite"]
    try:  # config errors first, before torchrun's option table costs the torch import (seconds)
        early: set[str] = set()
        preflight_config(_layout_left(parse_args(_ours_by_name(argv), early), early))
    except ValueError as e:
        print(f"hybridpar: error: {e}", file=sys.stderr)
        return 2
    theirs, ours = split_argv(argv)
    nproc = _flag(theirs, "--nproc-per-node", "--nproc_per_node")
    nnodes = _flag(theirs, "--nnodes") or "1"
    planned = None
    try:
        if why := node_rank_problem(_flag(theirs, "--node-rank", "--node_rank"), nnodes):
            raise ValueError(why)
        given: set[str] = set()
        cfg = parse_args(ours, given)
        world = None
        if nnodes.isdigit() and (nproc is None or nproc.isdigit()):
            world = int(nnodes) * int(nproc or cfg.parallel.world_size)
        if cfg.parallel.auto:  # plan once, here; the workers get the choice as flags
            planned = _auto_plan(cfg, given, world, nnodes, nproc)
            cfg, ours = planned.cfg, ours + planned_flags(planned.cfg)
        local = int(nproc) if nproc and nproc.isdigit() else (world if nnodes == "1" else None)
        cfg, notes = preflight(cfg, world, local_ranks=local)  # each worker runs it again (train.enter_worker)
        if (
            nnodes == "1"
            and not overwrite
            and cfg.checkpoint.resume == "off"
            and cfg.checkpoint.dir is None
            and _flag(ours, "--run-dir", "--run_dir") is None
            and cfg.run_dir == Config().run_dir
        ):
            # The default directory (the README's first command, run again): the last run moves aside.
            from hybridpar.resilience.rundir import set_aside

            if (moved := set_aside(Path(cfg.run_dir))) is not None:
                print(f"hybridpar: the previous run in {cfg.run_dir} moved to {moved}")
        key = None
        if nnodes != "1":
            # Several nodes share one run directory (a filesystem every node mounts, checked by the workers
            # at start, see train.own_run); each node's launcher holds it for the run named by the key.
            key = _launch_key(theirs)
            if nproc is not None and nproc.isdigit() and (why := tp_node_problem(cfg.parallel.tp, int(nproc))):
                raise ValueError(why)
        claim = start_launch(cfg, overwrite, key)
    except ValueError as e:
        print(f"hybridpar: error: {e}", file=sys.stderr)
        return 2
    if planned is not None:
        report_plan(planned, cfg.run_dir, planned.cfg.parallel.world_size)
    for note in notes:
        print(note)
    restarts = _flag(theirs, "--max-restarts", "--max_restarts")
    if restarts is None and "resilience.max_restarts" in given:
        restarts = str(cfg.resilience.max_restarts)
    for warning in (elastic_note(nnodes, cfg.checkpoint.every), restart_note(nnodes, restarts, cfg.checkpoint.every)):
        if warning:
            print(warning, file=sys.stderr, flush=True)
    watch = stop_on_permanent_failure(cfg, claim)
    try:
        return _run_agent(theirs, ours, cfg, nproc, nnodes, lambda: outcome(cfg, claim))
    finally:
        watch.set()
        end_launch(claim)


def _layout_left(cfg: Config, given: set[str]) -> Config:
    """Under parallel.auto, the layout keys left to the planner set to what any model takes (one process,
    one microbatch), so that the first check judges what the user gave, not defaults the plan replaces
    (a per-stage recomputation list waits for the planner's own check, plan/launch.py)."""
    left = {"parallel.tp": 1, "parallel.pp": 1, "parallel.dp": 1, "parallel.virtual_stages": None}
    for key, value in [*left.items(), ("train.microbatches", 1)] if cfg.parallel.auto else ():
        if key not in given:
            setattr(*_owner(cfg, key), value)
    if cfg.parallel.auto and "," in cfg.train.recompute:
        cfg.train.recompute = "none"
    return cfg


def planned_world(world: int | None, nnodes: str, nproc: str | None) -> int | None:
    """The world a launch plans for: the one it starts, or under `--nnodes MIN:MAX` the largest (the
    workers of a smaller one re-plan through the planner, as after losing a node)."""
    lo, sep, hi = nnodes.partition(":")
    if world is None and sep and hi.isdigit() and nproc is not None and nproc.isdigit():
        return int(hi) * int(nproc)
    return world


def _auto_plan(cfg: Config, given: set[str], world: int | None, nnodes: str, nproc: str | None) -> AutoPlan:
    from hybridpar.plan.launch import auto_plan

    world = planned_world(world, nnodes, nproc)
    if world is None:
        raise ValueError(
            "parallel.auto plans for a known world size: give --nproc-per-node N and --nnodes N or MIN:MAX "
            f"(got --nproc-per-node {nproc or 'unset'}, --nnodes {nnodes})"
        )
    if nnodes != "1" and cfg.parallel.hardware is None:
        raise ValueError(
            "parallel.auto on several nodes needs --parallel.hardware FILE (each node's launcher plans, and "
            "must reach the same layout; a probe measures only its own node)"
        )
    return auto_plan(cfg, given, world)


def _run_agent(
    theirs: list[str],
    ours: list[str],
    cfg: Config,
    nproc: str | None,
    nnodes: str,
    outcome: Callable[[], tuple[int, str | None]],
) -> int:
    """Run torch's agent; `outcome()` gives the exit code and a line to print, from what the workers
    recorded."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    from hybridpar.topology.rdzv_client import store_error_line
    from hybridpar.topology.rendezvous import (
        C10D_BACKEND,
        LOOPBACK_BACKEND,
        is_loopback_endpoint,
        register_loopback_rendezvous,
    )

    if nproc is None:
        theirs = ["--nproc-per-node", str(cfg.parallel.world_size)] + theirs
    if _flag(theirs, "--max-restarts", "--max_restarts") is None:  # restarted workers resume (train.py)
        theirs = ["--max-restarts", str(cfg.resilience.max_restarts)] + theirs
    # Ranks on one machine share its cores: one intra-op thread each unless the user says otherwise
    # (this also answers torchrun's warning about OMP_NUM_THREADS).
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(nproc or cfg.parallel.world_size)))
    )
    endpoint = _flag(theirs, "--rdzv-endpoint", "--rdzv_endpoint")
    if _flag(theirs, "--rdzv-backend", "--rdzv_backend") == "c10d" and endpoint:
        # torch's c10d with two changes (topology/rendezvous.py): the nodes agree on one id per
        # rendezvous round (so a node that joins meets the survivors), and a loopback endpoint keeps
        # every store on loopback (several agents on one machine standing in for nodes).
        register_loopback_rendezvous()
        loopback = is_loopback_endpoint(endpoint)
        theirs = _set_flag(theirs, ("--rdzv-backend", "--rdzv_backend"), LOOPBACK_BACKEND if loopback else C10D_BACKEND)
        if loopback and _flag(theirs, "--local-addr", "--local_addr") is None:
            theirs += ["--local-addr", "127.0.0.1"]
    if nnodes == "1" and endpoint is None and "--standalone" not in theirs:
        # Single machine: rendezvous and worker store listen on loopback only.
        register_loopback_rendezvous()
        theirs = [
            "--rdzv-backend",
            LOOPBACK_BACKEND,
            "--rdzv-endpoint",
            "127.0.0.1:0",
            "--local-addr",
            "127.0.0.1",
        ] + theirs
    args = get_args_parser().parse_args(theirs + ["-m", "hybridpar.run.worker"] + ours)
    agent = "finished"
    try:
        run(args)
    except SignalException:  # the agent passed the signal to the workers, which checkpoint if they can
        agent = "signalled"
    except Exception as e:  # ChildFailedError: torch already printed the failing rank's traceback
        agent = "failed"
        if why := store_error_line(e, endpoint):  # the agent stopped its workers (they checkpoint if they can)
            print(why, file=sys.stderr, flush=True)
    code, line = outcome()
    if line:
        print(line, file=sys.stderr if code in (1, 2) else sys.stdout, flush=True)
    if agent == "signalled":
        # After a signal torch leaves its rendezvous keep-alive thread running, and its finalizer then
        # fails at interpreter exit ("cannot join current thread"): the workers are down and everything
        # is written, so leave without finalizers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


EXPORT_USAGE = """usage: hybridpar export SOURCE --out DIR [--step N]

Writes a model as a Hugging Face directory (config.json, model.safetensors, the tokenizer's files when
the run had a tokenizer, hybridpar.json with run id, step and params digest) that transformers loads.
SOURCE is a run directory (its newest model: final/ or a later checkpoint; --step N: that step's
checkpoint) or one checkpoint directory (step-NNNNNN). DIR is replaced whole: it must be new, empty or
an earlier export (a directory holding anything else, or a run's final/, is refused)."""


def parse_export_args(argv: list[str]) -> tuple[str, str, int | None]:
    """`SOURCE --out DIR [--step N]` -> (source, out, step), or ValueError; reads no file."""
    from hybridpar.config.args import ArgParser, nonnegative_int

    ap = ArgParser(prog="hybridpar export", add_help=False)
    ap.add_argument("source")
    ap.add_argument("--out", required=True)
    ap.add_argument("--step", type=nonnegative_int)
    a = ap.parse(argv)
    return a.source, a.out, a.step


def export_main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(EXPORT_USAGE)
        return 0
    try:
        source, out, step = parse_export_args(argv)
        from hybridpar.trainer.export import export_source

        written = export_source(source, Path(out), step)
    except ValueError as e:
        print(f"hybridpar: error: {e}\n\n{EXPORT_USAGE}", file=sys.stderr)
        return 2
    print(f"hybridpar: wrote {written}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # nothing starts without a command: `hybridpar train` trains the default
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in ("-h", "--help"):
        print(USAGE)
        return 0
    if cmd in ("-V", "--version"):
        from importlib.metadata import version

        print(f"hybridpar {version('hybridpar')}")
        return 0
    if cmd == "train":
        if any(a in ("-h", "--help") for a in rest):
            from hybridpar.pipeline.schedules.registry import schedules_help

            print(USAGE + "\n" + help_text() + "\n\n" + schedules_help())
            return 0
        return launch_train(rest)
    if cmd == "serve":
        from hybridpar.serve.main import main as serve_main

        return serve_main(rest)
    if cmd == "export":
        return export_main(rest)
    if cmd == "data":
        from hybridpar.data.prepare import main as data_main

        return data_main(rest)
    if cmd == "report":
        from hybridpar.report.page import main as report_main

        return report_main(rest)
    if cmd == "plan":
        from hybridpar.plan.main import main as plan_main

        return plan_main(rest)
    if cmd == "rendezvous":
        from hybridpar.topology.rdzv_store import main as rendezvous_main

        return rendezvous_main(rest)
    if cmd == "bench":  # hybridpar bench pipeline ... -> hybridpar.bench.pipeline.main(...)
        from hybridpar.bench import main as bench_main

        return bench_main(rest)
    commands = ["train", "serve", "export", "data", "report", "plan", "rendezvous", "bench"]
    close = difflib.get_close_matches(cmd, commands, n=1, cutoff=0.6)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    print(f"hybridpar: unknown command {cmd!r}{guess}; commands: {', '.join(commands)}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
