"""Action lists lowered to integer indices for the simulator (pipeline/simulate.py).

The planner simulates one schedule's action lists under many cost vectors; resolving each action's
dependencies (`inputs`, `message_of`), hashing `Action`s and checking placement every time cost most of a
simulation in Python. `compile_program` does that work once per action list: every action gets a flat
index (rank by rank, in list order), every time the simulation can wait on gets an integer key, and the
structural errors (an action on the wrong rank, an action or message listed twice) are raised here,
before any time is computed. The simulation's rules are not here: simulate.py applies them to a Program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hybridpar.pipeline.schedules import RECVS, SENDS, Action, Op, ScheduleError, inputs, message_of, placement

COMPUTE, SEND, RECV = 0, 1, 2  # kinds of action
OP_INDEX = {Op.FORWARD: 0, Op.BACKWARD: 1, Op.WEIGHT: 2}


@dataclass(frozen=True)
class Program:
    """One schedule's action lists as arrays over flat action indices (rank r owns lo[r] .. lo[r+1]-1).

    Keys: the key of "done" for the action at flat index i is i; the other keys (a message's arrival,
    or an action that no list holds) follow from len(acts) on, described by `key_info`."""

    pp: int
    n_stages: int
    ranks: tuple[int, ...]
    acts: tuple[Action, ...]
    lo: tuple[int, ...]  # pp + 1 bounds
    kind: tuple[int, ...]  # COMPUTE, SEND or RECV
    op: tuple[int, ...]  # compute: OP_INDEX of its op; else -1
    need: tuple[tuple[int, ...], ...]  # keys each action waits for, in `inputs` order
    link: tuple[int, ...]  # send / receive: the directed link's index; else -1
    message: tuple[int, ...]  # send / receive: the arrival key of its message; else -1
    links: int
    key_info: tuple[tuple[str, Action], ...]  # key - len(acts) -> ("arrive", send) or ("done", action)

    @property
    def n_keys(self) -> int:
        return len(self.acts) + len(self.key_info)

    def describe(self, key: int) -> tuple[str, Action]:
        n = len(self.acts)
        return ("done", self.acts[key]) if key < n else self.key_info[key - n]


def compile_program(actions: list[list[Action]], pp: int, n_stages: int, ranks: Sequence[int] | None = None) -> Program:
    """Lower per-rank action lists (as from ``build_schedule``); ScheduleError for an action on a rank
    its stage is not placed on, or one listed twice."""
    if len(actions) != pp:
        raise ValueError(f"expected {pp} rank lists, got {len(actions)}")
    placed = tuple(placement(ranks, pp, n_stages))
    ops = tuple(Op)
    code = {op: c for c, op in enumerate(ops)}
    acts = [a for lst in actions for a in lst]
    index: dict[tuple[int, int, int], int] = {}  # (stage, op code, microbatch) -> flat index
    lo = [0]
    for r, lst in enumerate(actions):
        for a in lst:
            if not 0 <= a.stage < n_stages or placed[a.stage] != r:
                raise ScheduleError(f"rank {r}: {a} does not belong on this rank")
            t = (a.stage, code[a.op], a.microbatch)
            if t in index:
                raise ScheduleError(f"rank {r}: {a} {'posted' if a.op in SENDS + RECVS else 'runs'} twice")
            index[t] = len(index)
        lo.append(len(index))
    # What an action waits for and which message it is part of depend on its stage and op only (the
    # microbatch is the action's own): ask the shared rule (`inputs`, `message_of`) once per (stage, op).
    rules: dict[tuple[int, int], tuple] = {}  # (deps, link, sender, kind, op index)
    extra: dict[tuple[str, int, int, int], int] = {}
    links: dict[tuple[int, int], int] = {}

    def key(kind: str, stage: int, c: int, mb: int) -> int:
        if kind == "done" and (stage, c, mb) in index:
            return index[stage, c, mb]
        return extra.setdefault((kind, stage, c, mb), len(acts) + len(extra))

    kind, op, need, link, message = [], [], [], [], []
    for a, (s, c, mb) in zip(acts, index):
        rule = rules.get((s, c))
        if rule is None:  # with the action's kind and op index, so that each action only looks its rule up
            deps = tuple((k, x.stage, code[x.op]) for k, x in inputs(Action(s, a.op, 0), placed))
            if a.op in SENDS or a.op in RECVS:
                pair, send = message_of(Action(s, a.op, 0), placed)
                what = SEND if a.op in SENDS else RECV
                rule = (deps, links.setdefault(pair, len(links)), (send.stage, code[send.op]), what, -1)
            else:
                rule = (deps, -1, None, COMPUTE, OP_INDEX[a.op])
            rules[s, c] = rule
        deps, ln, send, what, o = rule
        need.append(tuple([key(k, ds, dc, mb) for k, ds, dc in deps]))
        link.append(ln)
        kind.append(what)
        op.append(o)
        message.append(-1 if send is None else key("arrive", send[0], send[1], mb))
    info = tuple((k, Action(s, ops[c], mb)) for k, s, c, mb in extra)
    return Program(
        pp,
        n_stages,
        placed,
        tuple(acts),
        tuple(lo),
        tuple(kind),
        tuple(op),
        tuple(need),
        tuple(link),
        tuple(message),
        len(links),
        info,
    )
