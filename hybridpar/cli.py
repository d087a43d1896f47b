"""`hybridpar` command line. `hybridpar train` validates the config in this process (no worker is
started for a bad one), then runs torch's own elastic launcher (`torch.distributed.run`, i.e.
torchrun) on `python -m hybridpar.train`. torchrun's flags (--nproc-per-node, --nnodes, --node-rank,
--rdzv-endpoint, --max-restarts, …) pass through unchanged; everything else is ours."""

from __future__ import annotations

import os
import sys

from hybridpar.config import help_text, parse_args

USAGE = """usage: hybridpar train [torchrun flags] [--config FILE] [--run-dir DIR] [--section.key VALUE ...]

Trains on the embedded default (the Python standard library's source, byte-level) with tp=2 x pp=2
unless told otherwise. torchrun flags such as --nproc-per-node, --nnodes, --node-rank,
--rdzv-endpoint and --max-restarts are passed to torch.distributed.run.

       hybridpar serve [--help] [--source PATH] ...     (OpenAI-compatible server, see `hybridpar serve --help`)
       hybridpar bench pipeline [--help] [args ...]   (our pipeline runtime vs torch.distributed.pipelining)
       hybridpar bench serve [--help] [args ...]      (request placement strategies under Poisson load)
       hybridpar bench microbatch [--help] [args ...] (every fixed microbatch split vs the adaptive policy)
       hybridpar bench chaos [--help] [args ...]      (random-fault soak; sync vs async checkpoint cost)
       hybridpar bench balance [--help] [args ...]    (static layout vs live load balancing, one rank 2x slow)
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


def _flag(args: list[str], *names: str) -> str | None:
    for i, a in enumerate(args):
        key, _, val = a.partition("=")
        if key in names:
            return val if val else (args[i + 1] if i + 1 < len(args) else None)
    return None


def launch_train(argv: list[str]) -> int:
    theirs, ours = split_argv(argv)
    try:
        cfg = parse_args(ours)
        nproc = _flag(theirs, "--nproc-per-node", "--nproc_per_node")
        nnodes = _flag(theirs, "--nnodes") or "1"
        world = None
        if nnodes.isdigit() and (nproc is None or nproc.isdigit()):
            world = int(nnodes) * int(nproc or cfg.parallel.world_size)
        if world is not None:
            from hybridpar.balance.emulate import SlowdownPlan
            from hybridpar.resilience.chaos import parse_faults
            from hybridpar.resilience.elastic import layout_for_world

            planned, note = layout_for_world(cfg, world, 0)  # resuming on another world size: re-plan
            planned.validate(world_size=world)
            if note:
                print(note)
            SlowdownPlan.from_config(cfg.emulate.slowdown, world)
            parse_faults(cfg.emulate.fault, world)
        else:
            cfg.validate()
    except ValueError as e:
        print(f"hybridpar: error: {e}", file=sys.stderr)
        return 2
    from torch.distributed.run import get_args_parser, run

    from hybridpar.topology.rendezvous import LOOPBACK_BACKEND, register_loopback_rendezvous

    if nproc is None:
        theirs = ["--nproc-per-node", str(cfg.parallel.world_size)] + theirs
    if _flag(theirs, "--max-restarts", "--max_restarts") is None:  # restarted workers resume (train.py)
        theirs = ["--max-restarts", str(cfg.resilience.max_restarts)] + theirs
    # Ranks on one machine share its cores: one intra-op thread each unless the user says otherwise
    # (this also answers torchrun's warning about OMP_NUM_THREADS).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(nproc or cfg.parallel.world_size))))
    if nnodes == "1" and _flag(theirs, "--rdzv-endpoint", "--rdzv_endpoint") is None and "--standalone" not in theirs:
        # Single machine: rendezvous and worker store listen on loopback only.
        register_loopback_rendezvous()
        theirs = ["--rdzv-backend", LOOPBACK_BACKEND, "--rdzv-endpoint", "127.0.0.1:0",
                  "--local-addr", "127.0.0.1"] + theirs
    args = get_args_parser().parse_args(theirs + ["-m", "hybridpar.train"] + ours)
    try:
        run(args)
    except Exception as e:  # ChildFailedError: torch already printed the failing rank's traceback
        print(f"hybridpar: training failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["train"]
    cmd, rest = argv[0], argv[1:]
    if cmd in ("-h", "--help"):
        print(USAGE)
        return 0
    if cmd == "train":
        if any(a in ("-h", "--help") for a in rest):
            print(USAGE + "\n" + help_text())
            return 0
        return launch_train(rest)
    if cmd == "serve":
        from hybridpar.serve.main import main as serve_main

        return serve_main(rest)
    if cmd == "bench":  # hybridpar bench pipeline ... -> hybridpar.bench.pipeline.main(...)
        from hybridpar.bench import main as bench_main

        return bench_main(rest)
    print(f"hybridpar: unknown command {cmd!r}; commands: train, serve, bench\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
