"""CPU binding of local ranks (topology/cpus.py): the shares as pure code, the binding in real processes."""

from __future__ import annotations

import os

import pytest

from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.topology.cpus import bind_local_rank, share_of, stage_major_position
from hybridpar.topology.spawn import run_ranks


def test_more_ranks_than_cores_round_robin():
    # Neighbouring ranks (pipeline stages that message each other) land on different cores.
    assert [share_of(r, 4, [0, 1]) for r in range(4)] == [[0], [1], [0], [1]]
    assert [share_of(r, 3, [4, 6]) for r in range(3)] == [[4], [6], [4]]


def test_fewer_ranks_than_cores_contiguous_shares():
    assert [share_of(r, 2, range(8)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # 7 cores among 3 ranks: 2 each, the seventh unused; cores are taken in sorted order.
    assert [share_of(r, 3, [6, 0, 5, 1, 4, 2, 3]) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert share_of(0, 1, [3, 9]) == [3, 9]


def test_shares_never_overlap_when_cores_suffice():
    for cores in range(1, 17):
        for world in range(1, cores + 1):
            shares = [set(share_of(r, world, range(cores))) for r in range(world)]
            assert all(shares), (cores, world)
            assert sum(len(s) for s in shares) == len(set().union(*shares)), (cores, world)


def test_stage_major_order_puts_the_ranks_of_a_stage_on_different_cores():
    def cores(dp: int, pp: int, tp: int, n: int = 2) -> list[int]:
        w = dp * pp * tp
        return [share_of(stage_major_position(r, r, w, dp, pp, tp), w, range(n))[0] for r in range(w)]

    # Ranks are (dp, pp, tp) with tp fastest. tp2 x dp2: tp partners apart (as rank order would too).
    assert cores(2, 1, 2) == [0, 1, 0, 1]
    # pp2 x dp2: the two replicas of a stage compute together, so apart; rank order (r % 2) would put
    # both replicas of each stage on one core.
    assert cores(2, 2, 1) == [0, 0, 1, 1]
    assert cores(1, 4, 1) == [0, 1, 0, 1]  # pipeline neighbours apart
    assert cores(1, 2, 2) == [0, 1, 0, 1]
    assert cores(2, 2, 2, n=4) == [0, 1, 0, 1, 2, 3, 2, 3]
    # dp2 x pp2 x tp2 on two nodes of 4 ranks (one replica each), and pp2 x tp2 on two nodes of 2.
    assert [stage_major_position(r, r % 4, 4, 2, 2, 2) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [stage_major_position(r, r % 2, 2, 1, 2, 2) for r in range(4)] == [0, 1, 0, 1]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="local rank 4 is outside 0..3"):
        share_of(4, 4, [0, 1])
    with pytest.raises(ValueError, match="no CPU core"):
        share_of(0, 1, [])
    with pytest.raises(ValueError, match=r"CPU binding must be one of \('none', 'cores'\), got 'numa'"):
        bind_local_rank("numa", 0, 1)
    with pytest.raises(ValueError, match=r"rank 5 as local rank 1 of 2 does not fit a world of dp=1 x pp=2 x tp=2 = 4"):
        stage_major_position(5, 1, 2, 1, 2, 2)


def _bound(mode: str, allowed: list[int], layout: list[int]) -> dict:
    import torch

    os.sched_setaffinity(0, allowed)  # the cores the launcher gave this process
    threads = bind_local_rank(mode, layout=tuple(layout))
    return {"cores": sorted(os.sched_getaffinity(0)), "threads": threads, "torch_threads": torch.get_num_threads()}


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
@pytest.mark.parametrize("mode", ["none", "cores"])
def test_binding_in_processes(mode):
    allowed = sorted(os.sched_getaffinity(0))
    world, layout = 4, (2, 2, 1)  # dp2 x pp2: ranks 0 and 2 are one stage's replicas
    got = run_ranks(_bound, world, mode, allowed, layout, timeout_s=60)
    for rank, g in enumerate(got):
        assert g["threads"] == g["torch_threads"]
        if mode == "cores":
            assert g["cores"] == share_of(stage_major_position(rank, rank, world, *layout), world, allowed)
            assert g["threads"] == len(g["cores"])
        else:
            assert g["cores"] == allowed
            assert g["threads"] == max(1, len(allowed) // world)


def test_config_names_the_bindings():
    from hybridpar.config import parse_args

    assert parse_args([]).parallel.cpu_bind == "none"
    assert parse_args(["--parallel.cpu_bind", "cores"]).parallel.cpu_bind == "cores"
    with pytest.raises((ValueError, SystemExit)) as e:
        validate_config(parse_args(["--parallel.cpu_bind", "numa"]), world_size=4)
    assert "cpu_bind" in str(e.value) and "cores" in str(e.value)
