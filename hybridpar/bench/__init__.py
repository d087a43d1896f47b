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
# data, serving, the planner.
BENCHES = (
    "pipeline",
    "nondivisible",
    "microbatch",
    "step_time",
    "compile",
    "recompute",
    "context_parallel",
    "sequence_parallel",
    "precision",
    "precision_quality",
    "bf16_copies",
    "exactness",
    "memory_accuracy",
    "checkpoint",
    "balance",
    "chaos",
    "records_cost",
    "launch_startup",
    "prepare",
    "prepare_scaling",
    "data",
    "serve",
    "plan_accuracy",
    "plan_scale",
    "published_compare",
)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(
            f"usage: hybridpar bench {{{','.join(BENCHES)}}} [--help] [args ...]",
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
