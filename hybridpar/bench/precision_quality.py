"""bf16 against fp32 quality on the README's default run: the same training (model, layout, seed, steps) once
in each precision, each in its own run directory, and their final validation losses compared (JSON).

    .venv/bin/hybridpar bench precision_quality [--steps N] [--seed 0] [--runs-dir DIR] [--json FILE]

Each run is `hybridpar train --run-dir DIR/<precision> --train.precision <precision> --train.seed S`
(plus `--train.steps N` when given; the default run's own schedule otherwise), run one after the other so
they do not share the cores. Reported per precision: the final val_loss (the run's last validation, which
the trainer makes at its last step), the final training loss, the steps, the wall time of the whole
command and the command itself; then bf16/fp32 of the final val_loss, and the load average before and
after. The acceptance bar is a ratio within 3% of 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hybridpar.bench import emit


def final_records(run_dir: Path) -> dict:
    """The last step's loss, the last val_loss and the number of steps recorded in a run's metrics.jsonl."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in steps if "step" in r and "loss" in r]
    vals = [r for r in steps if "val_loss" in r]
    if not vals:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no val_loss record: was validation off (train.val_every 0)?")
    return {
        "steps": len(steps),
        "final_loss": steps[-1]["loss"],
        "val_loss": vals[-1]["val_loss"],
        "val_step": vals[-1]["step"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench precision_quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="train this many steps (default: the default run's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--runs-dir",
        default=None,
        help="parent of the two run directories <dir>/fp32 and <dir>/bf16 (default: runs/precision_quality/<time>)",
    )
    ap.add_argument("--json", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    if a.steps is not None and a.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {a.steps}")
    runs = Path(a.runs_dir or f"runs/precision_quality/{time.strftime('%Y%m%d-%H%M%S')}")
    load_before = os.getloadavg()
    out: dict = {"seed": a.seed, "steps_option": a.steps, "runs_dir": str(runs)}
    for prec in ("fp32", "bf16"):
        cmd = [sys.executable, "-m", "hybridpar.cli", "train", "--run-dir", str(runs / prec)]
        cmd += ["--train.precision", prec, "--train.seed", str(a.seed)]
        cmd += ["--train.steps", str(a.steps)] if a.steps is not None else []
        print(f"{prec}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
        wall = time.perf_counter() - t0
        if rc != 0:
            raise SystemExit(f"the {prec} run failed with exit code {rc}: see {runs / prec}/train.log")
        out[prec] = {"command": "hybridpar " + " ".join(cmd[3:]), "wall_s": wall, **final_records(runs / prec)}
        print(f"{prec}: val_loss {out[prec]['val_loss']:.4f} in {wall:.0f} s", file=sys.stderr, flush=True)
    ratio = out["bf16"]["val_loss"] / out["fp32"]["val_loss"]
    out.update(
        bf16_over_fp32_val_loss=ratio,
        within_3_percent=abs(ratio - 1) <= 0.03,
        load_avg_before=load_before,
        load_avg_after=os.getloadavg(),
        command="hybridpar bench precision_quality " + " ".join(sys.argv[1:] if argv is None else argv),
    )
    emit(out, a.json)
    return 0
