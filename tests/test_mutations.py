"""The parameter criterion catches real defects (issue 33): each mutation injects one error a parallel
trainer could make, through a test-only patch in the ranks, and the trained parameters must fail
DESIGN.md's criterion (tests/test_equivalence.py: check_fp64) on every layout the error applies to. A
criterion loose enough to pass any of these would pass a broken trainer."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import pytest
import torch

from hybridpar.config import Config
from hybridpar.topology.spawn import run_ranks
from tests.references import yardstick_for
from tests.test_equivalence import _worker, grid_config

pytestmark = pytest.mark.multiprocess


@contextlib.contextmanager
def mutation(name: str) -> Iterator[None]:
    """One injected defect, active inside the block (in a rank process)."""
    from unittest import mock

    from hybridpar.dataparallel.grads import DataParallelGrads
    from hybridpar.model import tp
    from hybridpar.pipeline.runtime import PipelineRuntime
    from hybridpar.trainer import step as trainer_step

    build = trainer_step.build_optimizer

    def optimizer_with(change):  # build_optimizer, then `change(opt, topo, cfg)` on the result
        return mock.patch.object(
            trainer_step, "build_optimizer", lambda cfg, topo, *a, **k: change(build(cfg, topo, *a, **k), topo, cfg)
        )

    if name == "tp-gradient-term-dropped":  # the input gradient keeps only this shard's partial sum
        patch = mock.patch.object(tp._CopyToTP, "backward", staticmethod(lambda ctx, g: (g, None)))
    elif name == "microbatch-counted-twice":  # the first microbatch's loss (and gradient) doubled
        forward = PipelineRuntime._forward_compute

        def twice(self, st, s, m, x, buf):
            if m != 0 or not st.train:
                return forward(self, st, s, m, x, buf)
            st.loss_scale *= 2
            try:
                return forward(self, st, s, m, x, buf)
            finally:
                st.loss_scale /= 2

        patch = mock.patch.object(PipelineRuntime, "_forward_compute", twice)
    elif name == "weight-decay-skipped-on-one-stage":  # the last pipeline rank's AdamW without decay

        def no_decay(opt, topo, cfg):
            if topo.pp_rank == cfg.parallel.pp - 1:
                for g in opt.param_groups:
                    g["weight_decay"] = 0.0
            return opt

        patch = optimizer_with(no_decay)
    elif name == "replica-averaged-with-wrong-count":  # replica 0 divides its gradient by dp before the sum
        launch = DataParallelGrads._launch

        def averaged(self, key):
            if self.topo.dp_rank == 0:
                for p in self._buckets[key[0]][key[1]]:
                    p.grad.div_(self.topo.dims.dp)
            return launch(self, key)

        patch = mock.patch.object(DataParallelGrads, "_launch", averaged)
    elif name == "stage-steps-twice":  # the first pipeline rank's optimizer steps twice per step

        def twice_stepped(opt, topo, cfg):
            if topo.pp_rank == 0:
                one = opt.step
                opt.step = lambda *a, **k: (one(*a, **k), one(*a, **k))[0]
            return opt

        patch = optimizer_with(twice_stepped)
    else:
        raise ValueError(f"unknown mutation {name!r}")
    with patch:
        yield


def _mutant_worker(cfg_dicts: list[dict], out_dir: str, names: list[str]) -> list:
    out = []
    for i, (d, name) in enumerate(zip(cfg_dicts, names)):
        with mutation(name):
            out += _worker([d], out_dir, i)
    return out


def applies(name: str, tp: int, pp: int, dp: int) -> bool:
    return {"tp-gradient-term-dropped": tp > 1, "replica-averaged-with-wrong-count": dp > 1}.get(name, True)


MUTATIONS = [
    "tp-gradient-term-dropped",
    "microbatch-counted-twice",
    "weight-decay-skipped-on-one-stage",
    "replica-averaged-with-wrong-count",
    "stage-steps-twice",
]
LAYOUTS = [(2, 2, 1), (1, 2, 2), (2, 1, 2)]
CASES = [(name, lay) for name in MUTATIONS for lay in LAYOUTS if applies(name, *lay)]


@pytest.fixture(scope="module")
def mutants(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Config]]:
    """Every applicable (mutation, layout) trained in one 4-rank launch; states in out/state{i}.pt."""
    out = tmp_path_factory.mktemp("mutants")
    cfgs = [grid_config(pp, "1f1b", 1, parallel=dict(tp=tp, pp=pp, dp=dp)) for _, (tp, pp, dp) in CASES]
    run_ranks(_mutant_worker, 4, [c.to_dict() for c in cfgs], str(out), [n for n, _ in CASES], timeout_s=400)
    return out, cfgs


@pytest.mark.parametrize("name", MUTATIONS)
def test_each_mutation_fails_the_parameter_criterion_on_every_layout_it_applies_to(name: str, mutants) -> None:
    out, cfgs = mutants
    for i, (n, lay) in enumerate(CASES):
        if n != name:
            continue
        stick = yardstick_for(cfgs[i])
        state = torch.load(out / f"state{i}.pt", weights_only=True)
        worst, failed = max(stick.margins(state).values()), len(stick.failures(state))
        label = f"{name} at tp{lay[0]} pp{lay[1]} dp{lay[2]}"
        print(f"{label}: worst margin {worst:.3g}, {failed} of {2 * len(state)} comparisons failed")  # shown by -s
        assert failed, f"{label} passed the parameter criterion (worst margin {worst:.3g})"
