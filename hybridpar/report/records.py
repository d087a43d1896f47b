"""Per-step, per-rank summaries of where a rank's pipeline time went, cheap enough for every step.

Each rank reduces its step's action timeline (pipeline/runtime.py) to a few seconds: computing (F, B, W
minus the time blocked on a message inside them), waiting for messages, posting sends and receives, and
the span of its action list. The trainer packs them into the step's existing loss reduction (one slot
per rank in a summed vector), so gathering them costs no extra collective.

The measured bubble of a step is the fraction of the pipeline's wall time in which the ranks were not
computing: 1 - sum_r compute_r / (R x wall), wall being the longest rank's span. It counts waits,
message posting and the runtime's own overhead as idle — what a user pays for, unlike the schedule's
formula, which assumes equal unit costs (its ScheduleSpec, pipeline/schedules/).
"""

from __future__ import annotations

from typing import Any, Sequence

from hybridpar.pipeline.runtime import StepOutput
from hybridpar.pipeline.schedules import COMPUTE_OPS

# The order of one rank's slot in the packed vector, and the record's field names.
FIELDS: tuple[str, ...] = ("compute_s", "wait_s", "comm_s", "pipeline_s", "work")


def rank_summary(out: StepOutput, work: float) -> list[float]:
    """This rank's slot: compute, wait and comm seconds, the span of its action list, and `work` (the
    cost model's units of work this rank did, so that speeds compare across unequal stages).
    Waits always sit inside F/B actions (runtime.py `_recv`), so they are taken out of compute."""
    compute = comm = 0.0
    for t in out.timeline:
        if t.action.op in COMPUTE_OPS:
            compute += t.end - t.start
        else:
            comm += t.end - t.start
    wait = sum(w.end - w.start for w in out.waits)
    span = out.timeline[-1].end - out.timeline[0].start if out.timeline else 0.0
    return [max(0.0, compute - wait), wait, comm, span, float(work)]


def unpack(values: Sequence[float], world: int) -> dict[str, list[float]]:
    """The summed vector's per-rank slots -> {field: [value of rank 0, rank 1, ...]} (microseconds)."""
    n = len(FIELDS)
    if len(values) != n * world:
        raise ValueError(f"expected {n * world} values for {world} ranks, got {len(values)}")
    return {f: [round(float(values[r * n + i]), 6) for r in range(world)] for i, f in enumerate(FIELDS)}


def bubble(ranks: dict[str, list[float]]) -> float | None:
    """Measured bubble of one step (module docstring); None for an empty step."""
    wall = max(ranks["pipeline_s"], default=0.0)
    if wall <= 0:
        return None
    return max(0.0, 1.0 - sum(ranks["compute_s"]) / (len(ranks["compute_s"]) * wall))


def step_fields(ranks: dict[str, list[float]]) -> dict[str, Any]:
    """What a step's metrics record gains: the per-rank lists and the bubble."""
    b = bubble(ranks)
    return {"ranks": ranks, "bubble": None if b is None else round(b, 4)}
