"""A GPU's GEMM efficiency by shape: the `matmul_table` of a hardware file's `[gpu_calibration]`.

Rows `[m, n, k, fraction]`: an (m x k) @ (k x n) product in bf16 ran at `fraction` of the datasheet bf16 peak,
measured by `hybridpar plan --probe --hardware DATASHEET.toml` on a CUDA device (plan/gpu_probe.py). The rows
form a full grid (every m with every n with every k), so any shape is read between its eight neighbours.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class MatmulTable:
    rows: tuple[tuple[int, int, int, float], ...]

    @cached_property
    def axes(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The grid's distinct m, n and k values, ascending."""
        return tuple(tuple(sorted({r[i] for r in self.rows})) for i in range(3))  # type: ignore[return-value]

    @cached_property
    def _by_shape(self) -> dict[tuple[int, int, int], float]:
        return {(r[0], r[1], r[2]): r[3] for r in self.rows}

    @cached_property
    def _best(self) -> float:
        return max(r[3] for r in self.rows)

    @cached_property
    def _memo(self) -> dict[tuple[float, float, float], float]:
        return {}

    def best(self) -> float:
        """The best row's fraction (matmul_fraction): once per table, not per GEMM costed."""
        return self._best

    def fraction(self, m: float, n: float, k: float) -> float:
        """The fraction of the peak an (m x k) @ (k x n) GEMM reaches: trilinear in (log m, log n, log k)
        between the grid's neighbours, each coordinate clamped to the grid. Log coordinates because the grid
        is geometric (powers of two) and a GEMM's efficiency changes with the size's order of magnitude (how
        many tiles and waves it fills), not with its difference: halfway between 2048 and 4096 in log is
        2896, where linear interpolation would put 3072's rate at 2048's tile count's halfway mark. Clamped
        rather than extrapolated: beyond the largest size a GEMM only fills the device as well (every tile
        busy already), and below the smallest a slope would soon give rates below zero; the grid is chosen to
        span the shapes of the models planned (a tp shard of a small model's projection to a large model's
        tokens), so clamping is rare."""
        key = (m, n, k)
        if key in self._memo:  # a search costs the same few shapes thousands of times
            return self._memo[key]
        table = self._by_shape
        corners = [_bracket(axis, x) for axis, x in zip(self.axes, (m, n, k))]
        total = 0.0
        for i in (0, 1):
            for j in (0, 1):
                for l in (0, 1):  # noqa: E741
                    w = corners[0][2 * i + 1] * corners[1][2 * j + 1] * corners[2][2 * l + 1]
                    if w:
                        total += w * table[(corners[0][2 * i], corners[1][2 * j], corners[2][2 * l])]
        self._memo[key] = total
        return total

    def to_toml(self) -> str:
        body = ",\n".join(f"  [{m}, {n}, {k}, {f!r}]" for m, n, k, f in self.rows)
        return f"matmul_table = [\n{body},\n]\n"


def _bracket(axis: tuple[int, ...], x: float) -> tuple[int, float, int, float]:
    """(low, weight of low, high, weight of high) of `x` on `axis`, linear in log x, clamped to its ends."""
    if x <= axis[0] or len(axis) == 1:
        return axis[0], 1.0, axis[0], 0.0
    if x >= axis[-1]:
        return axis[-1], 1.0, axis[-1], 0.0
    hi = bisect.bisect_right(axis, x)
    a, b = axis[hi - 1], axis[hi]
    t = (math.log(x) - math.log(a)) / (math.log(b) - math.log(a))
    return a, 1.0 - t, b, t


def parse_matmul_table(rows: Any, where: str) -> MatmulTable:
    """The table from its TOML list; ValueError naming the row and what it must be, or the grid's missing
    shapes."""
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{where}: matmul_table must be a non-empty list of [m, n, k, fraction] rows, got {rows!r}")
    out = []
    for r in rows:
        ok = (
            isinstance(r, list)
            and len(r) == 4
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in r)
        )
        if not ok or not all(isinstance(x, int) and x > 0 for x in r[:3]):
            raise ValueError(
                f"{where}: matmul_table rows must be [m, n, k, fraction] with m, n, k positive integers, got {r!r}"
            )
        if not 0 < r[3] <= 1 or not math.isfinite(r[3]):
            raise ValueError(f"{where}: matmul_table row {r!r}: the fraction must be in (0, 1]")
        out.append((r[0], r[1], r[2], float(r[3])))
    shapes = [r[:3] for r in out]
    if len(set(shapes)) != len(shapes):
        twice = sorted({s for s in shapes if shapes.count(s) > 1})
        raise ValueError(f"{where}: matmul_table lists a shape twice: {', '.join(map(str, twice))}")
    table = MatmulTable(tuple(sorted(out)))
    ms, ns, ks = table.axes
    missing = [(m, n, k) for m in ms for n in ns for k in ks if (m, n, k) not in set(shapes)]
    if missing:
        shown = ", ".join(str(list(s)) for s in missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ValueError(
            f"{where}: matmul_table must be a full grid (every m of {list(ms)} with every n of {list(ns)} and every "
            f"k of {list(ks)}); missing {shown}"
        )
    return table
