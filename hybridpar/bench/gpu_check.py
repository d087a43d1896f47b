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
from typing import Any, Callable

from hybridpar.bench import emit
from hybridpar.bench.gpu_predict import prediction, probe, said

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
    if a.dry_run:
        # The references on CPU, of a tiny model: one intra-op thread, as each rank runs (topology/spawn.py);
        # on shared cores a second one only makes its small ops wait.
        torch.set_num_threads(1)
    layouts = equivalence_layouts(a.gpus)
    base = ref.tiny_config(parallel=dict(backend=backend, timeout_s=60.0))
    bf16 = ref.tiny_config(parallel=dict(backend=backend, timeout_s=60.0), train=dict(precision="bf16"))
    runs: dict[str, ref.Result] = {}

    def run(cfg: Any, dtype: torch.dtype = torch.float32, accumulate: int = 1, order: int | None = None) -> ref.Result:
        # Each reference training once: a yardstick's first order is the reference itself, and fp32's and
        # bf16's yardsticks share their fp64 run.
        key = repr((cfg.to_dict(), dtype, accumulate, order))
        if key not in runs:
            runs[key] = ref.reference(cfg, dtype, accumulate, device, order)
        return runs[key]

    refs = {p: run(c) for p, c in (("fp32", base), ("bf16", bf16))}
    sticks = {p: ref.yardstick(c, device, runs=run) for p, c in (("fp32", base), ("bf16", bf16))}
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


# The options table of the mfu check: each option is tokens joined by "+", each token one setting of the run
# (eager = the defaults: autocast, AdamW fused on CUDA, no compile).
MFU_TOKENS: dict[str, dict[str, Any]] = {
    "eager": {},
    "compile": {"compile": True},
    "copies": {"bf16_weights": "copies"},
    "unfused": {"fused_adamw": "off"},
}
# In the order that keeps the most where time runs short: the cheap eager rows first (eager itself: the loss
# curves' reference and the prediction's measured step), then the compiled ones, the likely best first; the
# one-microbatch row last, where inductor's caches from compile+copies (same graphs) make its compile short.
MFU_OPTIONS = "eager,copies,unfused,compile+copies,compile,compile+copies+m1"
MFU_OPTIONS_DRY = "eager,copies"  # --dry-run: the cheap ones (a CPU compile costs tens of seconds)


def mfu_option(name: str) -> dict[str, Any]:
    """train overrides of an option name such as "compile+copies+m1" (mN: N microbatches of the step's 8
    sequences); a bad token is named with the ones that exist."""
    out: dict[str, Any] = {}
    for tok in name.split("+"):
        if tok in MFU_TOKENS:
            out.update(MFU_TOKENS[tok])
        elif tok[:1] == "m" and tok[1:].isdigit() and int(tok[1:]) in (1, 2, 4, 8):
            out["microbatches"] = int(tok[1:])
        else:
            raise ValueError(f"mfu option {name!r}: unknown part {tok!r} (parts: {', '.join(MFU_TOKENS)}, m1|m2|m4|m8)")
    return out


def _mfu_worker(cfg_dict: dict, steps: int) -> dict:
    import time

    import torch

    from hybridpar.config import Config
    from hybridpar.model.kvcache import attention_kernel
    from hybridpar.report.step_records import StepRecords
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    topo = build_topology(1, 1, 1, cfg.parallel.backend, cfg.parallel.timeout_s)
    trainer = Trainer(cfg, topo)
    records = StepRecords(cfg, topo, 0, 0, torch.bfloat16)
    t0 = time.perf_counter()
    recs = [records.add(trainer.step(0))]
    first_s = time.perf_counter() - t0  # compilation, under train.compile
    recs += [records.add(trainer.step(s)) for s in range(1, steps)]
    m = cfg.model
    memory = torch.cuda.max_memory_allocated(topo.device) if topo.device.type == "cuda" else None
    return {
        "recs": [{k: r[k] for k in ("step_time_s", "tokens_per_s", "mfu", "loss")} for r in recs],
        "peak": recs[0]["device_peak"],
        "first_step_s": first_s,
        "attention_kernel": attention_kernel(m.n_heads, cfg.train.seq_len, m.head_dim, topo.device, torch.bfloat16),
        "max_memory_allocated": memory,
        # under train.compile: graphs compiled over the run (a recompile after the first step shows here)
        "compiled": None if trainer.mp.compiled is None else trainer.mp.compiled.summary(),
    }


