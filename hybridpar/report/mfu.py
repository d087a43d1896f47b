"""Model FLOPs utilisation: the model's training FLOPs per second over the devices' peak.

Model FLOPs per token come from the model family (model/registry.py): forward matmuls of every layer and
of the head, times 3 for training (the backward costs two forwards; PaLM, Chowdhery et al. 2022, app. B).
Recomputation is not counted: MFU measures the model's work, not the hardware's.

The peak: on a GPU listed in `GPU_PEAKS` (the vendor's dense figure for the training dtype), else the
measured matmul peak — every rank multiplying square matrices at the same time, for a fixed time, after a
barrier, so ranks that share cores share them as they do while training. The peak is measured once per
run and kept in `<run_dir>/device_peak.json`; a restart with the same devices and world reads it back,
so MFU stays comparable across restarts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridpar.config import ModelConfig
from hybridpar.model.registry import layer_flops_per_token
from hybridpar.resilience.rundir import write_text_atomic
from hybridpar.topology.collectives import all_gather_json

PEAK_FILE = "device_peak.json"
# Dense peak FLOP/s per device by dtype, from the vendors' data sheets (fp32 without TF32, which torch leaves
# off for matmuls by default), as (substring of torch's device name, peaks): the first match wins, so a board
# is listed before its family. The H100 PCIe has 114 SMs at lower clocks (NVIDIA H100 data sheet: bf16 1,513
# TFLOP/s with sparsity, half that dense; fp32 51). NVL boards (H100 NVL, H200 NVL) have peaks of their own
# that no source here gives: they are measured rather than given the SXM figure.
GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIE", {"float32": 51e12, "bfloat16": 756e12}),
    ("NVL", {}),
    ("H200", {"float32": 67e12, "bfloat16": 989e12}),
    ("H100", {"float32": 67e12, "bfloat16": 989e12}),
    ("A100", {"float32": 19.5e12, "bfloat16": 312e12}),
    ("L40S", {"float32": 91.6e12, "bfloat16": 362e12}),
    ("V100", {"float32": 15.7e12, "bfloat16": 0.0}),  # no bf16 units: a bf16 run there is measured
)


def datasheet_peak(device_name: str, dtype: torch.dtype) -> float | None:
    """The data sheet's dense peak FLOP/s of a device named `device_name` in `dtype`; None where none is
    listed (the peak is then measured)."""
    name = device_name.upper()
    peaks = next((p for key, p in GPU_PEAKS if key in name), {})
    return peaks.get(str(dtype).removeprefix("torch.")) or None


def model_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the whole model (module docstring)."""
    forward = m.n_layers * layer_flops_per_token(m, seq_len) + 2.0 * m.dim * m.vocab_size
    return 3.0 * forward


def listed_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str] | None:
    """(peak FLOP/s, where from) of a listed GPU, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = datasheet_peak(name, dtype)
    return None if peak is None else (peak, f"data sheet: {name}, {dtype}")


def measure_matmul(device: torch.device, dtype: torch.dtype, seconds: float = 0.2, n: int = 512) -> float:
    """FLOP/s of back-to-back n x n matmuls for `seconds` (after one warm-up product)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=c)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    count, t0 = 0, time.perf_counter()
    while True:
        torch.mm(a, b, out=c)
        count += 1
        if count % 4 == 0:
            sync(device)
            if (elapsed := time.perf_counter() - t0) >= seconds:
                return 2.0 * n**3 * count / elapsed


def device_peak(
    device: torch.device, dtype: torch.dtype, run_dir: Path, rank: int, seconds: float = 0.2
) -> dict[str, Any]:
    """Collective: the world's peak FLOP/s {"flops_per_s", "source", "world", "device"}, read from the
    run's cache when it matches, else listed or measured for `seconds` (and cached by rank 0)."""
    world = dist.get_world_size()
    key = {"world": world, "device": device.type, "dtype": str(dtype), "threads": torch.get_num_threads()}
    cached = None
    if rank == 0 and (run_dir / PEAK_FILE).is_file():
        try:
            got = json.loads((run_dir / PEAK_FILE).read_text(encoding="utf-8"))
            cached = got if all(got.get(k) == v for k, v in key.items()) else None
        except ValueError:
            cached = None  # torn or foreign: measure again
    cached = all_gather_json(cached, device)[0]
    if cached is not None:
        return cached
    listed = listed_peak(device, dtype)
    if listed is not None:
        peak = {"flops_per_s": listed[0] * world, "source": listed[1] + f" x {world} devices", **key}
    else:
        dist.barrier()  # every rank measures at once, sharing what it shares while training
        mine = measure_matmul(device, dtype, seconds)
        rates = all_gather_json(mine, device)
        peak = {
            "flops_per_s": sum(rates),
            "source": f"measured {device.type} matmul, {world} ranks at once, {torch.get_num_threads()} thread(s) each",
            **key,
        }
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / PEAK_FILE, json.dumps(peak))
    return peak


def mfu(flops_per_token: float, tokens: int, step_time_s: float, peak_flops_per_s: float) -> float | None:
    if step_time_s <= 0 or peak_flops_per_s <= 0:
        return None
    return flops_per_token * tokens / step_time_s / peak_flops_per_s
