"""Interleaved 1F1B (Megatron-LM, Narayanan et al., 2021): 1F1B over virtual_stages model chunks per
rank, placed in a loop (stage s on rank s % pp)."""

from __future__ import annotations

from hybridpar.pipeline.schedules.actions import Action, Op
from hybridpar.pipeline.schedules.one_f_one_b import flush_bubble, one_f_one_b
from hybridpar.pipeline.schedules.spec import ScheduleSpec


def build_interleaved(pp: int, v: int, m: int) -> list[list[Action]]:
    # Local step k touches chunk (k // pp) % v for a group of pp microbatches; backwards visit the chunks
    # in reverse. The extra (v - 1) * pp warm-up forwards fill the deeper virtual pipeline before the
    # first backward can arrive.
    out: list[list[Action]] = []
    total = m * v
    mbs = [(k // (pp * v)) * pp + k % pp for k in range(total)]
    for r in range(pp):
        fwd = [Action(((k // pp) % v) * pp + r, Op.FORWARD, mbs[k]) for k in range(total)]
        bwd = [Action((v - 1 - (k // pp) % v) * pp + r, Op.BACKWARD, mbs[k]) for k in range(total)]
        out.append(one_f_one_b(fwd, bwd, min((pp - r - 1) * 2 + (v - 1) * pp, total)))
    return out


SPEC = ScheduleSpec(
    "interleaved-1f1b",
    "1F1B over virtual_stages chunks per rank (Megatron-LM, Narayanan et al., 2021)",
    build_interleaved,
    flush_bubble,
    min_pp=2,
    microbatches_multiple_of_pp=True,
    virtual_stages=None,
    default_virtual_stages=2,
    live_repartition=True,
    torch_peer="ScheduleInterleaved1F1B",
    fallback="1f1b",
)
