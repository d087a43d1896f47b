"""Pipeline schedules as plain data: per pipeline rank, an ordered list of actions.

The runtime executes these lists literally, so everything that can go wrong with a
schedule (a missing backward, mismatched point-to-point order, a dependency cycle)
is caught here, in pure Python, before any GPU time is spent.

Which schedules exist, their constraints and where their stages live come from the registry
(config/schedules.py); each schedule's builder returns the compute actions, this module lowers them to
sends and receives (`add_communication`) and validates the result. Stage placement is a tuple
`ranks` (`ranks[s]` = pipeline rank of stage s): Megatron's loop (s % pp) unless a schedule says
otherwise (ZB-V's V).

Zero-bubble schedules (Qi et al., 2024, "Zero Bubble Pipeline Parallelism", ICLR) split a backward
into ``B`` (gradient w.r.t. the stage input, what SEND_B carries) and ``W`` (gradient w.r.t. the
weights). In a schedule that contains any W, ``Op.BACKWARD`` means the B half only; W(s, m) runs on
the rank of stage s after B(s, m) and never communicates, so it can be moved into bubbles.
"""

from __future__ import annotations

import enum
import importlib
from collections import defaultdict
from dataclasses import dataclass
from typing import NoReturn, Sequence

from hybridpar.config.schedules import schedule_spec


