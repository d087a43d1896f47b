"""Action builders of GPipe, 1F1B, interleaved 1F1B and ZB-H1: per pipeline rank, the ordered compute
actions (F and B; also W where the backward is split). Each is named by its `ScheduleSpec.builder` in
config/schedules.py and called through `schedules.compute_schedule`, which has checked the arguments
against the spec's constraints; `schedules.build_schedule` adds the communication and validates.
"""

from __future__ import annotations

from hybridpar.pipeline.schedules import Action, Op

F, B = Op.FORWARD, Op.BACKWARD


def one_f_one_b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    """Warm up with `warmup` forwards, then alternate one F / one B, then drain the Bs."""
    order = fwd[:warmup]
    for i in range(len(fwd) - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[len(fwd) - warmup :]


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


def _single_stage(m: int, warmup: int, r: int) -> list[Action]:
    return one_f_one_b([Action(r, F, i) for i in range(m)], [Action(r, B, i) for i in range(m)], warmup)


def build_gpipe(pp: int, virtual_stages: int, m: int) -> list[list[Action]]:
    # GPipe (Huang et al., 2019) is 1F1B with a full warm-up: all forwards, then all backwards,
    # stashing m activations.
    return [_single_stage(m, m, r) for r in range(pp)]


def build_1f1b(pp: int, virtual_stages: int, m: int) -> list[list[Action]]:
    # PipeDream-flush (Narayanan et al., 2021, "Memory-efficient pipeline-parallel DNN training") warms
    # up with pp - r - 1, so rank r holds at most pp - r microbatches in flight.
    return [_single_stage(m, min(pp - r - 1, m), r) for r in range(pp)]


def build_zb_h1(pp: int, virtual_stages: int, m: int) -> list[list[Action]]:
    # ZB-H1 (Qi et al., 2024, Sec. 2.1, Fig. 3 top): keep 1F1B's F/B order and delay rank r's Ws by r
    # microbatches, the warm-up it has less than rank 0. Its Bs then run as soon as the gradient arrives,
    # the owed Ws fill the drain, and every rank holds at most (pp - r) + r = pp microbatches whose W is
    # pending: rank 0's 1F1B peak. With unit F = B = W this meets the paper's (p-1)(F+B-W) bubble
    # exactly; a greedy "B, else F, else W" list scheduler either defers every W to the end (memory grows
    # with m) or, with a pp cap on pending Ws, loses 1-4 units at pp <= 8.
    # torch's ScheduleInterleavedZeroBubble with one stage per rank runs the same order: `_get_warmup_ops`
    # gives rank r the 1F1B warm-up pp - 1 - r, and `_get_1f1b_rank_ops(enable_zero_bubble=True,
    # num_1f1b_microbatches=r)` puts W(j) right after B(j + r) (torch 2.13 schedules.py). One difference
    # remains, in torch: stage 0 (whose input needs no gradient) runs nothing at B and its full backward
    # at W.
    return [defer_weights(order, r) for r, order in enumerate(build_1f1b(pp, 1, m))]


def build_interleaved(pp: int, v: int, m: int) -> list[list[Action]]:
    # Megatron-LM interleaved 1F1B: local step k touches chunk (k // pp) % v for a group of pp
    # microbatches; backwards visit the chunks in reverse. The extra (v - 1) * pp warm-up forwards fill
    # the deeper virtual pipeline before the first backward can arrive.
    out: list[list[Action]] = []
    total = m * v
    mbs = [(k // (pp * v)) * pp + k % pp for k in range(total)]
    for r in range(pp):
        fwd = [Action(((k // pp) % v) * pp + r, F, mbs[k]) for k in range(total)]
        bwd = [Action((v - 1 - (k // pp) % v) * pp + r, B, mbs[k]) for k in range(total)]
        out.append(one_f_one_b(fwd, bwd, min((pp - r - 1) * 2 + (v - 1) * pp, total)))
    return out
