"""Slowdowns that change over time: named testing/benchmark modes, off by default, that stretch a rank's
compute like `emulate.slowdown` (slowdown.py) but with a shape, so the balancer meets what real devices do.

- drift (`--emulate.drift "rank=1:2.5@step=50+300"`): rank 1 slows gradually from 1x at step 50 to 2.5x at
  step 200 (the middle) and recovers as gradually to 1x at step 350 (a device heating up and throttling,
  a neighbour's job ramping). Linear both ways. The balancer should follow it, moving at most once per
  `balance.interval`, never back and forth.
- spike (`--emulate.spike "rank=1:5.0@step=40+3"`): rank 1 is 5x slow for steps 40, 41 and 42 only (a
  garbage collection, a checkpoint write by a neighbour). The balancer must not move anything for it: its
  smoothing median over `balance.window` readings outvotes a spike shorter than half the window.

Grammar of both (whitespace ignored)::

    spec  := "" | entry ("," entry)*
    entry := "rank=" INT ":" FACTOR "@step=" INT "+" INT        # peak factor, first step, length in steps

Factors are >= 1 (emulation only adds time). Where entries overlap, and with `emulate.slowdown`, factors
multiply. The run entry sets the runtime's stretch to the product each step (attach.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hybridpar.emulate.slowdown import parse_factor

EXPECTED_FORM = "rank=<int>:<factor>@step=<first>+<length>, e.g. 'rank=1:2.5@step=50+300'"
_ENTRY = re.compile(r"rank=(\d+):([0-9.eE+-]+)@step=(\d+)\+(\d+)")
SHAPES: tuple[str, ...] = ("drift", "spike")


@dataclass(frozen=True)
class Shaped:
    """From `step` for `length` steps, `rank`'s compute stretched up to `factor`, shaped by `shape`."""

    shape: str  # drift: a linear rise to `factor` at the middle and back; spike: `factor` throughout
    rank: int
    factor: float
    step: int
    length: int

    def at(self, step: int) -> float:
        """This entry's factor at `step` (1.0 outside its steps)."""
        k = step - self.step
        if not 0 <= k < self.length:
            return 1.0
        if self.shape == "spike":
            return self.factor
        half = self.length / 2.0
        return 1.0 + (self.factor - 1.0) * (1.0 - abs(k - half) / half)


def parse_shaped(shape: str, spec: str, world_size: int | None = None) -> tuple[Shaped, ...]:
    """Parse `emulate.<shape>`; ValueError naming the key, the entry and what is expected."""
    if shape not in SHAPES:
        raise ValueError(f"unknown slowdown shape {shape!r} (known: {', '.join(SHAPES)})")
    out = []
    for raw in (e for e in spec.replace(" ", "").split(",") if e):
        m = _ENTRY.fullmatch(raw)
        if m is None:
            raise ValueError(f"emulate.{shape} entry {raw!r} is malformed: expected {EXPECTED_FORM}")
        rank, step, length = int(m[1]), int(m[3]), int(m[4])
        factor = parse_factor(m[2], f"emulate.{shape} entry {raw!r}", EXPECTED_FORM)
        if length < 1:
            raise ValueError(f"emulate.{shape} entry {raw!r}: length must be >= 1 step, got {length}")
        if world_size is not None and rank >= world_size:
            raise ValueError(f"emulate.{shape} entry {raw!r}: rank {rank} does not exist in a world of {world_size}")
        out.append(Shaped(shape, rank, factor, step, length))
    return tuple(out)


def shaped_factor(entries: tuple[Shaped, ...], rank: int, step: int) -> float:
    """The product of every entry's factor for `rank` at `step` (1.0 when none applies)."""
    f = 1.0
    for e in entries:
        if e.rank == rank:
            f *= e.at(step)
    return f
