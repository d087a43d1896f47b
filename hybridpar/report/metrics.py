"""Run outputs: `metrics.jsonl` (one JSON object per line, flushed as written, so a crash keeps every
finished step) and the progress line, each also as a duty of the training loop (trainer/duty.py), which
rank 0 alone runs."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from hybridpar.config import Config
from hybridpar.report.sinks import open_sinks, scalars_of


def superseded_path(path: Path) -> Path:
    """Where `keep_before` moves the step records it cuts: `metrics.superseded.jsonl` beside `metrics.jsonl`."""
    return path.with_name(path.stem + ".superseded" + path.suffix)


def keep_before(path: Path, step: int) -> list[int]:
    """Rewrite `path` keeping only the records of steps before `step`: a run resumed after `step` steps
    writes steps `step`, `step`+1, ... again, so each step appears once in the final file. Also drops a
    final record and a line torn by a crash. Atomic (a new file renamed over the old). The step records
    cut are appended to `superseded_path(path)` first: steps trained and then redone, which the stability
    report counts (report/stability.py). Returns the steps of the records cut."""
    if not path.is_file():
        return []
    kept, cut, steps = [], [], []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        is_step = isinstance(rec, dict) and isinstance(rec.get("step"), int) and not rec.get("final")
        if is_step and rec["step"] < step:
            kept.append(line)
        elif is_step and "loss" in rec:
            cut.append(line)
            steps.append(rec["step"])
    if cut:
        with superseded_path(path).open("a", encoding="utf-8") as fh:
            fh.write("".join(c + "\n" for c in cut))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
    os.replace(tmp, path)
    return steps


def redo_note(redone: list[int], start: int, every: int) -> str | None:
    """The line a start that trains steps again prints (None: it redoes none): which, and why they were lost.
    A restart with no checkpoint to resume from starts over from step 0 (the default run writes none), and
    nothing else would say so."""
    if not redone:
        return None
    if start > 0:
        why = f"resumed from the newest checkpoint, after step {start}"
    elif every == 0:
        why = "no checkpoint is written (--checkpoint.every 0)"
    else:
        why = f"no checkpoint was committed yet (--checkpoint.every {every})"
    return (
        f"hybridpar: this start trains again {len(redone)} steps trained before it ({min(redone)}-{max(redone)}): "
        f"{why}; their first records are kept in metrics.superseded.jsonl"
    )


class MetricsWriter:
    def __init__(self, path: Path, resume_step: int = 0, sinks: Sequence[Any] = (), continues: bool = False) -> None:
        """A fresh file, or (`resume_step` > 0, or `continues`: a start that looked for a checkpoint of
        the run, and may have found none, after a lost node or a crash before the first one) the file of
        the run going on, cut back to the steps before `resume_step`: the steps cut were trained and are
        trained again, kept aside for the report. Step records also go to `sinks` (report/sinks.py),
        closed with the file."""
        self.sinks = list(sinks)
        path.parent.mkdir(parents=True, exist_ok=True)
        going_on = resume_step > 0 or continues
        self.redone: list[int] = []  # steps trained before this start and trained again by it
        if going_on:
            self.redone = keep_before(path, resume_step)
        else:  # a fresh start: no step of this file was trained before
            superseded_path(path).unlink(missing_ok=True)
        self._f = path.open("a" if going_on else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self.sinks and "loss" in record and isinstance(record.get("step"), int):
            scalars = scalars_of(record)
            for sink in self.sinks:
                sink.write(record["step"], scalars)

    def close(self) -> None:
        self._f.close()
        for sink in self.sinks:
            sink.close()


class MetricsDuty:
    """Rank 0: each step's record to `metrics.jsonl` and the sinks. The run's last record (final or
    preempted) comes from the duty that ends the run, through `end`."""

    def __init__(self, cfg: Config, run_id: str, start_step: int) -> None:
        run_dir = Path(cfg.run_dir)
        sinks = open_sinks(cfg.sinks, run_dir, start_step, run_id)
        # A start that resumes (checkpoint.resume auto, as every restart does) goes on with the run's file
        # even where it found no checkpoint and starts at step 0: those steps are redone, not new.
        continues = cfg.checkpoint.resume != "off"
        self.writer = MetricsWriter(run_dir / "metrics.jsonl", start_step, sinks, continues)

    def begin(self, step: int) -> None:
        pass

    def after_step(self, step: int, rec: dict[str, Any]) -> bool:
        self.writer.write(rec)
        return False

    def finish(self) -> None:
        pass

    def end(self, record: dict[str, Any]) -> None:
        """Write the run's last record and close the file and the sinks."""
        self.writer.write(record)
        self.writer.close()


def _fmt_s(s: float) -> str:
    s = int(s)
    return f"{s // 60}:{s % 60:02d}"


class Progress:
    """One redrawn line on a terminal (step, loss, tokens/s, step time, ETA); plain lines every `every`
    steps through `log` (the run's logger: train.log, and the console when it is no terminal). A resumed
    run starts at `start_step`: the ETA is this attempt's pace over the steps this attempt has done."""

    def __init__(
        self, total: int, log: logging.Logger, out: TextIO = sys.stdout, every: int = 25, start_step: int = 0
    ) -> None:
        self.total, self.log, self.out, self.every, self.start = total, log, out, every, start_step
        self.tty = out.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float, step_time_s: float, extra: str = "") -> None:
        done = step + 1
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(1, done - self.start) * (self.total - done)
        line = (
            f"step {done}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
            f"{step_time_s * 1000:.0f} ms/step  ETA {_fmt_s(eta)}{extra}"
        )
        if self.tty:
            width = 24
            bar = "#" * (width * done // self.total) + "-" * (width - width * done // self.total)
            self.out.write(f"\r[{bar}] {line}\033[K" + ("\n" if done == self.total else ""))
            self.out.flush()
        if done % self.every == 0 or done == self.total or done == 1:
            self.log.info(line, extra={"console": not self.tty})  # on a terminal the bar shows it already


class ProgressDuty:
    """Rank 0: the progress line after each step, with the validation loss when the step has one, and a
    line for each decision of the load balancer (metrics.jsonl has it whole)."""

    def __init__(self, cfg: Config, log: logging.Logger, start_step: int) -> None:
        t = cfg.train
        self.log = log
        self.progress = Progress(t.steps, log, every=t.progress_every, start_step=start_step)

    def begin(self, step: int) -> None:
        pass

    def after_step(self, step: int, rec: dict[str, Any]) -> bool:
        extra = f"  val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
        self.progress.update(step, rec["loss"], rec["tokens_per_s"], rec["step_time_s"], extra)
        for e in rec.get("balance", []):
            if e.get("event") == "rebalance":  # a move made, or (balance.mode detect) one it would make
                self.log.info(f"balance: step {step}: {'moved' if e['applied'] else 'would move'}: {e['reason']}")
        return False

    def finish(self) -> None:
        pass
