"""Pipeline schedules as plain data: per pipeline rank, an ordered list of actions.

The runtime executes these lists literally, so everything that can go wrong with a
schedule (a missing backward, mismatched point-to-point order, a dependency cycle)
is caught here, in pure Python, before any GPU time is spent.

Stage placement follows Megatron-LM interleaving (Narayanan et al., 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters"): with ``n_stages = pp * v``,
stage ``s`` lives on rank ``s % pp``, so rank ``r`` holds model chunks
``r, r + pp, r + 2 pp, ...``.

Zero-bubble schedules (Qi et al., 2024, "Zero Bubble Pipeline Parallelism", ICLR) split a backward
into ``B`` (gradient w.r.t. the stage input, what SEND_B carries) and ``W`` (gradient w.r.t. the
weights). In a schedule that contains any W, ``Op.BACKWARD`` means the B half only; W(s, m) runs on
the rank of stage s after B(s, m) and never communicates, so it can be moved into bubbles.
"""
from __future__ import annotations

import difflib
import enum
from collections import defaultdict
from dataclasses import dataclass
from typing import NoReturn

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


class Op(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # full backward, or only its input-gradient half when the schedule has W
    WEIGHT = "W"  # weight-gradient half of a backward (zero-bubble schedules); no communication
    SEND_F = "SEND_F"  # output activation of (stage, mb) -> rank(stage + 1)
    RECV_F = "RECV_F"  # post the receive of the input activation of F(stage, mb)
    SEND_B = "SEND_B"  # gradient of stage's input for mb -> rank(stage - 1)
    RECV_B = "RECV_B"  # post the receive of the gradient of stage's output for mb


COMPUTE_OPS: frozenset[Op] = frozenset({Op.FORWARD, Op.BACKWARD, Op.WEIGHT})


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


def stage_rank(stage: int, pp: int) -> int:
    return stage % pp


def _check_args(name: str, pp: int, virtual_stages: int, microbatches: int) -> None:
    if name not in SCHEDULES:
        close = difflib.get_close_matches(str(name).lower(), SCHEDULES, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown schedule {name!r}{hint} (known: {', '.join(SCHEDULES)})")
    for label, value in (("pp", pp), ("virtual_stages", virtual_stages),
                         ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if virtual_stages != 1 and name != "interleaved-1f1b":
        raise ValueError(f"schedule {name!r} runs one stage per rank; "
                         f"virtual_stages={virtual_stages} needs 'interleaved-1f1b'")
    if name == "interleaved-1f1b" and microbatches % pp:
        # Megatron's interleaved schedule walks microbatches in groups of pp per chunk.
        raise ValueError(f"interleaved-1f1b needs microbatches divisible by pp: "
                         f"{microbatches} % {pp} = {microbatches % pp}")
    if name == "zb-h1" and microbatches < pp:
        # ZB-H1's W deferral fills the drain of a full pipeline; with m < pp there is none.
        raise ValueError(f"zb-h1 needs microbatches >= pp, got {microbatches} < {pp}")


def _one_f_one_b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    """Warm up with `warmup` forwards, then alternate one F / one B, then drain the Bs."""
    order = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[len(fwd) - warmup:]


def _defer_weights(order: list[Action], delay: int) -> list[Action]:
    """Put W(s, j) right after B(s, j + delay), and the Ws still owed after the last B."""
    out: list[Action] = []
    owed: list[Action] = []
    for a in order:
        out.append(a)
        if a.op is Op.BACKWARD:
            owed.append(Action(a.stage, Op.WEIGHT, a.microbatch))
            if len(owed) > delay:
                out.append(owed.pop(0))
    return out + owed


def compute_schedule(name: str, pp: int, virtual_stages: int,
                     microbatches: int) -> list[list[Action]]:
    """Per pipeline rank, the ordered compute actions (F and B; also W for zero-bubble)."""
    _check_args(name, pp, virtual_stages, microbatches)
    v, m = virtual_stages, microbatches
    F, B = Op.FORWARD, Op.BACKWARD
    out: list[list[Action]] = []
    for r in range(pp):
        if name != "interleaved-1f1b":
            fwd = [Action(r, F, i) for i in range(m)]
            bwd = [Action(r, B, i) for i in range(m)]
            # GPipe (Huang et al., 2019) is 1F1B with a full warm-up: all forwards, then all
            # backwards, stashing m activations. PipeDream-flush (Narayanan et al., 2021,
            # "Memory-efficient pipeline-parallel DNN training") warms up with pp - r - 1, so
            # rank r holds at most pp - r microbatches in flight.
            order = _one_f_one_b(fwd, bwd, m if name == "gpipe" else min(pp - r - 1, m))
            if name == "zb-h1":
                # ZB-H1 (Qi et al., 2024, Sec. 2.1, Fig. 3 top): keep 1F1B's F/B order and delay
                # rank r's Ws by r microbatches, the warm-up it has less than rank 0. Its Bs then
                # run as soon as the gradient arrives, the owed Ws fill the drain, and every rank
                # holds at most (pp - r) + r = pp microbatches whose W is pending: rank 0's 1F1B
                # peak. With unit F = B = W this meets the paper's (p-1)(F+B-W) bubble exactly;
                # a greedy "B, else F, else W" list scheduler either defers every W to the end
                # (memory grows with m) or, with a pp cap on pending Ws, loses 1-4 units
                # at pp <= 8.
                order = _defer_weights(order, r)
            out.append(order)
            continue
        # Megatron-LM interleaved 1F1B: local step k touches chunk (k // pp) % v for a group of
        # pp microbatches; backwards visit the chunks in reverse. The extra (v - 1) * pp warm-up
        # forwards fill the deeper virtual pipeline before the first backward can arrive.
        total = m * v
        mbs = [(k // (pp * v)) * pp + k % pp for k in range(total)]
        fwd = [Action(((k // pp) % v) * pp + r, F, mbs[k]) for k in range(total)]
        bwd = [Action((v - 1 - (k // pp) % v) * pp + r, B, mbs[k]) for k in range(total)]
        out.append(_one_f_one_b(fwd, bwd, min((pp - r - 1) * 2 + (v - 1) * pp, total)))
    return out


def _compute_of(a: Action) -> Action:
    """The compute action that produces (SEND_*) or consumes (RECV_*) a comm action."""
    op = Op.FORWARD if a.op in (Op.FORWARD, Op.SEND_F, Op.RECV_F) else Op.BACKWARD
    return Action(a.stage, op, a.microbatch)


def _message(a: Action, pp: int) -> tuple[tuple[int, int], Action]:
    """(link, sending action) identifying the point-to-point message a comm action is part of."""
    send = {Op.RECV_F: Action(a.stage - 1, Op.SEND_F, a.microbatch),
            Op.RECV_B: Action(a.stage + 1, Op.SEND_B, a.microbatch)}.get(a.op, a)
    dst = send.stage + 1 if send.op is Op.SEND_F else send.stage - 1
    return (stage_rank(send.stage, pp), stage_rank(dst, pp)), send


def _send_after(a: Action, pp: int, n_stages: int) -> Action | None:
    """The send that follows compute `a`: only where the neighbour stage is on another rank."""
    if a.op not in (Op.FORWARD, Op.BACKWARD):
        return None  # W only accumulates into local weight gradients
    op, t = (Op.SEND_F, a.stage + 1) if a.op is Op.FORWARD else (Op.SEND_B, a.stage - 1)
    if 0 <= t < n_stages and stage_rank(t, pp) != stage_rank(a.stage, pp):
        return Action(a.stage, op, a.microbatch)
    return None


def _recv_of(send: Action) -> Action:
    forward = send.op is Op.SEND_F
    return Action(send.stage + (1 if forward else -1), Op.RECV_F if forward else Op.RECV_B,
                  send.microbatch)


def add_communication(compute: list[list[Action]], pp: int, n_stages: int,
                      recv_lookahead: int = 1) -> list[list[Action]]:
    """Lower per-rank compute lists to full lists with SEND_*/RECV_* inserted."""
    if len(compute) != pp:
        raise ValueError(f"expected {pp} rank lists, got {len(compute)}")
    if recv_lookahead < 0:
        raise ValueError(f"recv_lookahead must be >= 0, got {recv_lookahead}")
    sends = [[_send_after(a, pp, n_stages) for a in acts] for acts in compute]
    # NCCL matches p2p messages per (src, dst) pair in posting order, so the receiver's
    # order on a link is dictated by the sender's list order.
    link_recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for send in (x for row in sends for x in row if x is not None):
        link_recvs[_message(send, pp)[0]].append(_recv_of(send))

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
            full += post_at[i] + [a] + ([send] if send is not None else [])
        out.append(full + post_at[len(acts)])
    return out


def build_schedule(name: str, pp: int, virtual_stages: int, microbatches: int,
                   recv_lookahead: int = 1) -> list[list[Action]]:
    """The full, validated per-rank action lists the runtime executes."""
    n_stages = pp * virtual_stages
    full = add_communication(compute_schedule(name, pp, virtual_stages, microbatches),
                             pp, n_stages, recv_lookahead)
    validate_schedule(full, pp, n_stages, microbatches)
    return full


def _prerequisites(a: Action, pp: int, n_stages: int) -> list[Action]:
    """Actions that must have executed before compute action `a` can run."""
    s, m = a.stage, a.microbatch
    need: list[Action] = []
    if a.op is Op.FORWARD and s > 0:
        need.append(Action(s - 1, Op.FORWARD, m))
        if stage_rank(s - 1, pp) != stage_rank(s, pp):
            need += [Action(s - 1, Op.SEND_F, m), Action(s, Op.RECV_F, m)]
    elif a.op is Op.WEIGHT:
        need.append(Action(s, Op.BACKWARD, m))  # same stage, hence same rank: no message
    elif a.op is Op.BACKWARD:
        need.append(Action(s, Op.FORWARD, m))
        if s + 1 < n_stages:
            need.append(Action(s + 1, Op.BACKWARD, m))
            if stage_rank(s + 1, pp) != stage_rank(s, pp):
                need += [Action(s + 1, Op.SEND_B, m), Action(s, Op.RECV_B, m)]
    return need


def _simulate(actions: list[list[Action]], pp: int,
              n_stages: int) -> tuple[list[list[str]], list[str]]:
    """Unit-time lock-step run. Returns (grid rows, descriptions of stuck ranks)."""
    done: set[Action] = set()
    ptr = [0] * len(actions)
    rows: list[list[str]] = []
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
            if a is not None and all(n in done for n in _prerequisites(a, pp, n_stages)):
                ran.append(a)
                row.append(str(a))
                ptr[r] += 1
            else:
                row.append(".")
        if not ran:
            return rows, [f"rank {r} at {acts[p]} waits for " + ", ".join(
                f"{n} (rank {stage_rank(n.stage, pp)})"
                for n in _prerequisites(acts[p], pp, n_stages) if n not in done)
                for r, (p, acts) in enumerate(zip(ptr, actions)) if p < len(acts)]
        done.update(ran)
        rows.append(row)


def format_grid(actions: list[list[Action]], pp: int, n_stages: int) -> str:
    """Step x rank table of the unit-time simulation ('.' = idle); stops where it deadlocks."""
    rows, stuck = _simulate(actions, pp, n_stages)
    header = ["step"] + [f"r{r}" for r in range(len(actions))]
    width = max([len(c) for row in rows for c in row] + [len(h) for h in header[1:]], default=1)
    lines = ["  ".join([header[0]] + [h.ljust(width) for h in header[1:]]).rstrip()]
    for t, row in enumerate(rows):
        lines.append("  ".join([str(t).rjust(4)] + [c.ljust(width) for c in row]).rstrip())
    if stuck:
        lines.append(f"(stuck after {len(rows)} steps)")
    return "\n".join(lines)


def validate_schedule(actions: list[list[Action]], pp: int, n_stages: int,
                      microbatches: int) -> None:
    """Raise ScheduleError naming the first problem (rank, action); message ends with the grid."""
    def fail(msg: str) -> NoReturn:
        raise ScheduleError(f"{msg}\n{format_grid(actions, pp, n_stages)}")

    if len(actions) != pp:
        fail(f"expected {pp} rank lists, got {len(actions)}")
    where: dict[Action, tuple[int, int]] = {}
    for r, acts in enumerate(actions):
        for i, a in enumerate(acts):
            if not (0 <= a.stage < n_stages and 0 <= a.microbatch < microbatches):
                fail(f"rank {r}: {a} at position {i} is out of range "
                     f"(stages 0..{n_stages - 1}, microbatches 0..{microbatches - 1})")
            if stage_rank(a.stage, pp) != r:
                fail(f"rank {r}: {a} at position {i} is on the wrong rank "
                     f"(stage {a.stage} lives on rank {stage_rank(a.stage, pp)})")
            if a in where:
                fail(f"rank {r}: {a} appears twice (positions {where[a][1]} and {i})")
            where[a] = (r, i)
    # Splitting the backward is all-or-nothing: once any W appears, every B needs its W.
    split = any(a.op is Op.WEIGHT for a in where)
    ops = COMPUTE_OPS if split else (Op.FORWARD, Op.BACKWARD)
    required = {Action(s, op, m) for s in range(n_stages) for m in range(microbatches) for op in ops}
    needed = [_send_after(a, pp, n_stages) for a in required]
    required |= {x for send in needed if send is not None for x in (send, _recv_of(send))}
    for a in sorted(required - where.keys(), key=lambda a: (a.microbatch, a.stage, a.op.value)):
        why = " (the schedule splits backwards into B and W)" if a.op is Op.WEIGHT else ""
        fail(f"rank {stage_rank(a.stage, pp)}: missing {a}{why}")
    for a, (r, i) in where.items():
        if a not in required:
            fail(f"rank {r}: unexpected {a}: no communication is needed there "
                 "(neighbouring stage absent or on the same rank)")
        if a.op is Op.WEIGHT:
            j = where[Action(a.stage, Op.BACKWARD, a.microbatch)][1]
            if i < j:
                fail(f"rank {r}: {a} at position {i} comes before its "
                     f"B{a.stage}.{a.microbatch} at {j} (W needs the output gradient B gets)")
        elif not a.is_compute:
            c = _compute_of(a)
            j = where[c][1]
            if a.op in (Op.SEND_F, Op.SEND_B) and i < j:
                fail(f"rank {r}: {a} at position {i} comes before its producer {c} at {j}")
            if a.op in (Op.RECV_F, Op.RECV_B) and i > j:
                fail(f"rank {r}: {a} at position {i} is posted after its consumer {c} at {j}")
    # Per link, the k-th posted receive must belong to the k-th posted send.
    sent: dict[tuple[int, int], list[Action]] = defaultdict(list)
    received: dict[tuple[int, int], list[tuple[Action, Action]]] = defaultdict(list)
    for a in (a for acts in actions for a in acts if not a.is_compute):
        link, send = _message(a, pp)
        if a.op in (Op.SEND_F, Op.SEND_B):
            sent[link].append(send)
        else:
            received[link].append((send, a))
    for link in sorted(sent):
        for k, (send, (expect, recv)) in enumerate(zip(sent[link], received[link])):
            if send != expect:
                fail(f"link rank {link[0]} -> rank {link[1]}: message #{k} is sent as {send} "
                     f"but rank {link[1]} posts {recv} as its receive #{k} "
                     "(NCCL matches in posting order; receives must follow send order)")
    stuck = _simulate(actions, pp, n_stages)[1]
    if stuck:
        fail("deadlock: " + "; ".join(stuck))


def bubble_fraction_theory(name: str, pp: int, virtual_stages: int, microbatches: int, *,
                           t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> float:
    """Idle fraction of the total step time per rank, assuming uniform stage times.

    GPipe and 1F1B: bubble (p-1)(t_f+t_b) over total (m+p-1)(t_f+t_b) -> (p-1)/(m+p-1).
    Interleaved: Megatron's bubble is (p-1)/v of a microbatch-time, i.e. ratio (p-1)/(v m)
    relative to ideal; as a fraction of the total step this is (p-1)/(v m + p-1).
    These ratios do not depend on the costs; t_f, t_b, t_w (B = input-grad half, W = weight
    half; a full backward is t_b + t_w) only matter for zb-h1.

    ZB-H1: Qi et al. (2024, Sec. 2.1) give the bubble (p-1)(t_f + t_b - t_w), a third of 1F1B's
    (p-1)(t_f + t_b + t_w) when the three are equal. That needs t_w <= min(t_f, t_b): rank 0
    owes no W while it waits (p-1) t_b for its first gradient, and the last rank none while it
    waits (p-1) t_f for its first activation, so the bubble is never below either. We use
    (p-1) max(t_f + t_b - t_w, t_f, t_b), which tests/test_simulate.py checks against the event
    simulation of this module's schedule for random costs. Fraction: bubble / (m (t_f + t_b + t_w) + bubble); with unit
    costs (p-1) / (3 m + p-1).
    """
    _check_args(name, pp, virtual_stages, microbatches)
    if name == "zb-h1":
        if min(t_f, t_b, t_w) < 0 or t_f + t_b + t_w <= 0:
            raise ValueError(f"costs must be >= 0 and not all zero: {t_f}, {t_b}, {t_w}")
        bubble = (pp - 1) * max(t_f + t_b - t_w, t_f, t_b)
        return bubble / (microbatches * (t_f + t_b + t_w) + bubble)
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


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
