"""The checks of `scripts/gpu_check.sh`, one subcommand each, each writing one JSON file; the script runs
each under a hard timeout and `summary` folds the files (and the script's exit codes) into one JSON.

    python -m hybridpar.bench.gpu_check env|equivalence|pipeline|mfu --out FILE [--dry-run] [--gpus N]
    python -m hybridpar.bench.gpu_check summary --dir DIR [--rc NAME=CODE ...] [--dry-run]

On a GPU machine: the equivalence subset on CUDA/NCCL against one-device training on the same GPU (every
GPU count: tp=pp=dp=1 in fp32 and bf16; two or more: also tp2, pp2 and dp2), the pipeline bench in
compute mode over NCCL (pp=2, two or more GPUs) and the MFU and tokens/s of a ~1B-parameter Llama in bf16
on one GPU. `--dry-run` runs the same code on CPU processes over gloo with tiny sizes, as if there were
`--gpus` (default 2) devices, so that everything but CUDA itself is exercised anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from hybridpar.bench import emit

TORCH_PIN = "2.13.0"
TORCH_FLOOR = (2, 6)  # pyproject.toml's torch>=2.6
CHECKS = ("env", "equivalence", "pipeline", "mfu")
# ~1B parameters (1.06e9): TinyLlama's width, depth and vocabulary at 18 layers, 16 full heads.
LLAMA_1B = dict(dim=2048, n_layers=18, n_heads=16, ffn_dim=5632, vocab_size=32000)
TINY_LLAMA = dict(dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=256)  # its --dry-run stand-in


def check_env(a: argparse.Namespace) -> dict:
    """What this machine has: torch's build, CUDA, the GPUs that torch and nvidia-smi see."""
    import torch

    cuda = torch.cuda.is_available()
    smi = shutil.which("nvidia-smi")
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout if smi else ""
    out = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "gpus_torch": torch.cuda.device_count() if cuda else 0,
        "gpus_nvidia_smi": sum(line.startswith("GPU ") for line in listed.splitlines()) if smi else None,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
    }
    version = torch.__version__.split("+")[0]
    # The pin is what CI tests; a GPU image with another torch (no network to install the pin) still runs
    # the checks, with the difference in the summary. Below the floor in pyproject.toml it cannot.
    warnings = [] if version == TORCH_PIN else [f"torch {torch.__version__}, not the tested {TORCH_PIN}"]
    too_old = tuple(int(x) for x in version.split(".")[:2]) < TORCH_FLOOR
    problems = [f"torch {torch.__version__} is older than {'.'.join(map(str, TORCH_FLOOR))}"] if too_old else []
    if not a.dry_run and not cuda:
        # torch==2.13.0's Linux x86-64 wheel on the default package index is the CUDA 13.0 build (it brings
        # cuda-toolkit 13.0 and NCCL 2.29 as packages; the NVIDIA driver must be 580 or newer); a CPU build
        # comes from a CPU-only index or find-links in pip's configuration.
        problems.append(
            f"torch {torch.__version__} sees no GPU (built for CUDA {torch.version.cuda}): install the CUDA "
            f"build (`.venv/bin/pip install --force-reinstall torch=={TORCH_PIN}` from the default index, "
            "driver >= 580)"
        )
    return {**out, "passed": not problems, "problems": problems, "warnings": warnings}


def _train_worker(cfg_dicts: list[dict], out_dir: str) -> list[list]:
    """One rank: train each config in its own run directory; rank 0 keeps the final parameters."""
    import torch

    from hybridpar.config import Config
    from hybridpar.run.train import train

    out = []
    for i, d in enumerate(cfg_dicts):
        cfg = Config.from_dict(d)
        cfg.run_dir = str(Path(out_dir) / f"run{i}")
        res = train(cfg, log=False)
        if res.state is not None:
            torch.save({n: p.cpu() for n, p in res.state.items()}, Path(out_dir) / f"state{i}.pt")
        out.append(res.losses)
    return out


def equivalence_layouts(gpus: int) -> list[tuple[int, int, int, str]]:
    """(tp, pp, dp, precision) of the subset that fits `gpus` devices."""
    return [(1, 1, 1, "fp32"), (1, 1, 1, "bf16")] + (
        [(2, 1, 1, "fp32"), (1, 2, 1, "fp32"), (1, 1, 2, "fp32")] if gpus >= 2 else []
    )


