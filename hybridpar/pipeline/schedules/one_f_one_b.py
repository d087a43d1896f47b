"""1F1B, one forward one backward (PipeDream-flush, Narayanan et al., 2021, "Memory-efficient
pipeline-parallel DNN training"); also the warm-up/steady/drain order and the flush bubble that GPipe,
interleaved 1F1B and ZB-H1 build on.
"""

from __future__ import annotations

from hybridpar.pipeline.schedules.actions import Action, Op
from hybridpar.pipeline.schedules.spec import ScheduleSpec

F, B = Op.FORWARD, Op.BACKWARD


def one_f_one_b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    """Warm up with `warmup` forwards, then alternate one F / one B, then drain the Bs."""
    order = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[len(fwd) - warmup :]


def single_stage(m: int, warmup: int, r: int) -> list[Action]:
    """Rank r's order with one stage per rank (stage r): m forwards and backwards, `warmup` forwards first."""
    return one_f_one_b([Action(r, F, i) for i in range(m)], [Action(r, B, i) for i in range(m)], warmup)


def flush_bubble(pp: int, v: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """GPipe and 1F1B: bubble (p-1)(t_f+t_b) over a step of (m+p-1)(t_f+t_b), i.e. (p-1)/(m+p-1).
    Interleaved (Narayanan et al., 2021): the bubble shrinks to (p-1)/v microbatch-times, so
    (p-1)/(v m + p-1) of the step. Independent of the costs."""
    return (pp - 1) / (v * m + pp - 1)


def build_1f1b(pp: int, virtual_stages: int, m: int) -> list[list[Action]]:
    # PipeDream-flush warms up with pp - r - 1, so rank r holds at most pp - r microbatches in flight.
    return [single_stage(m, min(pp - r - 1, m), r) for r in range(pp)]


SPEC = ScheduleSpec(
    "1f1b",
    "one forward, one backward (PipeDream-flush, Narayanan et al., 2021)",
    build_1f1b,
    flush_bubble,
    live_repartition=True,
    torch_peer="Schedule1F1B",
    fallback="gpipe",
)