class Op(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # full backward, or only its input-gradient half when the schedule has W
    WEIGHT = "W"  # weight-gradient half of a backward (zero-bubble schedules); no communication
    SEND_F = "SEND_F"  # output activation of (stage, mb) -> rank of stage + 1
    RECV_F = "RECV_F"  # post the receive of the input activation of F(stage, mb)
    SEND_B = "SEND_B"  # gradient of stage's input for mb -> rank of stage - 1
    RECV_B = "RECV_B"  # post the receive of the gradient of stage's output for mb


COMPUTE_OPS: frozenset[Op] = frozenset({Op.FORWARD, Op.BACKWARD, Op.WEIGHT})
SENDS, RECVS = (Op.SEND_F, Op.SEND_B), (Op.RECV_F, Op.RECV_B)


@dataclass(frozen=True)
class Action:
    stage: int
    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op.value}{self.stage}.{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS


class ScheduleError(ValueError):
    """A schedule that the runtime must not execute; the message ends with the grid."""


def placement(ranks: Sequence[int] | None, pp: int, n_stages: int) -> Sequence[int]:
    """`ranks` checked against (pp, n_stages); None = Megatron's loop placement, stage s on rank s % pp."""
    if ranks is None:
        return tuple(s % pp for s in range(n_stages))
    if len(ranks) != n_stages or not all(0 <= r < pp for r in ranks):
        raise ValueError(f"stage placement {list(ranks)} does not place {n_stages} stages on {pp} ranks")
    return ranks


def _check_counts(pp: int, virtual_stages: int, microbatches: int) -> None:
    for label, value in (("pp", pp), ("virtual_stages", virtual_stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")


def compute_schedule(name: str, pp: int, virtual_stages: int, microbatches: int) -> list[list[Action]]:
    """Per pipeline rank, the ordered compute actions (F and B; also W for zero-bubble)."""
    spec = schedule_spec(name)
    _check_counts(pp, virtual_stages, microbatches)
    spec.check(pp, virtual_stages, microbatches)
    module, function = spec.builder.split(":")  # named, not imported, by the registry (it sits below us)
    return getattr(importlib.import_module(module), function)(pp, virtual_stages, microbatches)


def _compute_of(a: Action) -> Action:
    """The compute action that produces (SEND_*) or consumes (RECV_*) a comm action."""
    op = Op.FORWARD if a.op in (Op.FORWARD, Op.SEND_F, Op.RECV_F) else Op.BACKWARD
    return Action(a.stage, op, a.microbatch)


def message_of(a: Action, ranks: Sequence[int]) -> tuple[tuple[int, int], Action]:
    """(link (src rank, dst rank), sending action) identifying the message a comm action is part of."""
    send = {
        Op.RECV_F: Action(a.stage - 1, Op.SEND_F, a.microbatch),
        Op.RECV_B: Action(a.stage + 1, Op.SEND_B, a.microbatch),
    }.get(a.op, a)
    dst = send.stage + 1 if send.op is Op.SEND_F else send.stage - 1
    return (ranks[send.stage], ranks[dst]), send


def _send_after(a: Action, ranks: Sequence[int]) -> Action | None:
    """The send that follows compute `a`: only where the neighbour stage is on another rank."""
    if a.op not in (Op.FORWARD, Op.BACKWARD):
        return None  # W only accumulates into local weight gradients
    op, t = (Op.SEND_F, a.stage + 1) if a.op is Op.FORWARD else (Op.SEND_B, a.stage - 1)
    if 0 <= t < len(ranks) and ranks[t] != ranks[a.stage]:
        return Action(a.stage, op, a.microbatch)
    return None


def _recv_of(send: Action) -> Action:
    forward = send.op is Op.SEND_F
    return Action(send.stage + (1 if forward else -1), Op.RECV_F if forward else Op.RECV_B, send.microbatch)


def inputs(a: Action, ranks: Sequence[int]) -> list[tuple[str, Action]]:
    """The dependency rule of actions, the one the validator and the simulator share: what `a` waits
    for, as ("done", x) — action x, on a's own rank — or ("arrive", send) — the message that SEND_*
    action `send` carries from another rank (which also needs its receive posted)."""
    s, m = a.stage, a.microbatch
    if a.op in SENDS:  # the producer, on the sender's rank
        return [("done", _compute_of(a))]
    if a.op is Op.WEIGHT:
        return [("done", Action(s, Op.BACKWARD, m))]  # same stage, hence same rank: no message
    need: list[tuple[str, Action]] = []
    if a.op is Op.FORWARD and s > 0:
        remote = ranks[s - 1] != ranks[s]
        need.append(("arrive", Action(s - 1, Op.SEND_F, m)) if remote else ("done", Action(s - 1, Op.FORWARD, m)))
    elif a.op is Op.BACKWARD:
        need.append(("done", Action(s, Op.FORWARD, m)))
        if s + 1 < len(ranks):
            remote = ranks[s + 1] != ranks[s]
            need.append(("arrive", Action(s + 1, Op.SEND_B, m)) if remote else ("done", Action(s + 1, Op.BACKWARD, m)))
    return need  # a receive only posts a buffer: it waits for nothing


def add_communication(
    compute: list[list[Action]], pp: int, n_stages: int, recv_lookahead: int = 1, *, ranks: Sequence[int] | None = None
) -> list[list[Action]]:
    """Lower per-rank compute lists to full lists with SEND_*/RECV_* inserted."""
    if len(compute) != pp:
        raise ValueError(f"expected {pp} rank lists, got {len(compute)}")
    if recv_lookahead < 0:
        raise ValueError(f"recv_lookahead must be >= 0, got {recv_lookahead}")
    ranks = placement(ranks, pp, n_stages)
    sends = [[_send_after(a, ranks) for a in acts] for acts in compute]
    # NCCL matches p2p messages per (src, dst) pair in posting order, so the receiver's
    # order on a link is dictated by the sender's list order.
    link_recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for send in (x for row in sends for x in row if x is not None):
        # message_of's link of a send, without building its pair of candidate senders per message
        dst = send.stage + 1 if send.op is Op.SEND_F else send.stage - 1
        link_recvs[ranks[send.stage], ranks[dst]].append(_recv_of(send))

    out: list[list[Action]] = []
    for dst, acts in enumerate(compute):
        pos = {a: i for i, a in enumerate(acts)}
        # post_at[i]: receives to post right before compute i (i == len(acts): at the end,
        # only reachable for a malformed input whose consumer is missing).
        post_at: list[list[Action]] = [[] for _ in range(len(acts) + 1)]
        for link in sorted(link_recvs):
            if link[1] != dst:
                continue
            queue = link_recvs[link]
            # Receive j is due at step need_j - lookahead, but cannot overtake any later
            # receive on the link that is due sooner: a suffix minimum keeps link order.
            due = len(acts)
            slots: list[int] = []
            for recv in reversed(queue):
                due = min(due, max(0, pos.get(_compute_of(recv), len(acts)) - recv_lookahead))
                slots.append(due)
            for recv, slot in zip(queue, reversed(slots)):
                post_at[slot].append(recv)
        full: list[Action] = []
        for i, a in enumerate(acts):
            send = sends[dst][i]
            full += post_at[i]
            full.append(a)
            if send is not None:
                full.append(send)
        out.append(full + post_at[len(acts)])
    return out


def build_schedule(
    name: str, pp: int, virtual_stages: int, microbatches: int, recv_lookahead: int = 1
) -> list[list[Action]]:
    """The full, validated per-rank action lists the runtime executes."""
    compute = compute_schedule(name, pp, virtual_stages, microbatches)
    n_stages, ranks = pp * virtual_stages, schedule_spec(name).stage_ranks(pp, virtual_stages)
    full = add_communication(compute, pp, n_stages, recv_lookahead, ranks=ranks)
    validate_schedule(full, pp, n_stages, microbatches, ranks=ranks)
    return full


def _prerequisites(a: Action, ranks: Sequence[int]) -> list[Action]:
    """`inputs` as actions that must have executed: a message needs its producer, send and receive."""
    out: list[Action] = []
    for kind, x in inputs(a, ranks):
        out += [x] if kind == "done" else [_compute_of(x), x, _recv_of(x)]
    return out


def _simulate(actions: list[list[Action]], ranks: Sequence[int]) -> tuple[list[list[str]], list[str]]:
    """Unit-time lock-step run. Returns (grid rows, descriptions of stuck ranks)."""
    done: set[Action] = set()
    ptr = [0] * len(actions)
    rows: list[list[str]] = []

    def ready(a: Action) -> bool:  # an out-of-range stage (a malformed list) never runs
        return 0 <= a.stage < len(ranks) and all(n in done for n in _prerequisites(a, ranks))

    while True:
        # Comm actions take zero time and never block (non-blocking isend/irecv).
        for r, acts in enumerate(actions):
            while ptr[r] < len(acts) and not acts[ptr[r]].is_compute:
                done.add(acts[ptr[r]])
                ptr[r] += 1
        if all(p == len(acts) for p, acts in zip(ptr, actions)):
            return rows, []
        # Compute sees only what finished in earlier steps (snapshot of `done`).
        ran: list[Action] = []
        row: list[str] = []
        for r, acts in enumerate(actions):
            a = acts[ptr[r]] if ptr[r] < len(acts) else None
            if a is not None and ready(a):
                ran.append(a)
                row.append(str(a))
                ptr[r] += 1
            else:
                row.append(".")
        if not ran:
            return rows, [
                f"rank {r} at {acts[p]} waits for "
                + (
                    ", ".join(f"{n} (rank {ranks[n.stage]})" for n in _prerequisites(acts[p], ranks) if n not in done)
                    if 0 <= acts[p].stage < len(ranks)
                    else "a stage that does not exist"
                )
                for r, (p, acts) in enumerate(zip(ptr, actions))
                if p < len(acts)
            ]
        done.update(ran)
        rows.append(row)


def format_grid(actions: list[list[Action]], pp: int, n_stages: int, *, ranks: Sequence[int] | None = None) -> str:
    """Step x rank table of the unit-time simulation ('.' = idle); stops where it deadlocks."""
    rows, stuck = _simulate(actions, placement(ranks, pp, n_stages))
    header = ["step"] + [f"r{r}" for r in range(len(actions))]
    width = max([len(c) for row in rows for c in row] + [len(h) for h in header[1:]], default=1)
    lines = ["  ".join([header[0]] + [h.ljust(width) for h in header[1:]]).rstrip()]
    for t, row in enumerate(rows):
        lines.append("  ".join([str(t).rjust(4)] + [c.ljust(width) for c in row]).rstrip())
    if stuck:
        lines.append(f"(stuck after {len(rows)} steps)")
    return "\n".join(lines)


def validate_schedule(
    actions: list[list[Action]], pp: int, n_stages: int, microbatches: int, *, ranks: Sequence[int] | None = None
) -> None:
    """Raise ScheduleError naming the first problem (rank, action); message ends with the grid."""
    ranks = placement(ranks, pp, n_stages)

    def fail(msg: str) -> NoReturn:
        raise ScheduleError(f"{msg}\n{format_grid(actions, pp, n_stages, ranks=ranks)}")

    if len(actions) != pp:
        fail(f"expected {pp} rank lists, got {len(actions)}")
    where: dict[Action, tuple[int, int]] = {}
    for r, acts in enumerate(actions):
        for i, a in enumerate(acts):
            if not (0 <= a.stage < n_stages and 0 <= a.microbatch < microbatches):
                fail(
                    f"rank {r}: {a} at position {i} is out of range "
                    f"(stages 0..{n_stages - 1}, microbatches 0..{microbatches - 1})"
                )
            if ranks[a.stage] != r:
                fail(
                    f"rank {r}: {a} at position {i} is on the wrong rank "
                    f"(stage {a.stage} lives on rank {ranks[a.stage]})"
                )
            if a in where:
                fail(f"rank {r}: {a} appears twice (positions {where[a][1]} and {i})")
            where[a] = (r, i)
    # Splitting the backward is all-or-nothing: once any W appears, every B needs its W.
    split = any(a.op is Op.WEIGHT for a in where)
    ops = COMPUTE_OPS if split else (Op.FORWARD, Op.BACKWARD)
    required = {Action(s, op, m) for s in range(n_stages) for m in range(microbatches) for op in ops}
    needed = [_send_after(a, ranks) for a in required]
    required |= {x for send in needed if send is not None for x in (send, _recv_of(send))}
    for a in sorted(required - where.keys(), key=lambda a: (a.microbatch, a.stage, a.op.value)):
        why = " (the schedule splits backwards into B and W)" if a.op is Op.WEIGHT else ""
        fail(f"rank {ranks[a.stage]}: missing {a}{why}")
    for a, (r, i) in where.items():
        if a not in required:
            fail(
                f"rank {r}: unexpected {a}: no communication is needed there "
                "(neighbouring stage absent or on the same rank)"
            )
        if a.op is Op.WEIGHT:
            j = where[Action(a.stage, Op.BACKWARD, a.microbatch)][1]
            if i < j:
                fail(
                    f"rank {r}: {a} at position {i} comes before its "
                    f"B{a.stage}.{a.microbatch} at {j} (W needs the output gradient B gets)"
                )
        elif not a.is_compute:
            c = _compute_of(a)
            j = where[c][1]
            if a.op in SENDS and i < j:
                fail(f"rank {r}: {a} at position {i} comes before its producer {c} at {j}")
            if a.op in RECVS and i > j:
                fail(f"rank {r}: {a} at position {i} is posted after its consumer {c} at {j}")
    # Per link, the k-th posted receive must belong to the k-th posted send.
    sent: dict[tuple[int, int], list[Action]] = defaultdict(list)
    received: dict[tuple[int, int], list[tuple[Action, Action]]] = defaultdict(list)
    for a in (a for acts in actions for a in acts if not a.is_compute):
        link, send = message_of(a, ranks)
        if a.op in SENDS:
            sent[link].append(send)
        else:
            received[link].append((send, a))
    for link in sorted(sent):
        for k, (send, (expect, recv)) in enumerate(zip(sent[link], received[link])):
            if send != expect:
                fail(
                    f"link rank {link[0]} -> rank {link[1]}: message #{k} is sent as {send} "
                    f"but rank {link[1]} posts {recv} as its receive #{k} "
                    "(NCCL matches in posting order; receives must follow send order)"
                )
    stuck = _simulate(actions, ranks)[1]
    if stuck:
        fail("deadlock: " + "; ".join(stuck))


def bubble_fraction_theory(
    name: str, pp: int, virtual_stages: int, microbatches: int, *, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0
) -> float:
    """Idle fraction of the total step time per rank, assuming uniform stage costs: the schedule's
    registered formula (config/schedules.py). t_b is the input-gradient half B and t_w the weight half W
    where the schedule splits the backward; elsewhere a full backward is t_b + t_w."""
    _check_counts(pp, virtual_stages, microbatches)
    return schedule_spec(name).bubble_fraction(pp, virtual_stages, microbatches, t_f=t_f, t_b=t_b, t_w=t_w)


def max_in_flight(actions: list[list[Action]]) -> int:
    """Most microbatch activations any rank holds at once: a forward's saved tensors live until its
    backward (B) frees the graph. The microbatch planner's memory model multiplies bytes per sample
    by the samples of this many (largest) microbatches."""
    peak = 0
    for rank in actions:
        alive = 0
        for a in rank:
            alive += (a.op == Op.FORWARD) - (a.op == Op.BACKWARD)
            peak = max(peak, alive)
    return peak