def mfu_config(a: argparse.Namespace, option: str) -> Any:
    """The Config of one option's run of the mfu check."""
    from hybridpar.config import Config

    cfg = Config()
    for k, v in (TINY_LLAMA if a.dry_run else LLAMA_1B).items():
        setattr(cfg.model, k, v)
    cfg.parallel.tp = cfg.parallel.pp = 1
    cfg.parallel.backend = "gloo" if a.dry_run else "nccl"
    t = cfg.train
    t.precision, t.seq_len, t.global_batch, t.microbatches = "bf16", (64 if a.dry_run else 2048), 8, 4
    t.val_every, t.sample_tokens, t.recompute = 0, 0, a.recompute
    for k, v in mfu_option(option).items():
        setattr(t, k, v)
    cfg.run_dir = str(Path(a.out).with_suffix("") / option)
    return cfg


def _mfu_run(a: argparse.Namespace, option: str, steps: int, timeout_s: float) -> dict:
    """One option's run in a process of its own (a compiled run's caches and memory do not reach the next),
    killed after `timeout_s` (then a TimeoutError)."""
    from hybridpar.topology.spawn import run_ranks

    cfg = mfu_config(a, option)
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    res = run_ranks(_mfu_worker, 1, cfg.to_dict(), steps, timeout_s=timeout_s)[0]
    timed = res["recs"][2:]
    return {
        "option": option,
        "train": mfu_option(option),
        "mfu": statistics.median(r["mfu"] for r in timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "first_step_s": res["first_step_s"],
        "losses": [r["loss"] for r in res["recs"]],
        "attention_kernel": res["attention_kernel"],
        "peak": res["peak"],
        "max_memory_allocated": res["max_memory_allocated"],
        "compiled": res["compiled"],
    }


# Seconds one option's run may take at most, and needs at least to be worth starting (H100 estimates in
# docs/gpu.md: an eager run 20-30 s with its process, CUDA and the 1B model's set-up; a compiled one 60-110 s,
# most of it inductor's first compile); --dry-run multiplies them by DRY_FACTOR (CPU, a shared machine).
MFU_BUDGET_S = 400.0  # scripts/gpu_check.sh kills the step at 420 s: the check ends and writes its file first
OPTION_LIMIT_S = {"eager": 120.0, "compile": 240.0}
OPTION_FLOOR_S = {"eager": 20.0, "compile": 60.0}
DRY_FACTOR = 4


def _option_timeout(a: argparse.Namespace, option: str, left_s: float) -> tuple[float | None, str]:
    """(the option's timeout, "") within the `left_s` seconds of the check's budget, or (None, why not)."""
    kind = "compile" if "compile" in option.split("+") else "eager"
    scale = DRY_FACTOR if a.dry_run else 1
    limit, floor = OPTION_LIMIT_S[kind] * scale, OPTION_FLOOR_S[kind] * scale
    if left_s < floor:
        return None, f"not run: {left_s:.0f} s of --budget-s {a.budget_s:g} left, under the {floor:g} s it needs"
    return min(limit, left_s), ""


def _fold(res: dict, dry_run: bool) -> None:
    """The table's figures so far: each row's loss curve against the first option's, the best row, and
    whether every row ran with plausible figures."""
    table = res["options"]
    ran = [r for r in table if "mfu" in r]
    base = next((r for r in ran if r["option"] == res["planned"][0]), None)
    for r in ran:
        if base is not None:  # bf16 runs of the same model: how far each option's loss curve is from the first's
            r["loss_max_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], base["losses"]))
    best = max(ran, key=lambda r: r["mfu"], default=None)
    res.update(
        best=None if best is None else best["option"],
        mfu=None if best is None else best["mfu"],
        tokens_per_s=None if best is None else best["tokens_per_s"],
    )
    # Above 1 on a GPU would be a FLOP count or peak gone wrong; on CPU (--dry-run) the measured bf16 peak of
    # one square matmul size says little about a tiny model's matmuls, so only > 0 is asked.
    ok = [0 < r["mfu"] and (dry_run or r["mfu"] <= 1) and all(math.isfinite(x) for x in r["losses"]) for r in ran]
    every = len(ran) == len(res["planned"])
    res["passed"] = res["complete"] and every and all(ok) and "error" not in res["probe"]


def check_mfu(a: argparse.Namespace, clock: Callable[[], float] | None = None) -> dict:
    """MFU and tokens/s of the ~1B Llama in bf16 on one GPU (tp=pp=dp=1) under each option of `--options`
    (the first, eager by default, is the one the others' losses are compared with), median over the steps
    after two warm-up steps; the peak is the data sheet's for a listed GPU, else a measured matmul peak.
    First the GPU probe (bench/gpu_predict.py): the calibration measured on the device, and the planner's
    prediction of the eager step with it, beside the eager step once that row has run. Everything is written
    to `--out` as soon as it exists (`complete` false until the end), so a kill at any point keeps what
    finished. Each option runs under a timeout within what is left of `--budget-s`; one the configuration
    refuses, whose run fails or times out, or for which no time is left, is reported as such and fails the
    check while the others still run. `clock`: seconds, monotonic (a test's stand-in)."""
    import time

    from hybridpar.config import ModelConfig
    from hybridpar.model.registry import param_counts

    clock = clock or time.monotonic
    t0 = clock()
    options = (a.options or (MFU_OPTIONS_DRY if a.dry_run else MFU_OPTIONS)).split(",")
    for o in options:
        mfu_option(o)  # every name checked before the first run
    steps = 4 if a.dry_run else 10
    cfg_model = {**(TINY_LLAMA if a.dry_run else LLAMA_1B)}
    counts = param_counts(ModelConfig(**cfg_model))  # one layer's shapes: building all 18 took 1.7 s here
    res: dict[str, Any] = {
        "model": {**cfg_model, "params": counts.embed + cfg_model["n_layers"] * counts.layer + counts.head},
        "seq_len": 64 if a.dry_run else 2048,
        "global_batch": 8,
        "recompute": a.recompute,
        "steps_timed": steps - 2,
        "budget_s": a.budget_s,
        "planned": options,
        "options": [],
        "probe": {"error": "stopped during the probe"},
        "complete": False,
    }

    def save() -> None:
        _fold(res, a.dry_run)
        emit(res, a.out, echo=False)

    save()
    try:
        res["probe"] = probe(a)
    except Exception as e:  # CUDA itself failing (the device's name unreadable): said; the options still run
        res["probe"] = {"error": said(e)}
    print(f"gpu_check mfu: probe: {res['probe'].get('probe_s', res['probe'])}", file=sys.stderr, flush=True)
    res["probe"].update(prediction(a, res["probe"], None, mfu_config))
    save()
    for o in options:
        timeout, why = _option_timeout(a, o, a.budget_s - (clock() - t0))
        try:
            row = {"option": o, "error": why} if timeout is None else _mfu_run(a, o, steps, timeout)
        except Exception as e:  # one option's failure is its row; the others still run
            row = {"option": o, "error": said(e)}
        res["options"].append(row)
        told = f"MFU {row['mfu']:.3f}, {row['tokens_per_s']:.0f} tokens/s" if "mfu" in row else row["error"]
        print(f"gpu_check mfu: {o}: {told} ({clock() - t0:.0f} s into the check)", file=sys.stderr, flush=True)
        if o == "eager":
            res["probe"].update(prediction(a, res["probe"], row, mfu_config))
        save()
    res["complete"] = True
    save()
    return res


def summary(a: argparse.Namespace) -> dict:
    """One JSON: every check's file, or why it has none (the script's exit code: 124 is its timeout)."""
    codes = dict(kv.split("=", 1) for kv in a.rc)
    checks: dict[str, Any] = {}
    wanted = set(a.checks.split(",")) if a.checks else set(CHECKS)
    for name in (c for c in CHECKS if c in wanted):
        path = Path(a.dir) / f"{name}.json"
        rc = codes.get(name)
        why = "not run" if rc is None else ("timed out" if rc == "124" else f"exited with code {rc}")
        if path.is_file():
            checks[name] = json.loads(path.read_text())
            if checks[name].get("complete") is False:  # the mfu check's file as it stood when it was stopped
                checks[name].update(passed=False, error=f"{why}: the figures that finished before")
        else:
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
    ap.add_argument("--checks", default=None, help="summary: the checks the script ran (default: every one)")
    ap.add_argument("--rc", action="append", default=[], help="summary: NAME=EXIT_CODE of a check, from the script")
    ap.add_argument("--dry-run", action="store_true", help="CPU processes over gloo, tiny sizes")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (default: torch's count; --dry-run: 2)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"mfu: seconds for the whole check, options' runs included (default {MFU_BUDGET_S:g}; --dry-run: "
        f"{DRY_FACTOR}x): the script's timeout for the step is {MFU_BUDGET_S + 20:g}",
    )
    ap.add_argument("--recompute", default="none", help="mfu: train.recompute of the ~1B run (none|full|selective)")
    ap.add_argument(
        "--options",
        default=None,
        help=f"mfu: the options table, comma-separated (default {MFU_OPTIONS}; --dry-run: {MFU_OPTIONS_DRY})",
    )
    a = ap.parse_args(argv)
    if (a.check == "summary") != (a.dir is not None) or (a.check != "summary" and not a.out):
        ap.error("summary takes --dir DIR; every check takes --out FILE")
    if a.budget_s is None:
        a.budget_s = MFU_BUDGET_S * (DRY_FACTOR if a.dry_run else 1)
    if a.gpus is None and a.check != "summary":
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
