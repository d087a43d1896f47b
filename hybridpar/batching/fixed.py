"""Microbatch policies: how one replica's share of the step's batch is cut into microbatches. Here the
interface every policy follows, what they record, and the fixed policy (adaptive.py: the adaptive one).

Sizes follow device memory and measured performance, from what the trainer measures and feeds in
each step (no assumed constant such as bytes per token):

    sizes = policy.propose(step)            # before the step; sums exactly to the replica batch
    ...run the step (on OOM: sizes = policy.on_oom(step, sizes), retry)...
    policy.observe(step, sizes, step_time_s, peak_activation_bytes, tokens)

Policies are deterministic in their observations (no clock, no randomness): every rank of a pipeline
fed the same ones (step time and peak reduced over the pipeline) proposes the same split, which the
runtime needs (each message's shape comes from the split).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from hybridpar.batching.split import split_evenly


@dataclass(frozen=True)
class Observation:
    step: int
    sizes: tuple[int, ...]
    step_time_s: float
    peak_activation_bytes: int | None  # peak during the step minus memory resident before it
    tokens: int

    @property
    def throughput(self) -> float:
        return self.tokens / self.step_time_s


class MicrobatchPolicy(Protocol):
    """What the trainer asks of a policy (FixedPolicy, AdaptivePolicy)."""

    def propose(self, step: int) -> list[int]: ...
    def observe(
        self, step: int, sizes: Sequence[int], step_time_s: float, peak_activation_bytes: int | None, tokens: int
    ) -> None: ...
    def on_oom(self, step: int, sizes: Sequence[int]) -> list[int] | None: ...
    def statistics(self) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, Any] | None: ...
    def load_state_dict(self, d: dict[str, Any]) -> None: ...


def split_by_size(total: int, size: int) -> list[int]:
    """The fewest balanced microbatches of at most `size`: 10 by 4 -> [4, 3, 3], not [4, 4, 2] — an
    uneven last microbatch would not save memory and would idle the pipeline while the others run."""
    if size < 1:
        raise ValueError(f"microbatch size must be >= 1, got {size}")
    return split_evenly(total, math.ceil(total / size))


class _Recorder:
    """Running totals (not a growing log: the trainer calls this every step for days) and the
    statistics every policy reports."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.steps, self._sum_time, self._sum_thr = 0, 0.0, 0.0
        self.history: list[dict[str, Any]] = []  # one entry per measured (split, throughput) block
        self.converged_step: int | None = None
        self.steps_to_converge: int | None = None

    def _record(
        self, step: int, sizes: Sequence[int], step_time_s: float, peak: int | None, tokens: int
    ) -> Observation:
        if sum(sizes) != self.batch or min(sizes, default=0) < 1 or not step_time_s > 0 or tokens < 0:
            raise ValueError(
                f"observed sizes {list(sizes)} must be positive and sum to {self.batch}, "
                f"step_time_s={step_time_s} > 0, tokens={tokens} >= 0"
            )
        obs = Observation(step, tuple(sizes), float(step_time_s), peak, tokens)
        self.steps, self._sum_time, self._sum_thr = (
            self.steps + 1,
            self._sum_time + obs.step_time_s,
            self._sum_thr + obs.throughput,
        )
        return obs

    def _converge(self, step: int) -> None:
        if self.converged_step is None:
            self.converged_step, self.steps_to_converge = step, self.steps

    def _stats(self, name: str, split: list[int], converged: bool) -> dict[str, Any]:
        n = self.steps
        return {
            "policy": name,
            "current_split": split,
            "history": list(self.history),
            "mean_latency_s": self._sum_time / n if n else None,
            "mean_throughput": self._sum_thr / n if n else None,
            "steps_observed": n,
            "converged": converged,
            "steps_to_converge": self.steps_to_converge,
        }


class FixedPolicy(_Recorder):
    """A fixed split: `count` balanced microbatches, the fewest balanced ones of at most `size`, or
    explicit `sizes`."""

    def __init__(
        self,
        replica_batch: int,
        *,
        count: int | None = None,
        size: int | None = None,
        sizes: Sequence[int] | None = None,
    ) -> None:
        if [count, size, sizes].count(None) != 2:
            raise ValueError(f"give exactly one of count={count}, size={size} and sizes={sizes}")
        super().__init__(replica_batch)
        if sizes is not None:
            if sum(sizes) != replica_batch or min(sizes, default=0) < 1:
                raise ValueError(f"microbatch sizes {list(sizes)} must be positive and sum to {replica_batch}")
            self.split = list(sizes)
        else:
            self.split = split_evenly(replica_batch, count) if count is not None else split_by_size(replica_batch, size)
        self.steps_to_converge = 0

    def propose(self, step: int) -> list[int]:
        return list(self.split)

    def observe(
        self, step: int, sizes: Sequence[int], step_time_s: float, peak_activation_bytes: int | None, tokens: int
    ) -> None:
        self._record(step, sizes, step_time_s, peak_activation_bytes, tokens)

    def on_oom(self, step: int, sizes: Sequence[int]) -> list[int] | None:
        return None  # a fixed split has no smaller one to offer: the trainer reports the OOM

    def state_dict(self) -> None:
        return None  # nothing measured that a resumed run would need

    def load_state_dict(self, d: dict[str, Any]) -> None:
        pass  # another policy's state (the policy was changed on resume): a fixed split ignores it

    def statistics(self) -> dict[str, Any]:
        out = self._stats("fixed", self.propose(0), True)
        out["history"] = [{"split": self.split, "mean_throughput": out["mean_throughput"], "steps": self.steps}]
        return out
