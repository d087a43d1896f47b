"""ZB-V: the V-shaped zero-bubble schedule (Qi et al., 2024, "Zero Bubble Pipeline Parallelism", ICLR,
Sec. 6; torch's `ScheduleZBVZeroBubble`).

Each rank holds two model chunks placed in a V (placement "v", spec.stage_ranks): rank r runs stage r
on the way down and stage 2 pp - 1 - r on the way back up, so the first and the last stage share rank 0
and the turn (stages pp - 1 and pp) is a local hand-off on the last rank. The backward is split into B
(input gradient, on the critical path) and W (weight gradient, free to move), as in ZB-H1; the runtime's
B/W machinery (pipeline/split_backward.py) runs it unchanged.

The order of a rank is a plan of slots, each "the next microbatch of (chunk, op)", in five phases. With
unit per-chunk costs, rank r starts at time r, and:
1. it runs 2 (pp - r) - 1 chunk-0 forwards until microbatch 0, down the pipeline and back up through
   chunk 1 on the ranks below it, reaches its chunk 1 (time 2 pp - 1 - r);
2. from then on chunk-1 activations arrive every other slot: r pairs (F1, F0) keep both chunks fed
   until the first gradient, from the last stage on rank 0, reaches it (time 2 pp + r);
3. pp - r rounds (F1, B1, W1) take chunk-1 gradients as they come; W runs at once, since the chunk-0
   gradients are still on their way down the V and back;
4. steady state, until every forward is issued: (F0, B0, W0, F1, B1, W1) — one forward and one
   backward of each chunk per round, each B followed by its W. Every rank then holds at most 2 pp chunk
   activations, pp microbatches' worth of its layers: 1F1B's peak (on its rank 0), on every rank;
5. cool-down: r pairs (B0, B1) and pp - r pairs (B0, W0) run the Bs that other ranks wait for first;
   the Ws still owed go last, when nobody is waiting.
Phase 1 of rank 0 needs 2 pp - 1 microbatches, SPEC's minimum (torch pads fewer to
that many and drops the padding's actions). This is the order torch's ScheduleZBVZeroBubble runs, so
the benchmark compares the two runtimes action for action.
"""

from __future__ import annotations

from collections import Counter

from hybridpar.pipeline.schedules.actions import Action, Op
from hybridpar.pipeline.schedules.spec import ScheduleSpec

Slot = tuple[int, Op]  # (chunk 0 or 1, op): "the next microbatch of this chunk and op"


def rank_plan(pp: int, r: int, n: int) -> list[Slot]:
    """The five phases (module docstring) of rank r for n >= 2 pp - 1 microbatches: n slots of each
    (chunk, op)."""
    F0, B0, W0 = (0, Op.FORWARD), (0, Op.BACKWARD), (0, Op.WEIGHT)
    F1, B1, W1 = (1, Op.FORWARD), (1, Op.BACKWARD), (1, Op.WEIGHT)
    plan = [F0] * (2 * (pp - r) - 1) + [F1, F0] * r + [F1, B1, W1] * (pp - r)
    f0_left = n - (2 * pp - 1 - r)  # chunk-0 forwards after phases 1 and 2
    # Steady rounds until the last chunk-1 forward: n - pp of them, the first f0_left with a new F0.
    for k in range(n - pp):
        plan += ([F0] if k < f0_left else []) + [B0, W0, F1, B1, W1]
    return plan + [B0, B1] * r + [B0, W0] * (pp - r) + [W1] * r + [W0] * r


def build_zb_v(pp: int, virtual_stages: int, m: int) -> list[list[Action]]:
    """Per rank, the compute actions of ZB-V. compute_schedule has checked virtual_stages == 2 and
    m >= 2 pp - 1 against SPEC."""
    assert virtual_stages == 2 and m >= 2 * pp - 1, (virtual_stages, m)
    out: list[list[Action]] = []
    for r in range(pp):
        stages = (r, 2 * pp - 1 - r)  # the V: down through chunk 0, back up through chunk 1
        taken: Counter[Slot] = Counter()
        acts: list[Action] = []
        for chunk, op in rank_plan(pp, r, m):
            acts.append(Action(stages[chunk], op, taken[chunk, op]))
            taken[chunk, op] += 1
        out.append(acts)
    return out


def zb_v_bubble(pp: int, v: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """Per-chunk costs t_f, t_b (B), t_w (W). Each rank idles max((p-1) t_b, 2 (p-1)(t_b - t_w),
    t_b + (p-2) t_w). The first term rules for t_b / 2 <= t_w <= t_b, the paper's design point
    t_f = t_b = t_w among them (Sec. 6), where the bubble is (p-1) / (6 m + p-1), about half of ZB-H1's;
    the second when W is too short to fill the wait for a gradient in the steady rounds (with t_f = t_b
    it is the paper's (p-1)(T_F + T_B - 2 T_W), T one chunk's cost); the third when W is longer than B:
    the Ws the cool-down still owes. Found from, and checked in tests/test_zbv.py against, the event
    simulation of the schedule for random costs with t_f <= t_b (a transformer's B is not cheaper than
    its F); a faster B makes the steady rounds wait in ways this closed form does not cover, so it
    refuses them. Fraction: idle / (2 m (t_f + t_b + t_w) + idle).
    """
    if t_f > t_b:
        raise ValueError(f"zb-v's bubble formula needs t_f <= t_b, got t_f={t_f} > t_b={t_b}")
    idle = max((pp - 1) * t_b, 2 * (pp - 1) * (t_b - t_w), t_b + (pp - 2) * t_w)
    return idle / (2 * m * (t_f + t_b + t_w) + idle)


SPEC = ScheduleSpec(
    "zb-v",
    "two chunks per rank in a V (rank r: stages r and 2 pp - 1 - r), backward split into B and W " "(Qi et al., 2024)",
    build_zb_v,
    zb_v_bubble,
    placement="v",
    min_pp=2,
    min_microbatches_rule=(2, -1),  # phase 1 of rank 0 (module docstring)
    virtual_stages=(2,),
    default_virtual_stages=2,
    splits_backward=True,
    live_repartition=True,
    torch_peer="ScheduleZBVZeroBubble",
    fallback="zb-h1",
)
