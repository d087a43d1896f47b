"""Context parallelism (parallel.cp) trains the same model as one device: every axis it composes with
once — cp2 × tp2, cp2 × pp2 (1F1B), cp2 × dp2 ZeRO-2 with GPT-2 (learned positions) — and a run that
resumes across cp sizes, cp2 × tp2 → cp1 (dp2 × tp2) → cp4, all in one launch of 4 ranks on the
equivalence tests' tiny model (whose single-device and fp64 references those tests share; the file
sorts after theirs so that a suite run computes them once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridpar.config import Config
from hybridpar.model.reference import TOL, gpt2_config, tiny_config
from hybridpar.topology.spawn import run_ranks
from tests.test_equivalence import check_fp64, check_results, ref_for

pytestmark = pytest.mark.multiprocess

# Resumed runs: (layout, the run and step whose checkpoint they start from). run0 is cp2 x tp2; the last
# leg is the cp4 case (a step and a validation at chunks of 2 tokens, its final parameters checked).
RESUMED = [(dict(dp=2, tp=2), ("run0", 1)), (dict(cp=4), ("resumed0", 2))]


def _layout(cfg: Config, **axes: int) -> Config:
    for k in ("tp", "pp", "dp", "cp"):
        setattr(cfg.parallel, k, axes.get(k, 1))
    return cfg


def _configs() -> list[Config]:
    cfgs = [_layout(tiny_config(), **a) for a in (dict(cp=2, tp=2), dict(cp=2, pp=2))]
    cfgs[0].checkpoint.every, cfgs[0].checkpoint.keep = 1, 3  # the start of the resumed runs
    gpt2 = _layout(gpt2_config(), dp=2, cp=2)
    gpt2.parallel.zero = 2  # ZeRO's slices are cut over dp: the gradients are summed over cp first
    return cfgs + [gpt2]


def _resumed_configs(out: str) -> list[Config]:
    cfgs = []
    for axes, (run, step) in RESUMED:
        cfg = _layout(tiny_config(checkpoint=dict(every=1 if run == "run0" else 0, keep=3)), **axes)
        cfg.checkpoint.resume = f"{out}/{run}/checkpoints/step-{step:06d}"
        cfgs.append(cfg)
    return cfgs


def _worker(cfg_dicts: list[dict], out: str) -> list:
    from hybridpar.run.train import train

    results = []
    for name, d in [(f"run{i}", d) for i, d in enumerate(cfg_dicts)] + [
        (f"resumed{i}", c.to_dict()) for i, c in enumerate(_resumed_configs(out))
    ]:
        cfg = Config.from_dict(d)
        cfg.run_dir = f"{out}/{name}"
        res = train(cfg, log=False)
        if res.state is not None:
            torch.save(res.state, Path(out) / f"{name.replace('run', 'state')}.pt")
        results.append((res.losses, res.val_losses, res.start_step))
    return results


def test_context_parallel_layouts_and_resume_across_cp_equal_one_device(tmp_path: Path) -> None:
    cfgs = _configs()
    results = run_ranks(_worker, 4, [c.to_dict() for c in cfgs], str(tmp_path), timeout_s=400)[0]
    check_results(cfgs, [r[:2] for r in results[: len(cfgs)]], tmp_path)
    ref_losses = ref_for(tiny_config())[0]
    for (axes, (_, step)), (losses, _, start) in zip(RESUMED, results[len(cfgs) :]):
        assert start == step and len(losses) == len(ref_losses) - start, f"{axes}: steps {start}.. {losses}"
        for s, (a, b) in enumerate(zip(losses, ref_losses[start:]), start=start):
            assert abs(a - b) <= TOL, f"resumed at {axes}: step {s} loss {a} vs single device {b}"
    state = torch.load(tmp_path / "resumed1.pt", weights_only=True)
    check_fp64("cp2 x tp2 -> cp1 (dp2 x tp2) -> cp4", state, tiny_config())
