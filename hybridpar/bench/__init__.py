"""Benchmarks runnable from the CLI: `hybridpar bench NAME [args]` runs hybridpar.bench.NAME.main(args).
Each prints or writes JSON with a ratio against a baseline measured in the same run. Submodules are
imported lazily: they import torch.

Every benchmark lives here, in the package, as vLLM keeps `vllm bench`: users measure their own machines
and clusters with the installed command. The results of our own runs stay in the source tree's
bench/results/, which is all that folder holds."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridpar.config import Config

# Grouped: the pipeline and a training step, precision, memory and resilience, the records and the launch,
# data, serving, the planner. Each with the line `hybridpar bench --help` shows.
BENCHES = {
    "pipeline": "our pipeline runtime vs torch.distributed.pipelining, every schedule",
    "nondivisible": "a global batch the microbatch count does not divide vs its divisible neighbours",
    "microbatch": "every fixed microbatch split vs the adaptive policy",
    "step_time": "median step time of the default model under several layouts",
    "compile": "compiled vs eager steps, fused vs foreach AdamW",
    "recompute": "activation peak and step time with no, full and selective recomputation",
    "context_parallel": "activation peak and step time at cp > 1 vs cp = 1, with the memory model's prediction",
    "sequence_parallel": "activations, peak, step time and message bytes with and without sequence parallelism",
    "precision": "fp32 vs bf16 step time and memory on the default run",
    "precision_quality": "bf16 vs fp32 losses of the same training run",
    "bf16_copies": "bf16 by autocast vs bf16 working copies: step time and memory",
    "exactness": "the parameter criterion's factors and false-alarm rate, from runs exact by construction",
    "memory_accuracy": "bytes per rank by component, measured vs the memory model",
    "checkpoint": "checkpoint write time and bytes per rank: sharded vs gathered on rank 0",
    "balance": "static layout vs live load balancing under emulated slow ranks and links",
    "chaos": "random-fault soak vs a fault-free run; sync vs async checkpoint cost",
    "records_cost": "what the per-step records and sinks cost the default run",
    "launch_startup": "the wall time of a launch by each way of starting workers",
    "prepare": "hybridpar data prepare vs the tokenizers batch encoder alone",
    "prepare_scaling": "hybridpar data prepare --workers N scaling",
    "data": "peak resident memory of a run against the corpus's size",
    "serve": "request placement strategies under Poisson load",
    "plan_accuracy": "the planner's predicted step times vs measured runs on this machine",
    "plan_scale": "how long hybridpar plan takes for 1,024 GPUs and a 100-layer model",
    "published_compare": "the planner beside published GPU training runs",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        listing = "\n".join(f"  {name:<18} {what}" for name, what in BENCHES.items())
        print(
            f"usage: hybridpar bench NAME [--help] [args ...]\n\n"
            f"Runs a benchmark on this machine, against a baseline measured in the same run, and prints its "
            f"figures as JSON; `hybridpar bench NAME --help`: its options (sizes, repeats, output file).\n\n{listing}",
            file=sys.stdout if argv else sys.stderr,
        )
        return 0 if argv else 2
    if argv[0] not in BENCHES:
        print(f"hybridpar: unknown benchmark {argv[0]!r}; benchmarks: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    return importlib.import_module(f"hybridpar.bench.{argv[0]}").main(argv[1:])


def runs_dir(bench: str, given: str | None) -> Path:
    """Where a bench keeps the run directories it launches (`--runs-dir`), so that `hybridpar report` can
    read them: the folder given, else runs/bench/<bench>-<time> under the working directory, beside the
    runs of `hybridpar train` (runs/latest). A new folder by default: a run directory holding another
    run is refused, so two invocations never share one."""
    return Path(given) if given else Path("runs", "bench", f"{bench}-{time.strftime('%Y%m%d-%H%M%S')}")


def emit(result: Any, path: str | None, *, echo: bool = True, indent: int = 1) -> None:
    """Print `result` as JSON (with `echo`) and write it to `path` (None or "-": nowhere else). The file is
    written beside its destination and renamed over it: a reader never finds half a file, and a bench that
    writes its figures as each part completes keeps the last whole set if a later part fails."""
    text = json.dumps(result, indent=indent)
    if echo:
        print(text, flush=True)
    if path and path != "-":
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, out)


def layout_config(layout: str) -> Config:
    """The default config with the layout `layout`, written TPxPPxDP (e.g. "2x2x1")."""
    from hybridpar.config import Config

    cfg = Config()
    p = cfg.parallel
    p.tp, p.pp, p.dp = map(int, layout.split("x"))
    return cfg
