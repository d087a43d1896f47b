"""The validator of action lists: every action present once and on its stage's rank, sends after their
producer and receives before their consumer, receives on each link in send order (NCCL matches in posting
order), no deadlock. A failure names the first problem (rank, action) and ends with the step x rank grid
of a unit-time run, which `format_grid` also prints for a schedule that is fine.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NoReturn, Sequence

from hybridpar.pipeline.schedules.actions import (
    COMPUTE_OPS,
    RECVS,
    SENDS,
    Action,
    Op,
    ScheduleError,
    compute_of,
    inputs,
    message_of,
    placement,
    recv_of,
    send_after,
)


def _prerequisites(a: Action, ranks: Sequence[int]) -> list[Action]:
    """`inputs` as actions that must have executed: a message needs its producer, send and receive."""
    out: list[Action] = []
    for kind, x in inputs(a, ranks):
        out += [x] if kind == "done" else [compute_of(x), x, recv_of(x)]
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
    needed = [send_after(a, ranks) for a in required]
    required |= {x for send in needed if send is not None for x in (send, recv_of(send))}
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
            c = compute_of(a)
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
