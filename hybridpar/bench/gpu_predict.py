"""The mfu check's probe (bench/gpu_check.py): the GPU probe (plan/gpu_probe.py) on the device, first, and the
planner's prediction of the ~1B model's eager step with the probed calibration beside the step measured.

The datasheet file the probe divides by is picked by the device's name: an H100 SXM (docs/hardware/dgx-h100.toml)
or an H200 SXM (dgx-h200.toml); other GPUs (PCIe and NVL boards included: other peaks) are refused with a line
saying how to probe them. `--dry-run` runs the same code on CPU with tiny sizes against the H100 file: the
plumbing, not a GPU's figures.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

HARDWARE = Path(__file__).resolve().parents[2] / "docs" / "hardware"
DATASHEETS = {"H100": "dgx-h100.toml", "H200": "dgx-h200.toml"}
DRY_GRID = (8, 16)
DRY_SIZES = dict(
    elements=4096, seqs=(16,), tokens=32, heads=2, head_dim=16, repeats=1, bus_bytes=1 << 16, kernels=50, calls=50
)


def said(e: BaseException) -> str:
    """An error in one line for a JSON entry: its type and its message's first line (an empty one too)."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def datasheet_for(device_name: str) -> Path:
    """The datasheet file of a device named `device_name` (torch.cuda.get_device_name); ValueError naming it."""
    name = device_name.upper()
    hits = [f for key, f in DATASHEETS.items() if key in name and "PCIE" not in name and "NVL" not in name]
    if len(hits) != 1:
        raise ValueError(
            f"no datasheet file for {device_name!r}: the mfu check's probe knows the H100 SXM and H200 SXM "
            f"(docs/hardware/{', '.join(DATASHEETS.values())}); for another GPU write its datasheet file and run "
            "`hybridpar plan --probe --hardware FILE --out PROBED.toml`"
        )
    return HARDWARE / hits[0]


def probe(a: Any) -> dict:
    """The mfu check's GPU probe, run first (it takes seconds and the prediction needs it): its figures and the
    probed file, written beside the check's JSON at once. {"refused": why} for a GPU without a datasheet file
    here; {"error": ...} if the probe failed. Run in the check's own process, which starts no other CUDA work:
    the allocator's cached blocks are handed back after it, so the options' runs (processes of their own) have
    the device's memory but this process's context (about half a GiB)."""
    import torch

    from hybridpar.plan.gpu_model import KERNEL_FIGURES
    from hybridpar.plan.gpu_probe import calibrate_gpu, probe_gpu
    from hybridpar.plan.hardware import load_hardware, to_toml

    name = "cpu (--dry-run: the plumbing, not a GPU's figures)" if a.dry_run else torch.cuda.get_device_name(0)
    try:
        path = HARDWARE / DATASHEETS["H100"] if a.dry_run else datasheet_for(name)
    except ValueError as e:  # a GPU this check has no datasheet for: said, and not a failure of the check
        return {"refused": str(e)}
    try:
        sheet = load_hardware(path)
        if a.dry_run:
            # as if there were a.gpus GPUs (2 by default): the bus bandwidth's ranks run on gloo
            cal, figures = calibrate_gpu(sheet, torch.device("cpu"), torch.bfloat16, a.gpus, DRY_GRID, DRY_SIZES)
            probed = dataclasses.replace(sheet, gpu_calibration=cal)
        else:
            probed, figures = probe_gpu(sheet, str(path))
    except Exception as e:  # the probe's own failure (a fraction above 1 included) is the check's
        return {"error": said(e)}
    finally:
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    out = Path(a.out).with_suffix("") / "probed.toml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_toml(probed))
    g = probed.gpu_calibration
    return {
        "device": name,
        "datasheet": str(path.relative_to(HARDWARE.parents[1])),
        "probed_file": str(out),
        "probe_s": figures["seconds"],
        "calibration": {
            **{k: getattr(g, k) for k in ("matmul_fraction", "memory_fraction", "attention_fraction")},
            **{k: getattr(g, k) for k in ("intra_bus_fraction", "attention_kernel")},
            **{k: getattr(g, k) for k in KERNEL_FIGURES},
            "intra_bus_measured_over_gpus": figures["gpus"] if figures["intra_bus_fraction"] is not None else None,
            "attention_backend": figures["attention_backend"],
            "attention_by_seq": figures["attention"],
            "matmul_best_shape": list(figures["matmul_best"][:3]),
        },
    }


def prediction(a: Any, probed: dict, eager: dict | None, config: Callable[[Any, str], Any]) -> dict:
    """The planner's prediction of the eager option's step (tp1 pp1 dp1, its microbatches) on the probed file
    (read back as a user's plan would read it) and on the datasheet file's own calibration, beside the eager
    row's measured step: None until that row has run (or if it failed). {} without a probed file."""
    from hybridpar.plan.cost import CostModel
    from hybridpar.plan.hardware import load_hardware
    from hybridpar.plan.step import predict

    if "probed_file" not in probed:
        return {}
    cfg = config(a, "eager")
    try:
        hw = load_hardware(probed["probed_file"])
        predicted = predict(CostModel(cfg.model, hw), cfg).step_s
        # the same file without its kernel figures: what the probe's floor and dispatch add to the prediction
        bare = dataclasses.replace(hw.gpu_calibration, kernel_floor_us=0.0, dispatch_us=0.0)
        no_kernels = predict(CostModel(cfg.model, dataclasses.replace(hw, gpu_calibration=bare)), cfg).step_s
        sheet = predict(CostModel(cfg.model, load_hardware(HARDWARE.parents[1] / probed["datasheet"])), cfg).step_s
    except Exception as e:  # the probed file unreadable or the model refused: said, the figures kept
        return {"error": f"prediction: {said(e)}"}
    measured = eager.get("step_time_s") if eager is not None else None
    return {
        "layout": "tp1 pp1 dp1, the eager option's configuration",
        "predicted_step_s": predicted,
        "predicted_step_s_without_kernel_figures": no_kernels,
        "predicted_step_s_datasheet_calibration": sheet,
        "measured_step_s": measured,
        "measured_over_predicted": None if measured is None else measured / predicted,
    }
