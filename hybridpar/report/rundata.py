"""A run directory's records, read for `hybridpar report`: metrics.jsonl (and the steps a restart cut,
metrics.superseded.jsonl), resilience.jsonl, chaos.jsonl, watchdog.jsonl, step_timeline.json and the state
in run.json. Lines torn by a crash are skipped; a directory without step records is refused with a
ValueError."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridpar.report.metrics import superseded_path
from hybridpar.report.stability import Stability, stability
from hybridpar.resilience.rundir import RUN_FILE

TIMELINE_FILE = "step_timeline.json"  # written by report/step_records.py; here so reading needs no torch


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (none where it is absent)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # torn by a kill: the writers start each record on a fresh line
        if isinstance(rec, dict):
            out.append(rec)
    return out


@dataclass
class Run:
    path: Path
    steps: list[dict[str, Any]]  # one record per step the final model contains, in step order
    superseded: list[dict[str, Any]]  # steps trained, then cut by a restart and trained again
    final: dict[str, Any] | None
    events: list[dict[str, Any]]  # resilience.jsonl: start, resumed, first_step, checkpoint
    faults: list[dict[str, Any]]  # chaos.jsonl: injected faults that fired
    watchdog: list[dict[str, Any]]  # watchdog.jsonl: ranks named as hung or gone
    timeline: dict[str, Any] | None  # one step's actions on every rank
    state: str  # how the run ended, in words (run_state)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def starts(self) -> list[float]:
        return [e["time"] for e in self.events if e.get("event") == "start"]

    def stability(self) -> Stability:
        return stability(
            [s for s in self.steps if "time" in s],
            [s for s in self.superseded if "time" in s],
            self.starts,
            [f["time"] for f in self.faults],
            (self.final or {}).get("ledger"),
        )


def load_run(path: str | Path) -> Run:
    d = Path(path)
    if not d.is_dir():
        raise ValueError(f"run directory {str(d)!r} does not exist: give the --run-dir of a hybridpar train run")
    metrics = read_jsonl(d / "metrics.jsonl")
    steps = sorted((r for r in metrics if "loss" in r and isinstance(r.get("step"), int)), key=lambda r: r["step"])
    if not steps:
        raise ValueError(
            f"{str(d)!r} holds no step records (metrics.jsonl missing or empty): give the --run-dir of a "
            "hybridpar train run that finished at least one step"
        )
    timeline = None
    if (d / TIMELINE_FILE).is_file():
        try:
            timeline = json.loads((d / TIMELINE_FILE).read_text(encoding="utf-8"))
        except ValueError:
            timeline = None
    return Run(
        path=d,
        steps=steps,
        superseded=read_jsonl(superseded_path(d / "metrics.jsonl")),
        final=next((r for r in metrics if r.get("final")), None),
        events=read_jsonl(d / "resilience.jsonl"),
        faults=read_jsonl(d / "chaos.jsonl"),
        watchdog=read_jsonl(d / "watchdog.jsonl"),
        timeline=timeline,
        state=run_state(metrics, _run_record(d)),
    )


def _run_record(d: Path) -> dict[str, Any]:
    """run.json, or {} where it is missing or unreadable: the report still opens (a pre-run-id directory)."""
    try:
        rec = json.loads((d / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def run_state(metrics: list[dict[str, Any]], record: dict[str, Any]) -> str:
    """How the run ended: the last record of metrics.jsonl if it closes the run (final, or preempted by
    SIGTERM), else the state the workers wrote into run.json. A run killed outright (SIGKILL, the machine
    lost) writes neither: run.json still says running, which a live run says too."""
    last = metrics[-1] if metrics else {}  # a closing record followed by steps was a stop a resume went past
    if last.get("final"):
        return "finished"
    if last.get("preempted"):
        return f"stopped by SIGTERM after {last.get('step')} steps, checkpointed (continue with --resume auto)"
    if record.get("state") == "failed":
        return f"failed: {record.get('error') or 'no error recorded'}"
    return "not finished: still running, or killed before it could say (no final record in metrics.jsonl)"
