"""Activation recomputation as a choice of the adaptive microbatch policy (`batching.try_recompute`).

Full recomputation keeps a layer's input only (about a tenth of the activations of the default model),
so under a memory budget a larger microbatch may fit with it that would not fit without; it costs the
rerun forward (about a third of a layer's compute). Whether the larger microbatch is worth the rerun is
measured, never assumed.

Two adaptive policies (adaptive.py, unchanged), one per mode, each learning its own activation bytes per
sample from the peaks measured while it runs (the meter counts what recomputed layers keep) and
proposing only splits predicted within the budget. The recompute-off policy scans to its decision first,
then the recompute-on one; the mode kept is the one whose chosen split ran faster (the median
throughput of its measured steps at that split) — recompute only if it beats the other by more than
`switch_margin`, or if nothing fits the budget without it. From then on the kept policy alone runs,
with its own drift re-scans and out-of-memory handling, in its mode. Recomputation is bit-identical to
none in fp32 and every split trains the same model, so the choice never changes the model trained.
"""

from __future__ import annotations

from statistics import median
from typing import Any, Sequence

from hybridpar.batching.adaptive import AdaptivePolicy

MODES = ("none", "full")  # tried in this order


class RecomputeChoice:
    """A microbatch policy (fixed.py's interface) over (split, recomputation): `recompute` is the mode
    the next step runs its decoder layers under (the trainer sets it on every stage before the step)."""

    def __init__(self, off: AdaptivePolicy, on: AdaptivePolicy, switch_margin: float, warmup_steps: int) -> None:
        self.sides = dict(zip(MODES, (off, on)))
        self.margin, self.warmup = switch_margin, warmup_steps
        self.recompute = MODES[0]
        self.decided = False
        self._thr: dict[str, dict[tuple[int, ...], list[float]]] = {m: {} for m in MODES}
        self._last: tuple[str, tuple[int, ...]] | None = None  # (mode, split) of the previous step
        self._since = 0  # steps run at that (mode, split)

    def _side(self) -> AdaptivePolicy:
        return self.sides[self.recompute]

    def propose(self, step: int) -> list[int]:
        return self._side().propose(step)

    def observe(
        self, step: int, sizes: Sequence[int], step_time_s: float, peak_activation_bytes: int | None, tokens: int
    ) -> None:
        side = self._side()
        side.observe(step, sizes, step_time_s, peak_activation_bytes, tokens)
        if self.decided:
            return
        key = (self.recompute, tuple(sizes))
        self._since = self._since + 1 if key == self._last else 1
        self._last = key
        if self._since > self.warmup:  # a change of split or mode warms up unmeasured, as the policies do
            self._thr[self.recompute].setdefault(tuple(sizes), []).append(tokens / step_time_s)
        if side.exploring:
            return
        if self.recompute == MODES[0]:
            self.recompute = MODES[1]  # the recompute-off scan is decided: now the same with recomputation
            return
        self._decide(step)

    def _chosen(self, mode: str, step: int) -> float | None:
        """Median throughput of `mode`'s decided split, None where it was not measured or is over budget."""
        side = self.sides[mode]
        thr = self._thr[mode].get(tuple(side.propose(step)))
        return None if not thr or side.statistics()["over_budget"] else median(thr)

    def _decide(self, step: int) -> None:
        off, on = (self._chosen(m, step) for m in MODES)
        wins = on is not None and (off is None or on > off * (1 + self.margin))
        self.recompute, self.decided = MODES[int(wins)], True
        self._thr = {m: {} for m in MODES}  # what is left to measure belongs to the kept policy

    def on_oom(self, step: int, sizes: Sequence[int]) -> list[int]:
        return self._side().on_oom(step, sizes)

    def statistics(self) -> dict[str, Any]:
        out = self._side().statistics()
        out.update(recompute=self.recompute, recompute_decided=self.decided)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "recompute": self.recompute,
            "decided": self.decided,
            "throughput": {m: sorted((list(k), v) for k, v in t.items()) for m, t in self._thr.items()},
            "sides": {m: s.state_dict() for m, s in self.sides.items()},
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Continue from `state_dict()` (ValueError, naming the difference, for another policy's state)."""
        if d.get("version") != 1 or "sides" not in d or d.get("recompute") not in MODES:
            raise ValueError("policy state is not one of batching.try_recompute's (version 1)")
        for m in MODES:
            self.sides[m].load_state_dict(d["sides"][m])
        self.recompute, self.decided = d["recompute"], bool(d["decided"])
        self._thr = {m: {tuple(k): list(v) for k, v in d["throughput"][m]} for m in MODES}
        self._last, self._since = None, 0
