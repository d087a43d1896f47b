"""Tests for hybridpar.pipeline.trace: Chrome/Perfetto trace JSON structure."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from hybridpar.pipeline.schedules import Action, Op
from hybridpar.pipeline.trace import Slice, chrome_trace, merge_traces, write_trace


def sample() -> list[Slice]:
    return [
        Slice(1, "F1.0", 10.5, 10.75),
        Slice(0, "F0.0", 10.0, 10.5, args={"action": Action(0, Op.FORWARD, 0), "mb": 0}),
        Slice(0, "SEND_F0.0", 10.5, 10.5005, cat="comm"),
        Slice(1, "wait", 10.0, 10.5, cat="wait"),
    ]


def xs(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def meta(trace: dict, name: str) -> dict[tuple[int, int], str]:
    return {
        (e["pid"], e["tid"]): e["args"].get("name", e["args"].get("sort_index"))
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == name
    }


def test_structure_and_units() -> None:
    trace = chrome_trace(sample(), process_name="measured", pid=3)
    events = xs(trace)
    assert len(events) == 4
    assert all(e["pid"] == 3 and set(e) >= {"name", "cat", "ph", "ts", "dur", "tid"} for e in events)
    by_name = {e["name"]: e for e in events}
    # Microseconds, relative to the earliest slice (10.0 s).
    assert by_name["F0.0"]["ts"] == 0.0 and by_name["F0.0"]["dur"] == 500000.0
    assert by_name["F1.0"]["ts"] == 500000.0 and by_name["F1.0"]["dur"] == 250000.0
    assert by_name["SEND_F0.0"]["dur"] == pytest.approx(500.0)
    assert by_name["F1.0"]["tid"] == 1 and by_name["F0.0"]["tid"] == 0
    assert by_name["wait"]["cat"] == "wait" and by_name["SEND_F0.0"]["cat"] == "comm"
    assert by_name["F0.0"]["args"] == {"action": "F0.0", "mb": 0}  # made JSON-safe
    assert "args" not in by_name["F1.0"]
    assert meta(trace, "thread_name") == {(3, 0): "rank 0", (3, 1): "rank 1"}
    assert meta(trace, "process_name") == {(3, 0): "measured"}
    assert meta(trace, "thread_sort_index") == {(3, 0): 0, (3, 1): 1}
    json.loads(json.dumps(trace))


def test_empty_and_bad_slices() -> None:
    trace = chrome_trace([])
    assert xs(trace) == [] and meta(trace, "process_name") == {(0, 0): "hybridpar"}
    with pytest.raises(ValueError, match="bad interval"):
        chrome_trace([Slice(0, "F0.0", 2.0, 1.0)])
    with pytest.raises(ValueError, match="category 'gpu'"):
        chrome_trace([Slice(0, "F0.0", 1.0, 2.0, cat="gpu")])


def test_merge_keeps_distinct_pids() -> None:
    a = chrome_trace(sample(), process_name="measured")
    b = chrome_trace(sample()[:2], process_name="simulated")  # same default pid 0
    c = chrome_trace(sample()[:1], process_name="other", pid=1)
    before = json.dumps(b)
    merged = merge_traces(a, b, c)
    assert json.dumps(b) == before  # inputs untouched
    procs = meta(merged, "process_name")
    assert sorted(procs.values()) == ["measured", "other", "simulated"]
    assert len({pid for pid, _ in procs}) == 3
    pid_of = {name: pid for (pid, _), name in procs.items()}
    assert pid_of["measured"] == 0
    assert [e["pid"] for e in xs(merged)] == [0] * 4 + [pid_of["simulated"]] * 2 + [pid_of["other"]]
    assert len(merged["traceEvents"]) == sum(len(t["traceEvents"]) for t in (a, b, c))
    json.dumps(merged)


def test_write_trace_round_trip(tmp_path) -> None:  # noqa: ANN001
    trace = chrome_trace(sample())
    path = tmp_path / "trace.json"
    write_trace(trace, str(path))
    assert json.loads(path.read_text()) == trace


@dataclass
class Timed:  # the shape of runtime.ActionTime
    action: Action
    start: float
    end: float
