"""`hybridpar plan`: the fastest layouts of a model on a hardware description (or on this machine, probed).

    hybridpar plan [--config FILE] [--model.* V ...] [--train.* V ...] (--hardware FILE | --probe [--out FILE])
                   [--world N] [--global-batch N] [--top 10] [--json FILE]
    hybridpar plan --probe --hardware DATASHEET.toml [--out FILE] ...   (on a CUDA host: the GPU calibration)

`--probe` alone measures this CPU host (plan/probe.py); with `--hardware` a GPU datasheet file, it measures this
host's CUDA GPUs against that file's peaks and writes the file back with a measured [gpu_calibration]
(plan/gpu_probe.py).

Prints a table, fastest first: predicted step time, tokens/s, MFU, memory per rank, bubble and why.
Exit code 2 and one line when the request cannot be met (no layout fits, the world cannot be split).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hybridpar.config import Config, parse_args
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.plan.hardware import Hardware, load_hardware, to_toml
from hybridpar.plan.search import GIB, Memory, Plan, plan


def default_memory() -> Memory:
    try:
        from hybridpar.plan.memory_model import rank_memory
    except ImportError as e:  # a partial installation: say so in one line
        raise ValueError(f"the memory model hybridpar/plan/memory_model.py cannot be imported: {e}") from None
    return rank_memory


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybridpar plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", help="hardware description (TOML; docs/hardware/ has examples)")
    ap.add_argument(
        "--probe",
        action="store_true",
        help="measure this machine instead (plan/probe.py); with --hardware DATASHEET.toml on a CUDA host, measure "
        "its GPUs' calibration against that file's peaks (plan/gpu_probe.py)",
    )
    ap.add_argument("--out", help="with --probe: also write the measured hardware file here")
    ap.add_argument("--world", type=int, help="devices to plan for (default: all of the hardware's)")
    ap.add_argument("--global-batch", type=int, help="sequences per step (default: train.global_batch)")
    ap.add_argument("--top", type=int, default=10, help="layouts listed (default 10)")
    ap.add_argument("--json", help="write the ranked layouts as JSON to FILE ('-': stdout)")
    return ap


def format_table(result: Plan, hw: Hardware) -> str:
    head = f"{'#':>2}  {'layout':<52}{'step s':>9}{'tokens/s':>11}{'MFU':>7}{'GiB/rank':>9}{'bubble':>8}  reason"
    lines = [f"{hw.name}: {result.considered} layouts, {result.simulated} simulated", head, "-" * len(head)]
    for i, c in enumerate(result.candidates, 1):
        lines.append(
            f"{i:>2}  {c.label:<52}{c.prediction.step_s:>9.4g}{c.tokens_per_s:>11.4g}{c.mfu:>7.1%}"
            f"{max(c.memory) / GIB:>9.3g}{c.prediction.bubble:>8.1%}  {c.reason}"
        )
    return "\n".join(lines)


def calibration_note(hw: Hardware) -> str | None:
    """The one line `plan` prints where a GPU hardware file (no CPU probe's calibration, no cores) has no
    `[gpu_calibration]`: the plan still runs, on the datasheet figures as they stand (plan/gpu_model.py)."""
    if hw.gpu_calibration is not None or hw.calibration is not None or hw.cores_per_node is not None:
        return None
    return (
        f"hybridpar plan: note: {hw.name!r} has no [gpu_calibration]: matmuls timed at the datasheet peak and "
        "links and memory at their datasheet bandwidth, so the predictions are optimistic (docs/planner.md)"
    )


def run(argv: list[str], memory: Memory | None = None) -> tuple[Plan, Hardware, argparse.Namespace]:
    """Parse, probe or load, plan; ValueError for any bad input or impossible request."""
    a, config_args = _parser().parse_known_args(argv)  # --config and --section.key go to the config parser
    cfg: Config = parse_args(config_args)
    if a.global_batch is not None:
        cfg.train.global_batch = a.global_batch
    validate_config(cfg)  # the model and training keys; the layout is what the planner chooses
    if a.top < 1:
        raise ValueError(f"--top must be at least 1, got {a.top}")
    hw = _hardware(a, cfg)
    return plan(cfg, hw, memory or default_memory(), world=a.world, top=a.top), hw, a


def _hardware(a: argparse.Namespace, cfg: Config) -> Hardware:
    """The hardware to plan on: loaded, probed (this CPU host) or its GPUs probed against a datasheet file; the
    probed file written to --out."""
    if not a.probe and not a.hardware:
        raise ValueError("needs --hardware FILE (docs/hardware/ has examples) or --probe (measure this machine)")
    if a.out and not a.probe:
        raise ValueError("--out writes a probed hardware file: it needs --probe")
    if a.probe and a.hardware:
        from hybridpar.plan.gpu_probe import probe_gpu

        hw, figures = probe_gpu(load_hardware(a.hardware), f"hardware file {a.hardware!r}")
        print(probe_line(hw, figures), file=sys.stderr)
    elif a.probe and _has_cuda():
        raise ValueError(
            "this host has CUDA GPUs: --probe measures them against their datasheet, so give it the file with the "
            "peaks it divides by: --probe --hardware DATASHEET.toml (docs/hardware/dgx-h100.toml, dgx-h200.toml)"
        )
    elif a.probe:
        from hybridpar.plan.calibrate import shapes_for
        from hybridpar.plan.probe import probe

        world = a.world or 2
        hw = probe(
            world,
            model=cfg.model,
            seq_len=cfg.train.seq_len,
            shapes=shapes_for(cfg.model, cfg.train.global_batch, world),
        )
    else:
        hw = load_hardware(a.hardware)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as fh:
            fh.write(to_toml(hw))
    return hw


def probe_line(hw: Hardware, figures: dict[str, Any]) -> str:
    """One line of what the GPU probe measured (plan/gpu_probe.py), for stderr."""
    g = hw.gpu_calibration
    bus = "measured" if figures["intra_bus_fraction"] is not None else "kept: one GPU"
    return (
        f"hybridpar plan: probed in {figures['seconds']:.0f} s: matmul_fraction {g.matmul_fraction:.3f} (at "
        f"{figures['matmul_best'][:3]}), memory_fraction {g.memory_fraction:.3f}, attention_fraction "
        f"{g.attention_fraction:.3f} ({figures['attention_backend']}), intra_bus_fraction "
        f"{g.intra_bus_fraction:.3f} ({bus}), kernel_floor_us {g.kernel_floor_us:.2f}, dispatch_us "
        f"{g.dispatch_us:.2f}"
    )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str]) -> int:
    if any(x in ("-h", "--help") for x in argv):
        _parser().print_help()
        return 0
    try:
        result, hw, a = run(argv)
    except ValueError as e:
        print(f"hybridpar plan: {e}", file=sys.stderr)
        return 2
    note = calibration_note(hw)
    if note is not None:
        print(note, file=sys.stderr)
    print(format_table(result, hw))
    print(f"\nchoice: {result.candidates[0].label.strip()} ({result.candidates[0].reason})")
    bind = "cores" if hw.fills_cores(a.world) else "none"
    if bind == "cores":
        print("predicted for ranks bound to cores, as --parallel.auto runs them here: --parallel.cpu_bind cores")
    if a.json:
        out: dict[str, Any] = {
            "hardware": hw.name,
            "cpu_bind": bind,
            "considered": result.considered,
            "simulated": result.simulated,
            "layouts": [c.to_dict() for c in result.candidates],
        }
        text = json.dumps(out, indent=1)
        if a.json == "-":
            print(text)
        else:
            with open(a.json, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
    return 0
