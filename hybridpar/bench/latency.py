"""Per-hop costs of a benchmark case, measured in its own ranks during the same run, and the simulator's
prediction of the step time from them (pipeline/simulate.py over the very action lists the runtime ran).

Measured, per case:

* hop latency: one-way time of one activation-sized message between neighbouring pipeline ranks,
  ping-pong through the runtime's own `P2P` class on the live process group (median round trip / 2;
  one link at a time, the other ranks idle at a barrier; in slices before each timed repeat, so that
  it samples the machine's load over the same stretch of time as the steps);
* from our runtime's timed steps (`StepOutput.timeline` / `waits` and the emulated stages' `SleepLog`):
  a compute action's overhead = its duration - the time it slept - the time it waited for a message
  (median per op and stage); the duration of SEND_* / RECV_* actions (queueing a message); the sleep
  overshoot = actual - requested sleep (median per op; wake-up latency on a loaded machine); and the
  step gap, a rank's time per step outside its action list (zeroing gradients, the runtime's set-up,
  draining sends);
* where each message is actually posted: the runtime's SEND_* / RECV_* actions only queue a message,
  `P2P.flush` posts the queue (`RecordingP2P` records when). A queued message therefore goes out at the
  next flush, which may come several actions later (a W action does not flush). The prediction
  simulates each rank's list with its SEND_* / RECV_* actions moved to the action in which they were
  posted, as measured (`posting_points`, `posted_lists`).

The prediction adds them term by term to the ideal simulation (the nominal F/B/W only) so that each
term's share of the excess over the ideal is reported: + latency, + sleep overshoot, + per-action
overhead (compute dispatch, send/recv posting), + posting at the measured flush points, + step gap.
Increments depend on that order where terms
interact (a latency that a wait hides costs nothing); their sum is the full prediction.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Callable, Sequence

import torch

from hybridpar.pipeline.p2p import P2P
from hybridpar.pipeline.ping import ping_pong
from hybridpar.pipeline.schedules import Action, Op
from hybridpar.pipeline.simulate import Costs, SimResult, simulate

_COMPUTE = ("F", "B", "W")


def neighbour_links(ranks: Sequence[int]) -> list[tuple[int, int]]:
    """Pipeline-rank pairs (a, b), a < b unless the stages wrap, whose consecutive stages exchange messages
    under the placement `ranks` (ranks[s]: rank of stage s): r -> r + 1, plus pp - 1 -> 0 where looped
    chunks wrap around (interleaved, pp > 2); a V (ZB-V) turns on one rank and adds no link."""
    links: list[tuple[int, int]] = []
    for a, b in zip(ranks, ranks[1:]):
        if a != b and (a, b) not in links and (b, a) not in links:
            links.append((a, b))
    return links


def round_trips(
    p2p: P2P,
    me: int,
    links: Sequence[tuple[int, int]],
    peer: Callable[[int], int],
    shape: tuple[int, ...],
    barrier: Callable[[], None],
    n: int,
    warmup: int = 5,
    into: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Round-trip seconds of each link this rank starts ("a->b": [...]), appended to `into`."""
    out = into if into is not None else {}
    for a, b in links:
        barrier()
        if me in (a, b):
            rtts = ping_pong(p2p, me, a, b, peer, shape, n, warmup)
            if rtts:
                out.setdefault(f"{a}->{b}", []).extend(rtts)
    barrier()
    return out


class RecordingP2P(P2P):
    """The runtime's P2P, recording the time of every flush that posts queued messages."""

    def __init__(self, device: torch.device, dtype: torch.dtype, timeout_s: float, transport: str = "auto") -> None:
        super().__init__(device, dtype, timeout_s, transport=transport)
        self.posts: list[float] = []
        self._queued = False

    def queue_send(self, tensor: torch.Tensor, peer: int) -> None:
        self._queued = True
        super().queue_send(tensor, peer)

    def queue_recv(self, key, shape: tuple[int, ...], peer: int, borrow: bool = False) -> None:
        self._queued = True
        super().queue_recv(key, shape, peer, borrow)

    def flush(self) -> None:
        if self._queued:
            self.posts.append(time.perf_counter())
            self._queued = False
        super().flush()


