"""The critical path of measured pipeline steps (emulated mode): the chain of compute windows and
what lies between them that sets the time of a run of steps, with each part's cost. It adds up to
the measured time exactly, so every millisecond is attributed. Consecutive steps overlap across
ranks (rank 0 starts step k+1 while the last rank finishes step k), so the walk runs over a whole
run of steps, not one step.

Walking back from the window that ends last: a window's predecessor is the producer of the message
its action waited for (F(s-1, m) for F(s, m), B(s+1, m) for B(s, m)) if that window ended only after
the wait began (the message could not have been there: a hop), else the previous window on its own
rank (an intra-rank gap: the runtime's work between two actions, waits for messages already sent
included). Parts: the windows' requested lengths (the ideal work) and overshoot, the hops (producer's
window end -> consumer's window start: the runtime's work after the window, the transport, the
wake-up and the runtime's work before the next window), the intra-rank gaps, the start (step start
-> first window) and the end (last window -> step end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hybridpar.pipeline.schedules import Action, Op

_PRODUCER = {Op.FORWARD: (-1, Op.FORWARD), Op.BACKWARD: (1, Op.BACKWARD)}


@dataclass(frozen=True)
class Window:
    """One compute window of a rank: its action, requested seconds and actual span."""

    action: Action
    requested: float
    start: float
    end: float
    step: int = 0  # which step of the run


def per_step(paths: Sequence[dict], steps: int) -> dict:
    """Each part per step, over several runs of `steps` steps, and the mean cost of one hop."""
    keys = [k for k in paths[0] if k != "path"]
    out = {k: sum(p[k] for p in paths) / (len(paths) * steps) for k in keys}
    out["hop_s"] = out["hops_s"] / out["n_hops"] if out["n_hops"] else 0.0
    out["runs"], out["steps_per_run"] = len(paths), steps
    return out


def windows_of(timeline: Sequence, sleeps: Sequence[tuple[str, float, float, float]], step: int = 0) -> list[Window]:
    """Pair a rank's SleepLog entries of one step with the compute actions (runtime ActionTime) that
    contain them; an action with several windows (a full backward with a W path) is one window."""
    out: list[Window] = []
    sl = sorted(sleeps, key=lambda e: e[2])
    i = 0
    for t in timeline:
        if not t.action.is_compute:
            continue
        inside = []
        while i < len(sl) and sl[i][2] < t.end:
            if sl[i][2] >= t.start:
                inside.append(sl[i])
            i += 1
        if inside:
            out.append(Window(t.action, sum(e[1] for e in inside), inside[0][2], inside[-1][3], step))
    return out


def critical_path(
    windows: Sequence[Sequence[Window]], waits: Sequence[Sequence[Window]], step_start: float, step_end: float
) -> dict:
    """windows[r]: rank r's windows over the run, in time order; waits[r]: its receive waits (RECV_*
    action, start, end, step; `requested` unused); the run's start and end. Seconds, plus counts and
    the path (actions, last first)."""
    where = {(w.step, w.action): (r, i) for r, ws in enumerate(windows) for i, w in enumerate(ws)}
    waited = {}
    for r, ws in enumerate(waits):
        for w in ws:
            op = Op.FORWARD if w.action.op == Op.RECV_F else Op.BACKWARD
            waited[(w.step, Action(w.action.stage, op, w.action.microbatch))] = w
    parts = dict(work=0.0, overshoot=0.0, hops=0.0, intra=0.0, start=0.0, end=0.0)
    n_hops = n_intra = 0
    path: list[str] = []
    r = max(range(len(windows)), key=lambda k: windows[k][-1].end if windows[k] else float("-inf"))
    i = len(windows[r]) - 1
    parts["end"] = step_end - windows[r][i].end
    while True:
        w = windows[r][i]
        parts["work"] += w.requested
        parts["overshoot"] += (w.end - w.start) - w.requested
        path.append(str(w.action))
        a, wait = w.action, waited.get((w.step, w.action))
        prod = None
        if wait is not None and a.op in _PRODUCER:
            ds, op = _PRODUCER[a.op]
            prod = where.get((w.step, Action(a.stage + ds, op, a.microbatch)))
        if prod is not None and windows[prod[0]][prod[1]].end > wait.start:
            parts["hops"] += w.start - windows[prod[0]][prod[1]].end
            n_hops += 1
            r, i = prod
        elif i > 0:
            parts["intra"] += w.start - windows[r][i - 1].end
            n_intra += 1
            i -= 1
        else:
            parts["start"] = w.start - step_start
            break
    total = step_end - step_start
    return {
        **{f"{k}_s": v for k, v in parts.items()},
        "n_hops": n_hops,
        "n_intra": n_intra,
        "step_s": total,
        "path": path,
    }
