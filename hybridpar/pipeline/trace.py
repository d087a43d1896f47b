"""Chrome / Perfetto trace files ("Trace Event Format") of per-rank timelines.

One process per source ("measured", "simulated", ...) and one thread per pipeline rank, so that a
measured step and its simulation can be opened side by side in ui.perfetto.dev or
chrome://tracing. Only complete events (ph "X") and metadata events (ph "M") are written: they
need no begin/end pairing and both viewers accept them. Pure Python, no torch.

Categories: "compute" (F/B/W), "comm" (send/receive posting), "wait" (blocked on a message).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

CATEGORIES: tuple[str, ...] = ("compute", "comm", "wait")
_US_PER_S = 1e6
_JSON_SCALARS = (str, int, float, bool, type(None))


@dataclass
class Slice:
    track: int  # pipeline rank: becomes the thread id
    name: str
    start_s: float
    end_s: float
    cat: str = "compute"
    args: dict[str, Any] | None = None


def _clean_args(args: dict[str, Any]) -> dict[str, Any]:
    # The viewers only need text; keep json.dumps from failing on e.g. an Action or an enum.
    return {str(k): v if isinstance(v, _JSON_SCALARS) else str(v) for k, v in args.items()}


def _us(seconds: float) -> float:
    # Microseconds, rounded to the nanosecond so float noise does not clutter the file.
    return round(seconds * _US_PER_S, 3)


def chrome_trace(slices: Sequence[Slice], process_name: str = "hybridpar", pid: int = 0) -> dict:
    """Trace dict {"traceEvents": [...]}; times are relative to the earliest slice's start."""
    for s in slices:
        if not (math.isfinite(s.start_s) and math.isfinite(s.end_s)) or s.end_s < s.start_s:
            raise ValueError(f"slice {s.name!r} on track {s.track}: bad interval " f"[{s.start_s}, {s.end_s}]")
        if s.cat not in CATEGORIES:
            raise ValueError(f"slice {s.name!r}: category {s.cat!r} not in {CATEGORIES}")
    t0 = min((s.start_s for s in slices), default=0.0)
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process_name}}
    ]
    for track in sorted({s.track for s in slices}):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": track, "args": {"name": f"rank {track}"}})
        # Without a sort index Perfetto orders threads by first appearance, not by rank.
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": track, "args": {"sort_index": track}})
    for s in sorted(slices, key=lambda s: (s.track, s.start_s, s.end_s)):
        ev: dict[str, Any] = {
            "ph": "X",
            "name": s.name,
            "cat": s.cat,
            "pid": pid,
            "tid": s.track,
            "ts": _us(s.start_s - t0),
            "dur": _us(s.end_s - s.start_s),
        }
        if s.args:
            ev["args"] = _clean_args(s.args)
        events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _pids(trace: dict) -> set[int]:
    return {ev["pid"] for ev in trace.get("traceEvents", ()) if "pid" in ev}


def merge_traces(*traces: dict) -> dict:
    """One trace holding all of `traces` side by side (e.g. measured beside simulated).

    A trace whose process id is already taken by an earlier one is moved to the next free id, so
    sources never fold into one process row.
    """
    used: set[int] = set()
    merged: list[dict[str, Any]] = []
    for trace in traces:
        remap: dict[int, int] = {}
        for pid in sorted(_pids(trace)):
            new = pid
            while new in used:
                new += 1
            remap[pid] = new
            used.add(new)
        for ev in trace.get("traceEvents", ()):
            ev = dict(ev)
            if "pid" in ev:
                ev["pid"] = remap[ev["pid"]]
            merged.append(ev)
    return {"traceEvents": merged, "displayTimeUnit": "ms"}


def write_trace(trace: dict, path: str) -> None:
    """Write `trace` as JSON (open it in ui.perfetto.dev or chrome://tracing)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f)