def posting_points(timeline: Sequence, posts: Sequence[float]) -> list[int | None]:
    """For each action of one step's timeline: None for compute; for SEND_* / RECV_*, the index of the
    action during which the runtime posted it (the first flush after it was queued), len(timeline)
    when that was after the last action (the step's final wait_sends)."""
    out: list[int | None] = []
    ps = sorted(posts)
    k = 0
    for i, t in enumerate(timeline):
        if t.action.is_compute:
            out.append(None)
            continue
        while k < len(ps) and ps[k] < t.end:
            k += 1
        p = ps[k] if k < len(ps) else float("inf")
        j = next((j for j in range(i + 1, len(timeline)) if timeline[j].start <= p <= timeline[j].end), len(timeline))
        out.append(j)
    return out


def posted_lists(actions: list[list[Action]], points: Sequence[Sequence[int | None]]) -> list[list[Action]]:
    """Each rank's list with every SEND_* / RECV_* moved to just before the action it was posted in
    (`posting_points`), keeping their order; identical to `actions` where each is posted at once."""
    out = []
    for acts, pts in zip(actions, points):
        assert len(acts) == len(pts), "posting points of another action list"
        moved: dict[int, list[Action]] = defaultdict(list)
        for a, j in zip(acts, pts):
            if j is not None:
                moved[j].append(a)
        row: list[Action] = []
        for i, a in enumerate(acts):
            row += moved.pop(i, [])
            if pts[i] is None:
                row.append(a)
        out.append(row + moved.pop(len(acts), []))
    return out


class StepSamples:
    """Per-action cost samples of one rank over our runtime's timed steps (JSON-serialisable lists)."""

    def __init__(self) -> None:
        self.overhead: dict[str, list[float]] = defaultdict(list)  # "F3": duration - slept - waited
        self.comm: dict[str, list[float]] = defaultdict(list)  # "SEND" | "RECV": action durations
        self.overshoot: dict[str, list[float]] = defaultdict(list)  # "F" | "B" | "W": actual - requested
        self.gap: list[float] = []  # per step: wall of the step minus the span of its actions

    def add_step(
        self,
        timeline: Sequence,
        waits: Sequence,
        sleeps: Sequence[tuple[str, float, float, float]],
        step_start: float,
        step_end: float,
    ) -> None:
        """timeline/waits: the runtime's ActionTime lists of one step; sleeps: SleepLog entries of it;
        step_start/end: perf_counter around the whole step, zeroing of gradients included."""
        for op, req, s0, s1 in sleeps:
            self.overshoot[op].append((s1 - s0) - req)
        sl = sorted(sleeps, key=lambda e: e[2])
        wt = sorted(waits, key=lambda w: w.start)
        i = j = 0
        for t in timeline:  # in order and disjoint: every sleep and wait lies inside one action
            slept = waited = 0.0
            while i < len(sl) and sl[i][2] < t.end:
                if sl[i][2] >= t.start:
                    slept += sl[i][3] - sl[i][2]
                i += 1
            while j < len(wt) and wt[j].start < t.end:
                if wt[j].start >= t.start:
                    waited += wt[j].end - wt[j].start
                j += 1
            op = t.action.op.value
            if op in _COMPUTE:
                self.overhead[f"{op}{t.action.stage}"].append(t.end - t.start - slept - waited)
            else:
                self.comm[op.split("_")[0]].append(t.end - t.start)
        if timeline:
            self.gap.append((step_end - step_start) - (timeline[-1].end - timeline[0].start))

    def to_dict(self) -> dict:
        return {
            "overhead": dict(self.overhead),
            "comm": dict(self.comm),
            "overshoot": dict(self.overshoot),
            "gap": self.gap,
        }


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def summarize(ranks: Sequence[dict], latencies: Sequence[dict[str, list[float]]]) -> dict:
    """Pool every rank's StepSamples.to_dict() and round trips (`round_trips`), in seconds.

    The hop latency is the median over links of each link's median RTT / 2. Per-action costs come as
    means (the fields the simulator is fed with) and medians (`*_median_s`): a step adds up the costs
    of the actions on its critical path, so its expected time follows their means, and on a loaded
    machine their distribution has a long tail (an occasional descheduled rank) that a median drops."""
    pool: dict[str, dict[str, list[float]]] = {
        "overhead": defaultdict(list),
        "comm": defaultdict(list),
        "overshoot": defaultdict(list),
    }
    gaps: list[float] = []
    for rk in ranks:
        for part in pool:
            for k, xs in rk[part].items():
                pool[part][k] += xs
        gaps += rk["gap"]
    links = {k: _median(v) / 2 for lat in latencies for k, v in lat.items()}  # one way: RTT / 2
    by_op: dict[str, list[float]] = defaultdict(list)
    for k, xs in pool["overhead"].items():
        by_op[k[0]] += xs
    out: dict = {"hop_latency_s": _median(list(links.values())), "hop_latency_per_link_s": dict(sorted(links.items()))}
    for suffix, stat in (("_s", _mean), ("_median_s", _median)):
        out.update(
            {
                f"compute_overhead{suffix}": {op: stat(by_op[op]) for op in _COMPUTE if by_op[op]},
                f"compute_overhead_per_stage{suffix}": {k: stat(xs) for k, xs in sorted(pool["overhead"].items())},
                f"send_overhead{suffix}": stat(pool["comm"].get("SEND", [])),
                f"recv_overhead{suffix}": stat(pool["comm"].get("RECV", [])),
                f"sleep_overshoot{suffix}": {op: stat(xs) for op, xs in sorted(pool["overshoot"].items())},
                f"step_gap{suffix}": stat(gaps),
            }
        )
    out["compute_overhead_p90_s"] = {
        op: statistics.quantiles(by_op[op], n=10)[-1] for op in _COMPUTE if len(by_op[op]) >= 2
    }
    return out


