"""ZB-H1 (Qi et al., 2024, "Zero Bubble Pipeline Parallelism", ICLR, Sec. 2.1): 1F1B with the backward
split into B (input gradient) and W (weight gradient), the Ws deferred into the bubble."""

from __future__ import annotations

from hybridpar.pipeline.schedules.actions import Action, Op
from hybridpar.pipeline.schedules.one_f_one_b import build_1f1b
from hybridpar.pipeline.schedules.spec import ScheduleSpec


def defer_weights(order: list[Action], delay: int) -> list[Action]:
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


def build_zb_h1(pp: int, virtual_stages: int, m: int) -> list[list[Action]]:
    # ZB-H1 (Fig. 3 top): keep 1F1B's F/B order and delay rank r's Ws by r microbatches, the warm-up it
    # has less than rank 0. Its Bs then run as soon as the gradient arrives, the owed Ws fill the drain,
    # and every rank holds at most (pp - r) + r = pp microbatches whose W is pending: rank 0's 1F1B peak.
    # With unit F = B = W this meets the paper's (p-1)(F+B-W) bubble exactly; a greedy "B, else F, else
    # W" list scheduler either defers every W to the end (memory grows with m) or, with a pp cap on
    # pending Ws, loses 1-4 units at pp <= 8.
    # torch's ScheduleInterleavedZeroBubble with one stage per rank runs the same order: `_get_warmup_ops`
    # gives rank r the 1F1B warm-up pp - 1 - r, and `_get_1f1b_rank_ops(enable_zero_bubble=True,
    # num_1f1b_microbatches=r)` puts W(j) right after B(j + r) (torch 2.13 schedules.py). One difference
    # remains, in torch: stage 0 (whose input needs no gradient) runs nothing at B and its full backward
    # at W.
    return [defer_weights(order, r) for r, order in enumerate(build_1f1b(pp, 1, m))]


def zb_h1_bubble(pp: int, v: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """The paper gives the bubble (p-1)(t_f + t_b - t_w), a third of 1F1B's (p-1)(t_f + t_b + t_w) when
    the three are equal. That needs t_w <= min(t_f, t_b): rank 0 owes no W while it waits (p-1) t_b for
    its first gradient, and the last rank none while it waits (p-1) t_f for its first activation, so the
    bubble is never below either. We use (p-1) max(t_f + t_b - t_w, t_f, t_b), which
    tests/test_simulate.py checks against the event simulation for random costs. Fraction:
    bubble / (m (t_f + t_b + t_w) + bubble); with unit costs (p-1) / (3 m + p-1)."""
    bubble = (pp - 1) * max(t_f + t_b - t_w, t_f, t_b)
    return bubble / (m * (t_f + t_b + t_w) + bubble)


# The peer: torch's ScheduleInterleavedZeroBubble ("ZB1P") with one stage per rank is our ZB-H1 action
# for action (see build_zb_h1).
SPEC = ScheduleSpec(
    "zb-h1",
    "1F1B with the backward split into B and W, Ws deferred into the bubble (Qi et al., 2024)",
    build_zb_h1,
    zb_h1_bubble,
    splits_backward=True,
    live_repartition=True,
    torch_peer="ScheduleInterleavedZeroBubble",
    fallback="1f1b",
)
