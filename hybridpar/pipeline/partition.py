"""Assign contiguous runs of transformer layers to pipeline stages.

A pipeline step runs at the pace of its slowest stage (every microbatch passes through
every stage, GPipe, Huang et al. 2019), so the objective is the classic "linear
partition" problem: split the layer sequence into contiguous blocks minimising the
maximum block time, solved exactly by dynamic programming over prefix sums (the same
formulation PipeDream's planner uses, Narayanan et al. 2019).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

# Relative slack when comparing floating-point stage times against the optimum, so that
# partitions that are equal up to rounding count as optimal.
_REL_TOL = 1e-9


def _is_int(x: object) -> bool:
    # numbers.Integral also admits numpy integers; bool is excluded as almost surely a bug.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(float(x))


def _check_counts(n_layers: int, n_stages: int) -> None:
    for label, value in (("n_layers", n_layers), ("n_stages", n_stages)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if n_stages > n_layers:
        raise ValueError(
            f"cannot split {n_layers} layers into {n_stages} stages: " "each stage needs at least one layer"
        )


def partition_uniform(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous blocks whose sizes differ by at most one.

    The first ``n_layers % n_stages`` stages get the extra layer: the last stage also
    carries the final norm and the LM head (the most expensive single block for large
    vocabularies), so it should not also get an extra transformer layer.
    """
    _check_counts(n_layers, n_stages)
    base, extra = divmod(n_layers, n_stages)
    parts: list[range] = []
    start = 0
    for k in range(n_stages):
        size = base + (1 if k < extra else 0)
        parts.append(range(start, start + size))
        start += size
    return parts


def _check_positive(label: str, values: Sequence[float]) -> None:
    for i, x in enumerate(values):
        if not _is_real(x) or x <= 0:
            raise ValueError(f"{label}[{i}] must be a positive finite number, got {x!r}")


def _check_inputs(
    layer_costs: Sequence[float], n_stages: int, first_extra: float, last_extra: float, speeds: Sequence[float] | None
) -> list[float]:
    """Validate and return the per-stage speeds (default: all 1.0)."""
    if not _is_int(n_stages) or n_stages < 1:
        raise ValueError(f"n_stages must be a positive integer, got {n_stages!r}")
    if len(layer_costs) == 0:
        raise ValueError("layer_costs is empty: there must be at least one layer")
    _check_counts(len(layer_costs), n_stages)
    _check_positive("layer_costs", layer_costs)
    for label, x in (("first_extra", first_extra), ("last_extra", last_extra)):
        if not _is_real(x) or x < 0:
            raise ValueError(f"{label} must be a finite number >= 0, got {x!r}")
    if speeds is None:
        return [1.0] * n_stages
    if len(speeds) != n_stages:
        raise ValueError(f"speeds has {len(speeds)} entries but there are {n_stages} stages")
    _check_positive("speeds", speeds)
    return [float(s) for s in speeds]


def stage_times(
    parts: Sequence[range],
    layer_costs: Sequence[float],
    first_extra: float = 0.0,
    last_extra: float = 0.0,
    speeds: Sequence[float] | None = None,
) -> list[float]:
    """Time of each stage: (its layer costs + embedding/head extras) / its speed."""
    speed = _check_inputs(layer_costs, len(parts), first_extra, last_extra, speeds)
    expected_start = 0
    for k, part in enumerate(parts):
        if part.step != 1 or part.start != expected_start or len(part) == 0:
            raise ValueError(
                f"stage {k} is {part}: stages must be non-empty, contiguous and "
                f"in order (expected it to start at layer {expected_start})"
            )
        expected_start = part.stop
    if expected_start != len(layer_costs):
        raise ValueError(f"stages cover layers 0..{expected_start - 1} " f"but there are {len(layer_costs)} layers")
    times: list[float] = []
    for k, part in enumerate(parts):
        work = math.fsum(layer_costs[i] for i in part)
        work += (first_extra if k == 0 else 0.0) + (last_extra if k == len(parts) - 1 else 0.0)
        times.append(work / speed[k])
    return times


