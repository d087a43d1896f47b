"""Context parallelism (parallel.cp) trains the same model as one device: every axis it composes with
once — cp2 × tp2, cp2 × pp2 (1F1B), cp2 × dp2 ZeRO-2 with GPT-2 (learned positions), cp2 × tp2 with
sequence parallelism with both families — whole runs at cp4 with both families, and a run that resumes
across cp sizes, cp2 × tp2 → cp1 (dp2 × tp2) → cp4, all in one launch of 4 ranks; and cp2 × pp2 × dp2 with
both families and cp2 × tp2 × pp2 with sequence parallelism (Llama) in one launch of 8. The layouts at cp ≥ 2
without tp train a 2-layer model at seq_len 256 (chunks of 32 to 64 tokens: the ring's blocks are real
matrices, not a token or two); the others the equivalence tests' tiny model (whose single-device and
fp64 references those tests share; the file sorts after theirs so that a suite run computes them once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridpar.config import Config
from hybridpar.model.reference import TOL, gpt2_config, tiny_config
from hybridpar.topology.spawn import run_ranks
from tests.references import check_fp64, computing, ref_for
from tests.test_equivalence import check_results

pytestmark = pytest.mark.multiprocess

# Resumed runs: (layout, the run and step whose checkpoint they start from). run0 is cp2 x tp2; the last
# leg is the cp4 case (a step and a validation at chunks of 2 tokens, its final parameters checked).
RESUMED = [(dict(dp=2, tp=2), ("run0", 1)), (dict(cp=4), ("resumed0", 2))]


def _layout(cfg: Config, **axes: int) -> Config:
    for k in ("tp", "pp", "dp", "cp"):
        setattr(cfg.parallel, k, axes.get(k, 1))
    return cfg


def _long(family: str, **axes: int) -> Config:
    """A 2-layer, 16-wide model at seq_len 256, 2 steps of 6 samples (the fewest the fp64 criterion's
    single-process orders split into): cheap references for the layouts that need long sequences."""
    cfg = tiny_config() if family == "llama" else gpt2_config()
    m, t = cfg.model, cfg.train
    m.n_layers, m.dim, m.ffn_dim, m.n_heads = 2, 16, 32, 2
    if family == "llama":
        m.n_kv_heads = 1  # GQA: one kv head travels the ring for two query heads
    else:
        m.n_positions = 256
    t.seq_len, t.steps, t.global_batch, t.microbatches = 256, 2, 6, 2
    return _layout(cfg, **axes)


def _configs() -> list[Config]:
    first = _layout(tiny_config(), cp=2, tp=2)
    first.checkpoint.every, first.checkpoint.keep = 1, 3  # the start of the resumed runs
    gpt2 = _long("gpt2", dp=2, cp=2)
    gpt2.parallel.zero = 2  # ZeRO's slices are cut over dp: the gradients are summed over cp first
    return [first, _long("llama", cp=2, pp=2), gpt2, _long("llama", cp=4), _long("gpt2", cp=4), *_with_sp(tp=2)]


def _with_sp(**axes: int) -> list[Config]:
    """cp2 with sequence parallelism over tp, Llama and GPT-2 (the tiny model: seq_len 16, so each cp rank's
    8 tokens are 4 per tp rank in the norm and residual regions; GPT-2 looks up those 4 tokens' positions)."""
    cfgs = [_layout(tiny_config(), cp=2, **axes), _layout(gpt2_config(), cp=2, **axes)]
    for cfg in cfgs:
        cfg.parallel.sequence_parallel = True
    return cfgs


def _configs8() -> list[Config]:
    # cp2 x tp2 x pp2 with sequence parallelism: the pipeline's messages carry the (cp, tp)-local slice
    return [_long(family, cp=2, pp=2, dp=2) for family in ("llama", "gpt2")] + _with_sp(tp=2, pp=2)[:1]


def _resumed_configs(out: str) -> list[Config]:
    cfgs = []
    for axes, (run, step) in RESUMED:
        cfg = _layout(tiny_config(checkpoint=dict(every=1 if run == "run0" else 0, keep=3)), **axes)
        cfg.checkpoint.resume = f"{out}/{run}/checkpoints/step-{step:06d}"
        cfgs.append(cfg)
    return cfgs


def _worker(cfg_dicts: list[dict], out: str, resume: bool = True) -> list:
    from hybridpar.run.train import train

    results = []
    resumed = _resumed_configs(out) if resume else []
    for name, d in [(f"run{i}", d) for i, d in enumerate(cfg_dicts)] + [
        (f"resumed{i}", c.to_dict()) for i, c in enumerate(resumed)
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
    with computing(cfgs):  # the references, while the ranks run
        results = run_ranks(_worker, 4, [c.to_dict() for c in cfgs], str(tmp_path), timeout_s=400)[0]
    check_results(cfgs, [r[:2] for r in results[: len(cfgs)]], tmp_path)
    ref_losses = ref_for(tiny_config())[0]
    for (axes, (_, step)), (losses, _, start) in zip(RESUMED, results[len(cfgs) :]):
        assert start == step and len(losses) == len(ref_losses) - start, f"{axes}: steps {start}.. {losses}"
        for s, (a, b) in enumerate(zip(losses, ref_losses[start:]), start=start):
            assert abs(a - b) <= TOL, f"resumed at {axes}: step {s} loss {a} vs single device {b}"
    state = torch.load(tmp_path / "resumed1.pt", weights_only=True)
    check_fp64("cp2 x tp2 -> cp1 (dp2 x tp2) -> cp4", state, tiny_config())


def test_context_parallel_with_pipeline_and_data_parallel_at_world_8_equals_one_device(tmp_path: Path) -> None:
    cfgs = _configs8()
    with computing(cfgs):  # the references, while the ranks run
        results = run_ranks(_worker, 8, [c.to_dict() for c in cfgs], str(tmp_path), False, timeout_s=400)[0]
    check_results(cfgs, [r[:2] for r in results], tmp_path)
