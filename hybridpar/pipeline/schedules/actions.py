"""What a schedule is made of: actions (stage, op, microbatch), the stage placement they run on, and the
one dependency rule that the validator, the simulator and the runtime's receive posting all share.

Zero-bubble schedules (Qi et al., 2024, "Zero Bubble Pipeline Parallelism", ICLR) split a backward
into ``B`` (gradient w.r.t. the stage input, what SEND_B carries) and ``W`` (gradient w.r.t. the
weights). In a schedule that contains any W, ``Op.BACKWARD`` means the B half only; W(s, m) runs on
the rank of stage s after B(s, m) and never communicates, so it can be moved into bubbles.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence


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


def compute_of(a: Action) -> Action:
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


def send_after(a: Action, ranks: Sequence[int]) -> Action | None:
    """The send that follows compute `a`: only where the neighbour stage is on another rank."""
    if a.op not in (Op.FORWARD, Op.BACKWARD):
        return None  # W only accumulates into local weight gradients
    op, t = (Op.SEND_F, a.stage + 1) if a.op is Op.FORWARD else (Op.SEND_B, a.stage - 1)
    if 0 <= t < len(ranks) and ranks[t] != ranks[a.stage]:
        return Action(a.stage, op, a.microbatch)
    return None


def recv_of(send: Action) -> Action:
    forward = send.op is Op.SEND_F
    return Action(send.stage + (1 if forward else -1), Op.RECV_F if forward else Op.RECV_B, send.microbatch)


def inputs(a: Action, ranks: Sequence[int]) -> list[tuple[str, Action]]:
    """The dependency rule of actions, the one the validator and the simulator share: what `a` waits
    for, as ("done", x) — action x, on a's own rank — or ("arrive", send) — the message that SEND_*
    action `send` carries from another rank (which also needs its receive posted)."""
    s, m = a.stage, a.microbatch
    if a.op in SENDS:  # the producer, on the sender's rank
        return [("done", compute_of(a))]
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
