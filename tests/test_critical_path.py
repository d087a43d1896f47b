"""The critical path of measured steps (bench/critical_path.py): pure, on hand-made timelines."""

from __future__ import annotations

from types import SimpleNamespace

from hybridpar.bench.critical_path import Window, critical_path, per_step, windows_of
from hybridpar.pipeline.schedules import Action, Op


def _w(stage, op, mb, start, end, requested=None, step=0):
    return Window(Action(stage, Op(op), mb), end - start if requested is None else requested, start, end, step)


def test_the_path_follows_binding_messages_and_adds_up_to_the_measured_time():
    # Two ranks, one microbatch: F0 on rank 0 (0-10), F1 on rank 1 (11.5-21.5, waited from 1 for F0's
    # activation: binding), B1 (22-42), B0 on rank 0 (43-63, waited from 11 for B1's gradient:
    # binding). Rank 0's F1 of a second microbatch (10.5-20.5) is not on the path.
    r0 = [_w(0, "F", 0, 0.0, 10.0), _w(0, "F", 1, 10.5, 20.5), _w(0, "B", 0, 43.0, 63.2, requested=20.0)]
    r1 = [_w(1, "F", 0, 11.5, 21.5), _w(1, "B", 0, 22.0, 42.0)]
    waits = [[_w(0, "RECV_B", 0, 21.0, 42.8)], [_w(1, "RECV_F", 0, 1.0, 11.2)]]
    cp = critical_path([r0, r1], waits, step_start=-0.5, step_end=63.5)
    assert cp["path"] == ["B0.0", "B1.0", "F1.0", "F0.0"]
    assert (cp["n_hops"], cp["n_intra"]) == (2, 1)
    assert abs(cp["hops_s"] - ((11.5 - 10.0) + (43.0 - 42.0))) < 1e-9
    assert abs(cp["intra_s"] - 0.5) < 1e-9 and abs(cp["overshoot_s"] - 0.2) < 1e-9
    assert abs(cp["work_s"] - 60.0) < 1e-9 and abs(cp["start_s"] - 0.5) < 1e-9 and abs(cp["end_s"] - 0.3) < 1e-9
    parts = sum(cp[k] for k in ("work_s", "overshoot_s", "hops_s", "intra_s", "start_s", "end_s"))
    assert abs(parts - cp["step_s"]) < 1e-9 and cp["step_s"] == 64.0


def test_a_message_already_sent_when_the_wait_began_is_not_a_hop():
    # Rank 1 waited for F0's activation only from 12, after F0 had ended at 10: its own previous
    # window (ending at 11) set its start, not the message.
    r0 = [_w(0, "F", 0, 0.0, 10.0)]
    r1 = [_w(1, "F", 5, 1.0, 11.0, step=0), _w(1, "F", 0, 12.5, 22.5)]
    cp = critical_path([r0, r1], [[], [_w(1, "RECV_F", 0, 12.0, 12.4)]], 0.0, 23.0)
    assert cp["path"] == ["F1.0", "F1.5"] and cp["n_hops"] == 0 and abs(cp["intra_s"] - 1.5) < 1e-9


def test_steps_are_matched_by_their_index_and_reported_per_step():
    # The same action in two steps: the wait of step 1 binds to step 1's producer (whose own previous
    # window, step 0's, comes before it), not to step 0's.
    r0 = [_w(0, "F", 0, 0.0, 10.0, step=0), _w(0, "F", 0, 30.0, 40.0, step=1)]
    r1 = [_w(1, "F", 0, 11.0, 21.0, step=0), _w(1, "F", 0, 41.0, 51.0, step=1)]
    waits = [[], [_w(1, "RECV_F", 0, 1.0, 10.9, step=0), _w(1, "RECV_F", 0, 22.0, 40.9, step=1)]]
    cp = critical_path([r0, r1], waits, 0.0, 51.0)
    assert cp["path"] == ["F1.0", "F0.0", "F0.0"] and cp["n_hops"] == 1
    assert abs(cp["intra_s"] - 20.0) < 1e-9  # rank 0's idle time between its two forwards
    per = per_step([cp, cp], steps=2)
    assert per["n_hops"] == 0.5 and abs(per["hop_s"] - 1.0) < 1e-9 and per["runs"] == 2 and per["step_s"] == 25.5


def test_windows_are_paired_with_the_compute_actions_that_hold_them():
    act = lambda s, op, m, a, b: SimpleNamespace(action=Action(s, Op(op), m), start=a, end=b)  # noqa: E731
    timeline = [
        act(1, "RECV_F", 0, 0.0, 0.1),
        act(1, "F", 0, 0.1, 21.0),
        act(1, "SEND_F", 0, 21.0, 21.1),
        act(1, "B", 0, 22.0, 63.0),
    ]
    # The B action holds two windows (a full backward with a W path): one window, their sum requested.
    sleeps = [("F", 0.02, 0.5, 20.9), ("W", 0.01, 22.1, 32.2), ("B", 0.03, 32.2, 62.5)]
    ws = windows_of(timeline, sleeps, step=3)
    assert [(str(w.action), w.requested, w.start, w.end, w.step) for w in ws] == [
        ("F1.0", 0.02, 0.5, 20.9, 3),
        ("B1.0", 0.04, 22.1, 62.5, 3),
    ]
