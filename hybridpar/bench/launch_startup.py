"""What each way of starting workers costs (issue 42): the wall time of a whole launch of the tiny test
model (tp1 x pp2, one step), from a process that has already done torch work, as a benchmark does:

- forkserver: `launch()` from this process, its default (each worker forked from the fork server, which
  imported torch and the trainer once: its first start is in the first repeat's figure);
- spawn: `launch(start_method="spawn")` from this process (each worker a fresh interpreter);
- fork-fresh: a fresh interpreter per launch, single-threaded, that forks its workers
  (`launch(start_method="fork")`: forking this process itself is refused, it runs threads);
- cli: `hybridpar train` as a subprocess (torch's launcher, spawned workers).

The contenders alternate, each `--repeats` times; medians, their ratio to spawn and the load average.

    .venv/bin/hybridpar bench launch_startup [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridpar.bench import emit
from hybridpar.config.parse import to_toml
from hybridpar.model.reference import tiny_config
from hybridpar.run.launcher import launch

FRESH = """
import sys
from hybridpar.config import Config
from hybridpar.run.launcher import launch
launch(Config.from_dict(__import__("json").loads(sys.argv[1])), start_method="fork")
"""


def config(run_dir: Path):
    cfg = tiny_config(parallel=dict(tp=1, pp=2))
    cfg.train.steps, cfg.run_dir = 1, str(run_dir)
    return cfg


def timed(name: str, run_dir: Path) -> float:
    cfg = config(run_dir)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "check": True}
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    t = time.monotonic()
    if name in ("spawn", "forkserver"):
        launch(cfg, start_method=name)
    elif name == "fork-fresh":
        subprocess.run([sys.executable, "-c", FRESH, json.dumps(cfg.to_dict())], env=env, **quiet)
    else:
        exe = str(Path(sys.executable).with_name("hybridpar"))
        toml = run_dir.with_suffix(".toml")
        toml.write_text(to_toml(cfg))
        subprocess.run([exe, "train", "--config", str(toml)], env=env, **quiet)
    return time.monotonic() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench launch_startup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    (torch.randn(256, 256) @ torch.randn(256, 256)).sum()  # torch work done, as in a benchmark
    names = ("forkserver", "spawn", "fork-fresh", "cli")
    walls: dict[str, list[float]] = {n: [] for n in names}
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            for n in names:
                walls[n].append(timed(n, Path(tmp, f"{n}-{r}")))
    med = {n: statistics.median(v) for n, v in walls.items()}
    out = {
        "bench": "launch_startup",
        "model": "tiny test model, tp1 x pp2, 1 step",
        "median_launch_s": {n: round(v, 2) for n, v in med.items()},
        "ratio_to_spawn": {n: round(v / med["spawn"], 3) for n, v in med.items()},
        "launch_s": {n: [round(x, 2) for x in v] for n, v in walls.items()},
        "load_avg_1m": [load0, os.getloadavg()[0]],
    }
    emit(out, a.json)
    return 0
