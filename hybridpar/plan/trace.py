"""A rank's compute actions reduced to what its activation peak needs (plan/memory_model.py `activation_peaks`).

Which per-stage constants an action adds or frees depends on the order of the actions only, not on the
layout's bytes, so a search walks each schedule's lists once per microbatch sizes (`activation_trace`) and
prices every layout that shares them from the trace: a running sum over a few distinct steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.pipeline.schedules import Op

COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)


@dataclass(frozen=True)
class Trace:
    """`steps`: the distinct (op, stage, microbatch size, edge) of the lists' compute actions, where edge
    says a forward is its stage's first held microbatch or a backward frees its last; `ranks`: each rank's
    actions in order as indices into `steps`; `backwards`: each rank's positions of its backward actions;
    `split`: whether the schedule runs W apart from B."""

    steps: tuple[tuple[Op, int, int, bool], ...]
    ranks: tuple[tuple[int, ...], ...]
    backwards: tuple[tuple[int, ...], ...]
    split: bool


def activation_trace(sizes: list[int], actions: list[list]) -> Trace:
    """The trace of per-rank action lists (messages, which save nothing, left out), microbatch i of sizes[i]."""
    index: dict[tuple[Op, int, int, bool], int] = {}
    ranks, backwards = [], []
    for acts in actions:
        held: dict[int, int] = {}
        seq, bpos = [], []
        for a in acts:
            if a.op not in COMPUTE:
                continue
            s = a.stage
            if a.op == Op.FORWARD:
                edge = not held.get(s)
                held[s] = held.get(s, 0) + 1
            elif a.op == Op.BACKWARD:
                held[s] -= 1
                edge = not held[s]
                bpos.append(len(seq))
            else:
                edge = False
            seq.append(index.setdefault((a.op, s, sizes[a.microbatch], edge), len(index)))
        ranks.append(tuple(seq))
        backwards.append(tuple(bpos))
    split = any(a.op == Op.WEIGHT for acts in actions for a in acts)
    return Trace(tuple(index), tuple(ranks), tuple(backwards), split)
