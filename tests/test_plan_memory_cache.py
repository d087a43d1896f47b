"""The planner's fast memory path is exact: MemoryModel (caches, lower bound, replay shared with the planner)
answers as rank_memory does, and a pruned search over it ranks what a brute-force one over plain rank_memory
ranks (every layout simulated, every memory asked without caches or bounds)."""

from __future__ import annotations

import dataclasses

import pytest

from hybridpar.config import Config
from hybridpar.plan.memory_model import MemoryEstimate, MemoryModel, rank_memory
from hybridpar.plan.search import GIB, plan
from tests.test_plan_bound import HARDWARE, layouts, model

_PLAIN: dict[str, list[MemoryEstimate]] = {}


def plain(cfg: Config) -> list[MemoryEstimate]:
    """rank_memory(cfg), a fresh MemoryModel per call (no cache, bound or replay), remembered per configuration
    for this file's tests: a pure function of `cfg`, and the brute-force searches at world 4 ask it of layouts
    the first test asked it of (the GPU search's 806, all among the CPU search's 1,165; 622 of them among the
    first test's 1,410). The searches' answers are rank_memory's all the same."""
    key = repr(cfg)
    if key not in _PLAIN:
        _PLAIN[key] = rank_memory(cfg)
    return list(_PLAIN[key])  # estimates are frozen; the list is the caller's own


def test_memory_model_answers_as_rank_memory_and_bounds_from_below() -> None:
    base, h = model(n_layers=6, global_batch=16), HARDWARE["gpu"]
    cached = MemoryModel(validate_schedules=False)
    cfgs = [cfg for _, cfg in layouts(base, h, 4)]
    assert len(cfgs) > 100
    for cfg in cfgs:
        want = plain(cfg)
        assert cached(cfg) == want
        assert cached.lower_bound(cfg) <= max(e.total for e in want)


@pytest.mark.parametrize("name", ["gpu", "cpu"])
def test_fast_search_ranks_as_brute_force(name: str) -> None:
    base, h = model(n_layers=6, global_batch=16), HARDWARE[name]
    # The needs only place the device memory (a cached model: the test above shows it answers as rank_memory).
    cached = MemoryModel(validate_schedules=False)
    need = sorted(max(e.total for e in cached(c)) for _, c in layouts(base, h, 4))
    # Device memory between the smallest and the largest need: both the lower bound and the replay decide.
    h = dataclasses.replace(h, device_memory_gib=need[len(need) // 3] / GIB)
    fast = plan(base, h, rank_memory, world=4, top=6)
    brute = plan(base, h, plain, world=4, top=6, prune=False)  # plain: no MemoryModel of the search's own
    key = lambda p: [(c.label, c.prediction.step_s, c.memory, c.reason) for c in p.candidates]  # noqa: E731
    assert key(fast) == key(brute)
    assert fast.simulated < brute.simulated


def test_no_fit_names_the_same_smallest_as_brute_force() -> None:
    base, h = model(n_layers=6, global_batch=16), HARDWARE["gpu"]
    h = dataclasses.replace(h, device_memory_gib=1e-4)
    with pytest.raises(ValueError) as fast:
        plan(base, h, rank_memory, world=8)
    with pytest.raises(ValueError) as brute:
        plan(base, h, lambda c: rank_memory(c), world=8, prune=False)  # noqa: PLW0108
    assert str(fast.value) == str(brute.value) and str(fast.value).startswith("no layout fits")
