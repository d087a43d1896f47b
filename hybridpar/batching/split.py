"""How a global batch is divided: among data-parallel replicas, then into microbatches.

Sizes always sum exactly to what is divided. The
order of samples never depends on the division: replica r takes a contiguous slice of the step's
global batch and its microbatches are contiguous slices of that, so every layout sees the same
samples and, with token-weighted gradients, trains the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def split_evenly(total: int, parts: int) -> list[int]:
    """`total` into `parts` sizes differing by at most one, larger first: 10 into 4 -> [3, 3, 2, 2]."""
    if parts < 1 or total < parts:
        raise ValueError(f"cannot split {total} samples into {parts} non-empty parts")
    q, r = divmod(total, parts)
    return [q + 1] * r + [q] * (parts - r)


@dataclass(frozen=True)
class BatchPlan:
    """Sizes of every replica's microbatches for one step: plan.sizes[dp_rank][mb]."""

    sizes: tuple[tuple[int, ...], ...]

    @property
    def global_batch(self) -> int:
        return sum(map(sum, self.sizes))

    def replica_offset(self, dp_rank: int) -> int:
        """Index, within the global batch, of replica dp_rank's first sample."""
        return sum(sum(s) for s in self.sizes[:dp_rank])


def plan_batch(
    global_batch: int,
    dp: int,
    microbatches: int,
    microbatch_sizes: Sequence[int] | None = None,
    replica_sizes: Sequence[int] | None = None,
) -> BatchPlan:
    """Even split by default; `replica_sizes` gives an uneven data-parallel split (each replica's share)
    and `microbatch_sizes` an explicit split of every replica's share."""
    reps = list(replica_sizes) if replica_sizes is not None else split_evenly(global_batch, dp)
    if len(reps) != dp or sum(reps) != global_batch or min(reps) < 1:
        raise ValueError(f"replica sizes {reps} must be {dp} positive sizes summing to {global_batch}")
    sizes = []
    for n in reps:
        if microbatch_sizes is not None:
            mbs = list(microbatch_sizes)
            if len(mbs) != microbatches or sum(mbs) != n or min(mbs) < 1:
                raise ValueError(f"microbatch sizes {mbs} must be {microbatches} positive sizes summing to {n}")
        else:
            mbs = split_evenly(n, microbatches)
        sizes.append(tuple(mbs))
    return BatchPlan(tuple(sizes))
