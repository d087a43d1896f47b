"""`train.log`: what a training run says, through Python's `logging`, one line per message, each
prefixed with the rank that said it. The console shows the same lines (without the time); a file
keeps them with the time, appended by every rank of every launch of the run, so a resumed run's log
follows its first part.

A record logged with `extra={"console": False}` goes to the file only: the progress bar on a terminal
redraws one line in place, and its periodic plain lines are kept in the file.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOG_FILE = "train.log"


class _ConsoleOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "console", True)


@contextmanager
def run_log(run_dir: Path | None, rank: int, console: bool = True) -> Iterator[logging.Logger]:
    """A logger for this rank of a run, writing to `<run_dir>/train.log` (if `run_dir`) and to stdout (if
    `console`); its handlers are removed when the block ends, so a process may run several trainings."""
    log = logging.getLogger(f"hybridpar.run.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False  # the lines are ours to place; an application's root handlers would repeat them
    handlers: list[logging.Handler] = []
    if console:
        out = logging.StreamHandler(sys.stdout)
        out.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
        out.addFilter(_ConsoleOnly())
        handlers.append(out)
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        f = logging.FileHandler(Path(run_dir) / LOG_FILE, mode="a", encoding="utf-8")
        f.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s"))
        handlers.append(f)
    for h in handlers:
        log.addHandler(h)
    try:
        yield log
    finally:
        for h in handlers:
            log.removeHandler(h)
            h.close()