def partition_by_cost(
    layer_costs: Sequence[float],
    n_stages: int,
    *,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
    speeds: Sequence[float] | None = None,
) -> list[range]:
    """Exact contiguous partition minimising the slowest stage's time.

    Stage k's time is (sum of its layer costs + first_extra if k == 0 + last_extra if
    k == n_stages - 1) / speeds[k]; the extras model the embedding on the first stage and
    the final norm + LM head on the last, speeds model heterogeneous devices.

    Tie-break: many partitions can share the optimal bottleneck (e.g. uniform costs), and
    an arbitrary one can be needlessly lopsided (one stage with a single layer). Among
    the optimal partitions we therefore pick the one minimising the sum of squared stage
    times (the most balanced), and among those the one that gives *earlier* stages more
    layers (the last stage as short as possible, then the one before it, ...), which
    matches partition_uniform on uniform costs. Two O(n_stages * n_layers^2) DP passes.
    """
    speed = _check_inputs(layer_costs, n_stages, first_extra, last_extra, speeds)
    n = len(layer_costs)
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + float(c))

    def time(k: int, i: int, j: int) -> float:
        """Time of stage k holding layers i..j-1."""
        work = prefix[j] - prefix[i]
        work += (first_extra if k == 0 else 0.0) + (last_extra if k == n_stages - 1 else 0.0)
        return work / speed[k]

    # Every stage needs >= 1 layer, so stage k (holding layers i..j-1) has k <= i < j and
    # j <= n - (n_stages - k - 1); the loop bounds below encode exactly that.
    inf = math.inf
    # Pass 1: best[k][j] = minimal bottleneck placing layers 0..j-1 on stages 0..k.
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n - n_stages + 2):
        best[0][j] = time(0, 0, j)
    # The inner loops inline `time` (the same operations in the same order): they run n_stages * n^2 times.
    extra = [(first_extra if k == 0 else 0.0) + (last_extra if k == n_stages - 1 else 0.0) for k in range(n_stages)]
    for k in range(1, n_stages):
        prev, e, sp = best[k - 1], extra[k], speed[k]
        for j in range(k + 1, n - (n_stages - k - 1) + 1):
            pj = prefix[j]
            best[k][j] = min([max(prev[i], (pj - prefix[i] + e) / sp) for i in range(k, j)])
    return _balanced(prefix, extra, speed, best[n_stages - 1][n] * (1.0 + _REL_TOL))


def _balanced(prefix: list[float], extra: list[float], speed: Sequence[float], bound: float) -> list[range]:
    """Pass 2 of `partition_by_cost`: among the partitions whose every stage fits under `bound`, the one with the
    least sum of squared stage times (additive over stages, so the DP stays exact), later stages the shorter on
    ties. `prefix`: the layers' cost sums, `extra` and `speed` per stage."""
    n, n_stages, inf = len(prefix) - 1, len(extra), math.inf
    sq = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n - n_stages + 2):
        t = (prefix[j] - prefix[0] + extra[0]) / speed[0]
        if t <= bound:
            sq[0][j] = t * t
    for k in range(1, n_stages):
        prev, e, sp = sq[k - 1], extra[k], speed[k]
        for j in range(k + 1, n - (n_stages - k - 1) + 1):
            pj = prefix[j]
            # The stage's time grows as its first layer i falls (costs >= 0, and rounding keeps order), so the
            # cuts under the bound are a suffix of range(k, j): the loop below skips the others anyway.
            lo = j - 1
            while lo > k and (pj - prefix[lo - 1] + e) / sp <= bound:
                lo -= 1
            for i in range(lo, j):
                t = (pj - prefix[i] + e) / sp
                if t > bound or prev[i] == inf:
                    continue
                cand = prev[i] + t * t
                # `<=` while i grows: on (near-)ties keep the latest cut, so later stages
                # get fewer layers; the relative slack absorbs rounding differences.
                if cand <= sq[k][j] * (1.0 + _REL_TOL):
                    sq[k][j], cut[k][j] = min(cand, sq[k][j]), i
    parts: list[range] = []
    j = n
    for k in range(n_stages - 1, 0, -1):
        i = cut[k][j]
        parts.append(range(i, j))
        j = i
    parts.append(range(0, j))
    return parts[::-1]


def partition_by_params(
    layer_params: Sequence[int], n_stages: int, *, embed_params: int = 0, head_params: int = 0
) -> list[range]:
    """Balance parameter counts (i.e. weight + optimizer memory) across stages.

    embed_params sits on the first stage (token embedding), head_params on the last
    (final norm + LM head, unless tied to the embedding).
    """
    for label, value in (("embed_params", embed_params), ("head_params", head_params)):
        if not _is_int(value) or value < 0:
            raise ValueError(f"{label} must be an integer >= 0, got {value!r}")
    for i, p in enumerate(layer_params):
        if not _is_int(p) or p <= 0:
            raise ValueError(f"layer_params[{i}] must be a positive integer, got {p!r}")
    return partition_by_cost(layer_params, n_stages, first_extra=embed_params, last_extra=head_params)
