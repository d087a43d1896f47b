"""Run outputs: `metrics.jsonl` (one JSON object per line, flushed as written, so a crash keeps every
finished step) and the terminal progress line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO


class MetricsWriter:
    def __init__(self, path: Path, append: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("a" if append else "w", encoding="utf-8")  # append: a resumed run continues the file

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _fmt_s(s: float) -> str:
    s = int(s)
    return f"{s // 60}:{s % 60:02d}"


class Progress:
    """One redrawn line on a terminal (step, loss, tokens/s, step time, ETA); plain lines every
    `every` steps when the output is a file or pipe (CI logs)."""

    def __init__(self, total: int, out: TextIO = sys.stdout, every: int = 25) -> None:
        self.total, self.out, self.every = total, out, every
        self.tty = out.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float, step_time_s: float, extra: str = "") -> None:
        done = step + 1
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.total - done)
        width = 24
        bar = "#" * (width * done // self.total) + "-" * (width - width * done // self.total)
        line = (f"[{bar}] step {done}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
                f"{step_time_s * 1000:.0f} ms/step  ETA {_fmt_s(eta)}{extra}")
        if self.tty:
            self.out.write("\r" + line + "\033[K")
            if done == self.total:
                self.out.write("\n")
        elif done % self.every == 0 or done == self.total or done == 1:
            self.out.write(line + "\n")
        self.out.flush()