def _per_stage(n_stages: int, base: float, op: str, extra: Callable[[str, int], float]) -> list[float]:
    return [max(0.0, base + extra(op, s)) for s in range(n_stages)]


def predict(
    actions: list[list[Action]],
    pp: int,
    ranks: Sequence[int],
    nominal: dict[str, float],
    measured: dict,
    posted: list[list[Action]] | None = None,
) -> tuple[dict, SimResult]:
    """Simulate `actions` (every rank's list) under the nominal per-action seconds ({"F", "B", "W"}:
    what each action sleeps, 0 for real compute) plus the measured costs (`summarize` output); the
    full prediction runs `posted` (`posted_lists`: the same lists, messages where they were posted).
    `ranks[s]` is the rank of stage s (the schedule's placement).

    Each compute action costs nominal + mean sleep overshoot of its op + (its op and stage's mean
    overhead - the smallest such mean); that smallest mean is the simulator's common
    `compute_overhead_s` (dispatch, not busy time). Returns the JSON fields and the full simulation."""
    n_stages = len(ranks)
    over = measured["compute_overhead_per_stage_s"]
    floor = min(over.values(), default=0.0)
    shoot = measured["sleep_overshoot_s"]

    def costs(lat: bool, overshoot: bool, overhead: bool) -> Costs:
        def extra(op: str, s: int) -> float:
            return (shoot.get(op, 0.0) if overshoot else 0.0) + (
                over.get(f"{op}{s}", floor) - floor if overhead else 0.0
            )

        return Costs(
            forward_s=_per_stage(n_stages, nominal["F"], "F", extra),
            backward_s=_per_stage(n_stages, nominal["B"], "B", extra),
            weight_s=_per_stage(n_stages, nominal["W"], "W", extra),
            latency_s=measured["hop_latency_s"] if lat else 0.0,
            send_overhead_s=measured["send_overhead_s"] if overhead else 0.0,
            recv_overhead_s=measured["recv_overhead_s"] if overhead else 0.0,
            compute_overhead_s=floor if overhead else 0.0,
        )

    steps = [
        simulate(actions, pp, n_stages, costs(*flags), ranks=ranks).step_time_s
        for flags in ((False, False, False), (True, False, False), (True, True, False), (True, True, True))
    ]
    full = simulate(posted or actions, pp, n_stages, costs(True, True, True), ranks=ranks)
    gap = measured["step_gap_s"]
    total = full.step_time_s + gap
    # Busy as the emulated ranks measure it (bench/pipeline.py): the time actually slept, i.e.
    # nominal + overshoot per compute action; overheads and waits are bubble.
    busy = sum(
        nominal[a.op.value] + (shoot.get(a.op.value, 0.0) if nominal[a.op.value] > 0 else 0.0)
        for acts in actions
        for a in acts
        if a.op in (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)
    )
    fields = {
        "sim_ideal_step_time_s": steps[0],
        "sim_step_time_s": total,
        "sim_bubble": 1.0 - busy / (pp * total) if total > 0 else 0.0,
        "sim_breakdown_s": {
            "ideal": steps[0],
            "hop_latency": steps[1] - steps[0],
            "sleep_overshoot": steps[2] - steps[1],
            "action_overhead": steps[3] - steps[2],
            "posting_delay": full.step_time_s - steps[3],
            "step_gap": gap,
        },
    }
    return fields, full