def check_equivalence(a: argparse.Namespace) -> dict:
    """Each layout's losses and parameters against the one-device reference on the same device: fp32 by
    DESIGN.md's criteria (loss within 1e-5, parameters by the fp64 criterion: `worst_fp64_margin` <= 1), bf16
    as tests/test_precision.py holds it (loss within 2^-9 relative of one-device bf16 training; parameters
    by the same criterion with one-device bf16 runs as the yardstick)."""
    import torch

    from hybridpar.model import reference as ref
    from hybridpar.topology.spawn import run_ranks

    device = "cpu" if a.dry_run else "cuda"
    backend = "gloo" if a.dry_run else "nccl"
    layouts = equivalence_layouts(a.gpus)
    base = ref.tiny_config(parallel=dict(backend=backend, timeout_s=60.0))
    bf16 = ref.tiny_config(parallel=dict(backend=backend, timeout_s=60.0), train=dict(precision="bf16"))
    refs = {p: ref.reference(c, device=device) for p, c in (("fp32", base), ("bf16", bf16))}
    sticks = {p: ref.yardstick(c, device) for p, c in (("fp32", base), ("bf16", bf16))}
    out_dir = Path(a.out).with_suffix("")
    results = []
    for world in sorted({tp * pp * dp for tp, pp, dp, _ in layouts}):
        group = [lay for lay in layouts if lay[0] * lay[1] * lay[2] == world]
        cfgs = [
            ref.tiny_config(
                parallel=dict(tp=tp, pp=pp, dp=dp, backend=backend, timeout_s=60.0), train=dict(precision=pr)
            )
            for tp, pp, dp, pr in group
        ]
        work = out_dir / f"world{world}"
        work.mkdir(parents=True, exist_ok=True)
        ranks = run_ranks(_train_worker, world, [c.to_dict() for c in cfgs], str(work), timeout_s=120)
        for i, ((tp, pp, dp, prec), cfg) in enumerate(zip(group, cfgs)):
            losses, (ref_losses, _, ref_state) = ranks[0][i], refs[prec]
            state = torch.load(work / f"state{i}.pt", weights_only=True)
            diffs = [abs(x - y) for x, y in zip(losses, ref_losses, strict=True)]
            margin = max(sticks[prec].margins(state).values())
            rec: dict[str, Any] = {
                "layout": f"tp{tp} pp{pp} dp{dp} {prec}",
                "max_loss_diff": max(diffs),
                "max_param_diff": max((state[n] - r).abs().max().item() for n, r in ref_state.items()),
                "worst_fp64_margin": margin,
            }
            if prec == "fp32":
                rec.update(loss_bound=ref.TOL, passed=max(diffs) <= ref.TOL and margin <= 1)
            else:
                loss_ok = all(d <= ref.U_BF16 * abs(y) for d, y in zip(diffs, ref_losses))
                rec.update(loss_bound=f"{ref.U_BF16:g} x |loss|", passed=loss_ok and margin <= 1)
            results.append(rec)
    return {"device": device, "backend": backend, "layouts": results, "passed": all(r["passed"] for r in results)}


def check_pipeline(a: argparse.Namespace) -> dict:
    """`hybridpar bench pipeline --mode compute` at pp=2, 1F1B: our runtime against torch's schedule."""
    from hybridpar.bench import pipeline

    if a.gpus < 2:
        return {"skipped": "pp=2 needs 2 GPUs (NCCL runs one rank per GPU)", "passed": True}
    args = ["--mode", "compute", "--pp", "2", "--schedules", "1f1b", "--json", a.out + ".records"]
    if a.dry_run:  # the default model cut to 2 layers and 16 tokens, one timed step
        args += ["--backend", "gloo", "--layers", "2", "--seq-len", "16", "--microbatches", "2", "--repeats", "1"]
        args += ["--steps", "1", "--warmup", "1", "--ping-pongs", "4"]
    else:
        args += ["--backend", "nccl", "--repeats", "3"]
    if pipeline.main(args) != 0:
        return {"passed": False, "error": f"hybridpar bench pipeline {' '.join(args)} failed"}
    rec = json.loads(Path(a.out + ".records").read_text())[0]
    keep = ("backend", "pp", "microbatches", "hybridpar_steps_per_s", "torch_steps_per_s", "ratio", "loss_rel_diff")
    return {**{k: rec[k] for k in keep}, "passed": bool(rec["loss_match"])}


def _mfu_worker(cfg_dict: dict, steps: int) -> dict:
    import torch

    from hybridpar.config import Config
    from hybridpar.report.step_records import StepRecords
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    topo = build_topology(1, 1, 1, cfg.parallel.backend, cfg.parallel.timeout_s)
    trainer = Trainer(cfg, topo)
    records = StepRecords(cfg, topo, 0, 0, torch.bfloat16)
    recs = [records.add(trainer.step(s)) for s in range(steps)]
    peak = recs[0]["device_peak"]
    memory = torch.cuda.max_memory_allocated(topo.device) if topo.device.type == "cuda" else None
    return {
        "recs": [{k: r[k] for k in ("step_time_s", "tokens_per_s", "mfu", "loss")} for r in recs],
        "peak": peak,
        "max_memory_allocated": memory,
    }


