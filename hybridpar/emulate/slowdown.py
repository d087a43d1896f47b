"""Slow-device emulation: a named testing/benchmark mode that stretches chosen ranks' compute.

On one machine (CPU, or a node of identical GPUs) the balancer has no slow device to react to, so a
benchmark or test can *emulate* one: ``rank=2:2.0@step=10`` makes rank 2 take twice its measured
compute time from step 10 on. The mode is off by default (an empty spec means no slowdown) and is
always labelled as emulation, never a silent default (DESIGN.md, "Emulation is labelled").

Grammar (whitespace around tokens is ignored)::

    spec  := "" | entry ("," entry)*
    entry := "rank=" INT ":" FACTOR ["@step=" INT]      # no "@step" means from step 0

For each rank, the entry with the largest step <= the current step wins, so
``rank=2:2.0@step=10,rank=2:1.0@step=50`` slows rank 2 for steps 10..49 and then lets it recover.

Factors must be >= 1.0: emulation can only *add* time to what a device really takes (the rank
sleeps for ``(factor - 1) x`` its measured compute), it cannot make a device faster. A faster
device is emulated by slowing down all the others. The run entry attaches the plan to the trainer
(attach.py): before each step it sets the pipeline runtime's `stretch` to this rank's factor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

EXPECTED_FORM = "rank=<int>:<factor>@step=<int>, e.g. 'rank=2:2.0@step=10'"
# Signs are allowed by the pattern so that "-1" gets the precise "must be >= 0" message rather than
# the generic "malformed" one.
_ENTRY = re.compile(r"rank=([+-]?\d+):([^@]+?)(?:@step=([+-]?\d+))?")


def parse_factor(text: str, where: str, form: str) -> float:
    """The slow-down factor `text` of every emulation spec (slowdown, drift and spike, slow link): a finite
    number >= 1.0, since emulation can only add time; ValueError naming `where` (the entry) and `form`."""
    try:
        factor = float(text)
    except ValueError:
        raise ValueError(f"{where}: factor {text!r} is not a number; expected {form}") from None
    if not math.isfinite(factor) or factor < 1.0:
        raise ValueError(f"{where}: factor must be a finite number >= 1.0 (emulation can only add time), got {factor}")
    return factor


@dataclass(frozen=True)
class Slowdown:
    """From `step` on, `rank`'s compute takes `factor` times its measured time."""

    rank: int
    factor: float
    step: int = 0


@dataclass(frozen=True)
class SlowdownPlan:
    """Parsed emulation spec; entries are sorted by (rank, step) and unique per (rank, step)."""

    entries: tuple[Slowdown, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> SlowdownPlan:
        """Parse ``"rank=2:2.0@step=10,rank=0:1.5"``; raise ValueError naming the bad token."""
        entries: dict[tuple[int, int], Slowdown] = {}
        for raw in spec.split(",") if spec.strip() else []:
            token = raw.strip()
            m = _ENTRY.fullmatch(token)
            if m is None:
                raise ValueError(f"slowdown token {token!r} in {spec!r} is malformed: " f"expected {EXPECTED_FORM}")
            rank, step = int(m.group(1)), int(m.group(3) or 0)
            if rank < 0 or step < 0:
                raise ValueError(
                    f"slowdown token {token!r}: rank and step must be >= 0, " f"got rank={rank}, step={step}"
                )
            factor = parse_factor(m.group(2), f"slowdown token {token!r}", EXPECTED_FORM)
            if (rank, step) in entries:
                raise ValueError(
                    f"slowdown token {token!r}: rank {rank} already has a factor "
                    f"at step {step}; give each (rank, step) once"
                )
            entries[(rank, step)] = Slowdown(rank, factor, step)
        return cls(tuple(entries[k] for k in sorted(entries)))

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(e.rank for e in self.entries)

    @staticmethod
    def from_config(spec: str, world_size: int) -> "SlowdownPlan":
        """Parse and check `emulate.slowdown`; errors name the config key."""
        try:
            plan = SlowdownPlan.parse(spec)
            plan.validate(world_size)
        except ValueError as e:
            raise ValueError(f"emulate.slowdown={spec!r}: {e}") from None
        return plan

    def validate(self, world_size: int) -> None:
        """Refuse ranks that do not exist, before any process starts."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        bad = sorted(r for r in self.ranks if r >= world_size)
        if bad:
            raise ValueError(
                f"slowdown names rank(s) {bad} but world size is {world_size} " f"(ranks are 0..{world_size - 1})"
            )

    def factor(self, rank: int, step: int) -> float:
        """Compute stretch for `rank` at `step`: 1.0 unless an entry with step <= `step` applies."""
        current = 1.0
        for e in self.entries:  # sorted by step within a rank: the last match is the latest
            if e.rank == rank and e.step <= step:
                current = e.factor
        return current
