"""Tests for hybridpar.pipeline.partition: exact min-max contiguous splits of layers to stages."""

from __future__ import annotations

import itertools
import random

import pytest

from hybridpar.pipeline.partition import (
    partition_by_cost,
    partition_by_params,
    partition_uniform,
    stage_times,
)


def check_contiguous(parts: list[range], n_layers: int, n_stages: int) -> None:
    assert len(parts) == n_stages
    assert parts[0].start == 0 and parts[-1].stop == n_layers
    for a, b in zip(parts, parts[1:]):
        assert a.stop == b.start
    assert all(len(p) >= 1 and p.step == 1 for p in parts)


def brute_force_bottleneck(costs: list[float], n_stages: int, first: float, last: float, speeds: list[float]) -> float:
    """Try every contiguous split; an independent reimplementation of the stage time."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        bounds = (0, *cuts, n)
        worst = 0.0
        for k in range(n_stages):
            work = sum(costs[bounds[k] : bounds[k + 1]])
            work += (first if k == 0 else 0.0) + (last if k == n_stages - 1 else 0.0)
            worst = max(worst, work / speeds[k])
        best = min(best, worst)
    return best


@pytest.mark.parametrize(
    "n_layers, n_stages, sizes",
    [
        (8, 4, [2, 2, 2, 2]),
        (10, 4, [3, 3, 2, 2]),
        (7, 3, [3, 2, 2]),
        (5, 5, [1, 1, 1, 1, 1]),
        (32, 1, [32]),
        (33, 8, [5, 4, 4, 4, 4, 4, 4, 4]),
    ],
)
def test_partition_uniform(n_layers: int, n_stages: int, sizes: list[int]) -> None:
    parts = partition_uniform(n_layers, n_stages)
    check_contiguous(parts, n_layers, n_stages)
    assert [len(p) for p in parts] == sizes


def test_partition_uniform_all_sizes() -> None:
    for n_layers in range(1, 40):
        for n_stages in range(1, n_layers + 1):
            parts = partition_uniform(n_layers, n_stages)
            check_contiguous(parts, n_layers, n_stages)
            sizes = [len(p) for p in parts]
            assert max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)  # the extras go to earlier stages


def test_by_cost_matches_brute_force() -> None:
    rng = random.Random(1234)
    for trial in range(600):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        if trial % 3 == 0:  # integer costs: lots of exact ties
            costs = [float(rng.randint(1, 4)) for _ in range(n)]
        else:
            costs = [rng.uniform(0.1, 10.0) for _ in range(n)]
        first = rng.choice([0.0, rng.uniform(0.0, 8.0)])
        last = rng.choice([0.0, rng.uniform(0.0, 8.0)])
        speeds = [1.0] * k if trial % 2 else [rng.uniform(0.5, 2.0) for _ in range(k)]
        parts = partition_by_cost(costs, k, first_extra=first, last_extra=last, speeds=speeds)
        check_contiguous(parts, n, k)
        got = max(stage_times(parts, costs, first, last, speeds))
        want = brute_force_bottleneck(costs, k, first, last, speeds)
        assert got == pytest.approx(want, rel=1e-9), (costs, k, first, last, speeds, parts)


def test_by_cost_uniform_matches_uniform() -> None:
    # The balanced tie-break reproduces partition_uniform on equal costs.
    for n in range(1, 20):
        for k in range(1, n + 1):
            assert partition_by_cost([2.5] * n, k) == partition_uniform(n, k)


def test_by_cost_is_deterministic_and_balanced() -> None:
    # Both [0..3) [3..4) and [0..2) [2..4) have bottleneck 3; the tie-break prefers the
    # smaller sum of squares (3,1 -> 10 vs 2,2 -> 8).
    costs = [1.0, 1.0, 1.0, 1.0]
    assert partition_by_cost(costs, 2) == [range(0, 2), range(2, 4)]
    costs = [1.0, 1.0, 1.0, 3.0]
    assert partition_by_cost(costs, 2) == [range(0, 3), range(3, 4)]
    rng = random.Random(7)
    costs = [rng.uniform(1, 2) for _ in range(40)]
    assert partition_by_cost(costs, 6) == partition_by_cost(list(costs), 6)


def test_extras_and_speeds_shift_layers() -> None:
    costs = [1.0] * 12
    # A heavy LM head on the last stage pushes layers towards the front.
    parts = partition_by_cost(costs, 4, last_extra=3.0)
    assert [len(p) for p in parts] == [4, 4, 3, 1]
    assert stage_times(parts, costs, 0.0, 3.0) == [4.0, 4.0, 3.0, 4.0]
    # A twice-as-fast device gets twice the layers.
    parts = partition_by_cost(costs, 3, speeds=[1.0, 2.0, 1.0])
    assert [len(p) for p in parts] == [3, 6, 3]
    assert stage_times(parts, costs, speeds=[1.0, 2.0, 1.0]) == [3.0, 3.0, 3.0]


def test_partition_by_params() -> None:
    layers = [100] * 8
    parts = partition_by_params(layers, 4, embed_params=150, head_params=150)
    assert [len(p) for p in parts] == [1, 3, 3, 1]
    assert max(stage_times(parts, layers, 150, 150)) == 300
    assert partition_by_params(layers, 4) == partition_uniform(8, 4)
    # Single stage: embedding and head both land on it.
    assert stage_times(partition_by_params(layers, 1, embed_params=5, head_params=7), layers, 5, 7) == [812.0]


def test_large_input_is_fast_enough() -> None:
    rng = random.Random(0)
    costs = [rng.uniform(1, 3) for _ in range(200)]
    parts = partition_by_cost(costs, 16, first_extra=5.0, last_extra=20.0)
    check_contiguous(parts, 200, 16)


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: partition_uniform(3, 4), "cannot split 3 layers into 4 stages: each stage needs at least one layer"),
        (
            lambda: partition_by_cost([1.0, 1.0, 1.0], 4),
            "cannot split 3 layers into 4 stages: each stage needs at least one layer",
        ),
        (lambda: partition_uniform(0, 1), "n_layers must be a positive integer"),
        (lambda: partition_uniform(4, 0), "n_stages must be a positive integer"),
        (lambda: partition_by_cost([], 1), "layer_costs is empty"),
        (lambda: partition_by_cost([1.0, 0.0], 1), "layer_costs[1] must be a positive"),
        (lambda: partition_by_cost([1.0, -2.0], 1), "layer_costs[1] must be a positive"),
        (lambda: partition_by_cost([1.0, float("nan")], 1), "layer_costs[1] must be a positive"),
        (lambda: partition_by_cost([1.0, float("inf")], 1), "layer_costs[1] must be a positive"),
        (lambda: partition_by_cost([1.0] * 3, 2, speeds=[1.0]), "speeds has 1 entries"),
        (lambda: partition_by_cost([1.0] * 3, 2, speeds=[1.0, 0.0]), "speeds[1] must be a positive"),
        (lambda: partition_by_cost([1.0] * 3, 2, first_extra=-1.0), "first_extra must be"),
        (lambda: partition_by_cost([1.0] * 3, 2, last_extra=float("nan")), "last_extra must be"),
        (lambda: partition_by_params([10, 0], 1), "layer_params[1] must be a positive integer"),
        (lambda: partition_by_params([10, 2.5], 1), "layer_params[1] must be a positive integer"),
        (lambda: partition_by_params([10, 10], 1, embed_params=-1), "embed_params must be"),
        (lambda: stage_times([range(0, 2)], [1.0] * 3), "stages cover layers 0..1"),
        (lambda: stage_times([range(0, 1), range(2, 3)], [1.0] * 3), "stage 1 is range(2, 3)"),
        (lambda: stage_times([range(0, 3), range(3, 3)], [1.0] * 3), "stage 1 is range(3, 3)"),
    ],
)
def test_errors(call, fragment: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError) as info:
        call()
    assert fragment in str(info.value)
