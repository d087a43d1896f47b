"""Discrete-event simulation of the action lists the pipeline runtime executes.

It runs ``build_schedule(...)`` output literally (compute and SEND/RECV actions, per rank, in list
order) under per-action costs and a link model, and predicts the step time, a per-rank timeline
and the bubble. Pure Python: usable for planning before any GPU is allocated.

Model (chosen to match ``runtime.py`` + ``p2p.py``):

* A rank is one thread running its list in order; it blocks only at a compute action whose input
  has not arrived (the runtime's ``wait_recv``), never at a send or a receive posting.
* SEND_x costs ``send_overhead_s`` on the sender; RECV_x costs ``recv_overhead_s`` (posting only).
* NCCL point-to-point is a rendezvous, so a transfer starts once both its send and its receive are
  posted; each directed link (src rank -> dst rank) carries one transfer at a time, in send order
  (NCCL matches per peer pair in posting order). Only the transfer part ``bytes / bandwidth``
  occupies the link; the latency is pipelined (a later message may start while an earlier one is
  still in flight), i.e. ``arrival = max(send, recv, link free) + latency + bytes / bandwidth``.
* A compute action begins at max(rank free, its inputs ready); its event spans the dispatch
  overhead ``compute_overhead_s`` followed by its cost. Only the cost counts as busy time, so
  overheads show up in the bubble, as they do on a real GPU.

* Shared cores (optional, ``CoreSharing``): CPU ranks that outnumber their node's cores share them.
  Compute actions then progress by processor sharing: while n ranks of a node compute, each runs at
  rate min(1, capacity / n) of its own speed, so a cost is the action's time on a core of its own.
  This needs the global time order, so the simulation then advances all ranks' compute in time
  (O(ranks) per event); without it ranks are independent devices, as GPUs are.

Messages are matched by identity, not by posting order: run ``validate_schedule`` (as
``build_schedule`` does) to catch receive orders NCCL would mismatch.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Sequence

from hybridpar.pipeline.schedules import RECVS, SENDS, Action, Op, ScheduleError, placement
from hybridpar.pipeline.sim_program import RECV, SEND, Program, compile_program
from hybridpar.pipeline.trace import Slice, chrome_trace


@dataclass(frozen=True)
class Costs:
    """Seconds per action; a per-stage cost is a float (same for every stage) or one per stage."""

    forward_s: float | Sequence[float]
    backward_s: float | Sequence[float]  # the input-grad half when the schedule has W, else all of B
    weight_s: float | Sequence[float] = 0.0  # W actions
    latency_s: float = 0.0  # per message, from the transfer's start to arrival, before transfer time
    bandwidth_Bps: float = float("inf")
    message_bytes: int = 0  # bytes of one activation / gradient message
    send_overhead_s: float = 0.0  # CPU time the sender spends posting a send (blocks its rank)
    recv_overhead_s: float = 0.0  # CPU time to post a receive
    compute_overhead_s: float = 0.0  # fixed per-compute-action dispatch cost on the rank
    # Per microbatch, a factor on its compute costs and message bytes (unequal microbatch sizes:
    # size / reference size); None = every microbatch alike.
    microbatch_scale: Sequence[float] | None = None
    # Per stage, the part of each F/B/W spent waiting on collectives inside it (tensor parallelism), on
    # top of its cost: time, but no work, so shared cores do not slow it.
    forward_comm_s: float | Sequence[float] = 0.0
    backward_comm_s: float | Sequence[float] = 0.0
    weight_comm_s: float | Sequence[float] = 0.0

    def __post_init__(self) -> None:
        for label in ("latency_s", "message_bytes", "send_overhead_s", "recv_overhead_s", "compute_overhead_s"):
            value = getattr(self, label)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{label} must be a finite number >= 0, got {value!r}")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"bandwidth_Bps must be > 0, got {self.bandwidth_Bps!r}")
        if self.microbatch_scale is not None and not all(math.isfinite(x) and x > 0 for x in self.microbatch_scale):
            raise ValueError(f"microbatch_scale must be finite numbers > 0, got {list(self.microbatch_scale)}")

    def per_stage(self, n_stages: int, comm: bool = False) -> dict[Op, list[float]]:
        """Cost of each compute op at each stage (`comm`: its collective waits)."""
        out: dict[Op, list[float]] = {}
        for op, label in ((Op.FORWARD, "forward"), (Op.BACKWARD, "backward"), (Op.WEIGHT, "weight")):
            label += "_comm_s" if comm else "_s"
            value = getattr(self, label)
            vals = [float(value)] * n_stages if isinstance(value, (int, float)) else list(value)
            if len(vals) != n_stages:
                raise ValueError(f"{label} has {len(vals)} entries for {n_stages} stages")
            if not all(math.isfinite(x) and x >= 0 for x in vals):
                raise ValueError(f"{label} must be finite and >= 0, got {vals}")
            out[op] = vals
        return out

    def transfer_s(self) -> float:
        return 0.0 if self.message_bytes == 0 else self.message_bytes / self.bandwidth_Bps


@dataclass(frozen=True)
class CoreSharing:
    """Pipeline rank r sits on node node_of[r]; a node sustains `capacity[node]` ranks' compute at once
    (its cores, in units of one rank's rate)."""

    node_of: tuple[int, ...]
    capacity: tuple[float, ...]

    def __post_init__(self) -> None:
        if not all(0 <= n < len(self.capacity) for n in self.node_of):
            raise ValueError(f"node_of {self.node_of} names nodes outside capacity's {len(self.capacity)}")
        if not all(math.isfinite(c) and c > 0 for c in self.capacity):
            raise ValueError(f"capacity must be finite numbers > 0, got {self.capacity}")


@dataclass
class SimEvent:
    rank: int
    action: Action
    start: float  # when the rank began the action (after waiting; includes dispatch overhead)
    end: float
    wait_s: float  # time the rank sat blocked before this action could start


@dataclass
class SimResult:
    step_time_s: float
    events: list[SimEvent]
    busy_s: list[float]  # compute time per rank (overheads excluded; with shared cores, stretched by sharing)
    bubble_fraction: float  # 1 - sum(busy) / (n_ranks * step_time)
    arrivals: dict[Action, float] = field(default_factory=dict)  # send action -> arrival time


def simulate(
    actions: list[list[Action]] | Program,
    pp: int,
    n_stages: int,
    costs: Costs,
    *,
    ranks: Sequence[int] | None = None,
    sharing: CoreSharing | None = None,
) -> SimResult:
    """Run per-rank action lists (as from ``build_schedule``, or lowered once by ``compile_program`` to be
    simulated under many costs) under `costs`; `ranks[s]` is the rank of stage s (the schedule's placement,
    ``ScheduleSpec.stage_ranks``; None = s % pp); `sharing`: ranks that share cores (module docstring).

    Event-driven: a rank runs until it needs a time that is not known yet, then sleeps on that key
    until it is resolved, so each action is handled O(1) times. Raises ScheduleError when some
    action can never start (deadlock) or a message has no partner.
    """
    if isinstance(actions, Program):
        prog = actions
        if (prog.pp, prog.n_stages) != (pp, n_stages) or prog.ranks != tuple(placement(ranks, pp, n_stages)):
            raise ValueError(f"the program is for pp={prog.pp}, {prog.n_stages} stages on ranks {list(prog.ranks)}")
    else:
        prog = compile_program(actions, pp, n_stages, ranks)
    if sharing is not None and len(sharing.node_of) != pp:
        raise ValueError(f"sharing.node_of has {len(sharing.node_of)} entries for {pp} ranks")
    work, wait_of = _action_costs(prog, costs)
    run = _EventRun(prog, costs, work, wait_of, sharing)
    run.run()
    return run.result()


def _action_costs(prog: Program, costs: Costs) -> tuple[list[float], list[float]]:
    """Per action: its compute cost and collective wait (compute), or its transfer time (send); 0 else."""
    acts, n = prog.acts, len(prog.acts)
    cost, comm = costs.per_stage(prog.n_stages), costs.per_stage(prog.n_stages, comm=True)
    by_op = [cost[Op.FORWARD], cost[Op.BACKWARD], cost[Op.WEIGHT]]
    comm_by_op = [comm[Op.FORWARD], comm[Op.BACKWARD], comm[Op.WEIGHT]]
    xfer = costs.transfer_s()
    scale = costs.microbatch_scale
    if scale is not None:
        m = 1 + max((a.microbatch for a in acts), default=-1)
        if len(scale) != m:
            raise ValueError(f"microbatch_scale has {len(scale)} entries for {m} microbatches")
    work, wait_of = [0.0] * n, [0.0] * n
    for i, (a, o) in enumerate(zip(acts, prog.op)):
        k = 1.0 if scale is None else scale[a.microbatch]
        if o >= 0:
            work[i], wait_of[i] = by_op[o][a.stage] * k, comm_by_op[o][a.stage] * k
        elif prog.kind[i] == SEND:
            work[i] = xfer if scale is None else xfer * k
    return work, wait_of


class _EventRun:
    """The state of one simulation and its three moves: run a rank until it blocks (`_run_rank`), let
    the compute in progress on shared cores advance to the next event (`_finish_shared`), and hand the
    transfers of a link to the wire in send order (`_pump`). `result` reads the outcome."""

    def __init__(
        self, prog: Program, costs: Costs, work: list[float], wait_of: list[float], sharing: CoreSharing | None
    ) -> None:
        pp, n = prog.pp, len(prog.acts)
        self.prog, self.work, self.wait_of, self.sharing = prog, work, wait_of, sharing
        self.latency, self.send_ovh = costs.latency_s, costs.send_overhead_s
        self.recv_ovh, self.ovh = costs.recv_overhead_s, costs.compute_overhead_s
        self.known: list[float | None] = [None] * prog.n_keys  # resolved keys -> time
        self.sleepers: dict[int, list[int]] = {}
        self.ptr, self.free, self.busy = list(prog.lo[:pp]), [0.0] * pp, [0.0] * pp
        self.order: list[int] = []  # actions in the order they finished
        self.begins, self.ends, self.waits = [0.0] * n, [0.0] * n, [0.0] * n
        # Per link: sends (message key, transfer time) in posting order, the next one to transfer, when it
        # frees up.
        self.queue: list[list[tuple[int, float]]] = [[] for _ in range(prog.links)]
        self.head, self.link_free = [0] * prog.links, [0.0] * prog.links
        self.posted_send: list[float | None] = [None] * prog.n_keys  # message key -> post time of its send
        self.posted_recv: list[float | None] = [None] * prog.n_keys  # ... and of its receive
        self.arrived: list[int] = []
        self.runnable = deque(range(pp))
        self.jobs: dict[int, list] = {}  # shared cores: rank -> [action index, begin, start of work, work left]
        self.now = 0.0

    def run(self) -> None:
        runnable, jobs = self.runnable, self.jobs
        while runnable or jobs:
            if runnable:
                self._run_rank(runnable.popleft())
            else:  # shared cores: every rank waits for a compute action in progress
                self._finish_shared()

    def _resolve(self, key: int, t: float) -> None:
        self.known[key] = t
        woken = self.sleepers.pop(key, None)
        if woken:
            self.runnable.extend(woken)

    def _pump(self, link: int) -> None:
        # Transfers leave strictly in send order; one whose receive is not posted holds up the
        # rest of the link (head-of-line blocking, as NCCL's in-order matching does).
        q, h = self.queue[link], self.head[link]
        while h < len(q):
            key, x = q[h]
            recv = self.posted_recv[key]
            if recv is None:
                break
            start = max(self.posted_send[key], recv, self.link_free[link])
            self.link_free[link] = start + x
            self._resolve(key, start + self.latency + x)
            self.arrived.append(key)
            h += 1
        self.head[link] = h

    def _finish_shared(self) -> None:
        self.now, done = _advance(self.jobs, self.now, self.sharing)
        now = self.now
        for r in done:
            i, begin, work_start, _ = self.jobs.pop(r)
            self.busy[r] += now - work_start  # with shared cores, busy is the time spent computing
            self.begins[i], self.ends[i], self.waits[i] = begin, now, begin - self.free[r]
            self.order.append(i)
            self.free[r] = now
            self.ptr[r] = i + 1
            self._resolve(i, now)
            self.runnable.append(r)

    def _run_rank(self, r: int) -> None:
        """Rank r's actions from its pointer on, until one waits for a time not known yet (it then sleeps
        on that key) or, with shared cores, a compute action starts. The hot loop: locals, not attributes."""
        prog, known, sleepers, work = self.prog, self.known, self.sleepers, self.work
        needs, kinds, messages, links = prog.need, prog.kind, prog.message, prog.link
        begins, ends, waits, order = self.begins, self.ends, self.waits, self.order
        i, stop, t_free = self.ptr[r], prog.lo[r + 1], self.free[r]
        while i < stop:
            begin = t_free
            blocked = False
            for key in needs[i]:
                t = known[key]
                if t is None:
                    sleepers.setdefault(key, []).append(r)
                    blocked = True
                    break
                if t > begin:
                    begin = t
            if blocked:
                break
            kind = kinds[i]
            if kind == SEND:
                end = begin + self.send_ovh
                key = messages[i]
                self.posted_send[key] = end
                self.queue[links[i]].append((key, work[i]))
                self._pump(links[i])
            elif kind == RECV:
                end = begin + self.recv_ovh
                self.posted_recv[messages[i]] = end
                self._pump(links[i])
            elif self.sharing is not None:  # its end depends on who else computes meanwhile
                self.jobs[r] = [i, begin, begin + self.ovh + self.wait_of[i], work[i]]
                break
            else:
                self.busy[r] += work[i]
                end = begin + self.ovh + self.wait_of[i] + work[i]
                self._resolve(i, end)
            begins[i], ends[i], waits[i] = begin, end, begin - t_free
            order.append(i)
            t_free = end
            i += 1
        self.ptr[r], self.free[r] = i, t_free

    def result(self) -> SimResult:
        """The step, its events and bubble; ScheduleError for a rank that never finished (deadlock) or a
        message with only one side posted."""
        prog, known, ptr, acts = self.prog, self.known, self.ptr, self.prog.acts

        def describe(key: int) -> str:
            kind, a = prog.describe(key)
            src = prog.ranks[a.stage]
            return f"message {a} from rank {src}" if kind == "arrive" else f"{a} (rank {src})"

        stuck = [
            f"rank {r} at {acts[p]} waits for " + ", ".join(describe(k) for k in prog.need[p] if known[k] is None)
            for r, p in enumerate(ptr)
            if p < prog.lo[r + 1]
        ]
        if stuck:
            raise ScheduleError("deadlock: " + "; ".join(stuck))
        sent, received = self.posted_send, self.posted_recv
        unmatched = sorted(
            {str(prog.describe(k)[1]) for k in set(prog.message) - {-1} if (sent[k] is None) != (received[k] is None)}
        )
        if unmatched:
            raise ScheduleError("messages without a matching send/receive: " + ", ".join(unmatched))
        arrivals = {prog.describe(k)[1]: known[k] for k in self.arrived}
        # The step ends when every rank is done and its sends have drained (p2p.wait_sends).
        step = max(self.free + list(arrivals.values()), default=0.0)
        frac = 1.0 - sum(self.busy) / (prog.pp * step) if step > 0 else 0.0
        rank_of = prog.ranks
        events = [
            SimEvent(rank_of[acts[i].stage], acts[i], self.begins[i], self.ends[i], self.waits[i]) for i in self.order
        ]
        return SimResult(step, events, self.busy, frac, arrivals)


def _advance(jobs: dict[int, list], now: float, sharing: CoreSharing | None) -> tuple[float, list[int]]:
    """Processor sharing from `now` to the next event (a job starts or one ends): returns that time and
    the ranks whose job ended. A job is [action, begin, start of work, work left (s on a core of its own)]."""
    assert sharing is not None
    running = [r for r, j in jobs.items() if j[2] <= now]
    load = Counter(sharing.node_of[r] for r in running)
    rate = {r: min(1.0, sharing.capacity[sharing.node_of[r]] / load[sharing.node_of[r]]) for r in running}
    ends = {r: now + jobs[r][3] / rate[r] for r in running}
    t = min([j[2] for r, j in jobs.items() if r not in rate] + list(ends.values()))
    done = []
    for r in running:
        jobs[r][3] -= (t - now) * rate[r]
        if ends[r] <= t:  # also when rounding leaves a sliver of work: the end is now
            done.append(r)
    return t, done


def sim_trace(result: SimResult, process_name: str = "simulated", pid: int = 1) -> dict:
    """Chrome/Perfetto trace of a simulation: a track per rank, a slice per action, and each
    blocked interval as its own "wait" slice right before the action it delayed."""
    slices: list[Slice] = []
    for e in result.events:
        if e.wait_s > 0:
            slices.append(
                Slice(e.rank, "wait", e.start - e.wait_s, e.start, cat="wait", args={"before": str(e.action)})
            )
        cat = "comm" if e.action.op in SENDS + RECVS else "compute"
        slices.append(
            Slice(
                e.rank,
                str(e.action),
                e.start,
                e.end,
                cat=cat,
                args={"stage": e.action.stage, "microbatch": e.action.microbatch},
            )
        )
    return chrome_trace(slices, process_name=process_name, pid=pid)