def check_mfu(a: argparse.Namespace) -> dict:
    """MFU and tokens/s of the ~1B Llama in bf16 on one GPU (tp=pp=dp=1), median over the steps after two
    warm-up steps; the peak is the data sheet's for a listed GPU, else a measured matmul peak."""
    import torch

    from hybridpar.config import Config
    from hybridpar.model.registry import empty_stage
    from hybridpar.topology.spawn import run_ranks

    cfg = Config()
    for k, v in (TINY_LLAMA if a.dry_run else LLAMA_1B).items():
        setattr(cfg.model, k, v)
    cfg.parallel.tp = cfg.parallel.pp = 1
    cfg.parallel.backend = "gloo" if a.dry_run else "nccl"
    t = cfg.train
    t.precision, t.seq_len, t.global_batch, t.microbatches = "bf16", (64 if a.dry_run else 2048), 8, 4
    t.val_every, t.sample_tokens, t.recompute = 0, 0, a.recompute
    cfg.run_dir = str(Path(a.out).with_suffix(""))
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    steps = 4 if a.dry_run else 10
    res = run_ranks(_mfu_worker, 1, cfg.to_dict(), steps, timeout_s=600)[0]
    timed = res["recs"][2:]
    whole = empty_stage(cfg.model, range(cfg.model.n_layers), True, True, torch.device("meta"))
    params = sum(p.numel() for p in whole.parameters())
    mfu = statistics.median(r["mfu"] for r in timed)
    return {
        "model": {**(TINY_LLAMA if a.dry_run else LLAMA_1B), "params": params},
        "seq_len": t.seq_len,
        "global_batch": t.global_batch,
        "microbatches": t.microbatches,
        "recompute": t.recompute,
        "steps_timed": len(timed),
        "mfu": mfu,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "losses": [r["loss"] for r in res["recs"]],
        "peak": res["peak"],
        "max_memory_allocated": res["max_memory_allocated"],
        # Above 1 on a GPU would be a FLOP count or peak gone wrong; on CPU (--dry-run) the measured bf16
        # peak of one square matmul size says little about a tiny model's matmuls, so only > 0 is asked.
        "passed": 0 < mfu and (a.dry_run or mfu <= 1) and all(math.isfinite(r["loss"]) for r in res["recs"]),
    }


def summary(a: argparse.Namespace) -> dict:
    """One JSON: every check's file, or why it has none (the script's exit code: 124 is its timeout)."""
    codes = dict(kv.split("=", 1) for kv in a.rc)
    checks: dict[str, Any] = {}
    for name in CHECKS:
        path = Path(a.dir) / f"{name}.json"
        if path.is_file():
            checks[name] = json.loads(path.read_text())
        else:
            rc = codes.get(name)
            why = "not run" if rc is None else ("timed out" if rc == "124" else f"exited with code {rc}")
            log = Path(a.dir) / f"{name}.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.is_file() else []
            checks[name] = {"passed": False, "error": why, "log_tail": tail}
    if "setup" in codes:  # the script's own step: its exit code is its result
        checks = {"setup": {"passed": codes["setup"] == "0", "exit_code": int(codes["setup"])}, **checks}
    return {"dry_run": a.dry_run, "checks": checks, "passed": all(c["passed"] for c in checks.values())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridpar.bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("check", choices=(*CHECKS, "summary"))
    ap.add_argument("--out", help="the check's JSON file")
    ap.add_argument("--dir", help="summary: the folder of the checks' files")
    ap.add_argument("--rc", action="append", default=[], help="summary: NAME=EXIT_CODE of a check, from the script")
    ap.add_argument("--dry-run", action="store_true", help="CPU processes over gloo, tiny sizes")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (default: torch's count; --dry-run: 2)")
    ap.add_argument("--recompute", default="none", help="mfu: train.recompute of the ~1B run (none|full|selective)")
    a = ap.parse_args(argv)
    if (a.check == "summary") != (a.dir is not None) or (a.check != "summary" and not a.out):
        ap.error("summary takes --dir DIR; every check takes --out FILE")
    if a.gpus is None:
        import torch

        a.gpus = 2 if a.dry_run else torch.cuda.device_count()
    if a.check == "summary":
        print(json.dumps(summary(a), indent=1))
        return 0
    result = {"env": check_env, "equivalence": check_equivalence, "pipeline": check_pipeline, "mfu": check_mfu}[
        a.check
    ](a)
    emit(result, a.out, echo=False)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
