"""`hybridpar plan --probe --hardware DATASHEET.toml` on a CUDA host: the `[gpu_calibration]` measured.

What the datasheet file gives (the bf16 peak, the memory bandwidth, the intra-node link's bandwidth) is what the
measured rates are divided by; the probe writes the same file back with a measured calibration:

* matmul_table: torch.mm in bf16 over a grid of shapes (m, n, k each in GRID), each shape's FLOP rate over the
  bf16 peak; matmul_fraction is its best row (plan/matmul_table.py reads between the rows);
* memory_fraction: an elementwise add of two MEMORY_ELEMENTS bf16 tensors into a third (three passes over
  memory, what the norms, activations and residuals do) over the datasheet bandwidth;
* attention_fraction: scaled_dot_product_attention, causal, bf16, forward + backward at head dim 128 for each
  of ATTENTION_SEQS (ATTENTION_TOKENS tokens of 16 heads each), FLOPs counted as the cost model counts them
  (the causal half; backward 2.5 forwards: gpu_model.FLASH_BACKWARD_RECOMPUTE), the best of them; the kernel
  torch chose (flash, memory-efficient, cuDNN: "flash", math: "unfused") is recorded;
* kernel_floor_us: FLOOR_KERNELS eager 1-element adds queued behind a sleeping kernel, CUDA events around them
  (the device's time per eager kernel, no host in the loop); on CPU the same adds on the host's clock, dispatch
  included: the plumbing, not a device's floor;
* dispatch_us: the same add called DISPATCH_CALLS times eagerly (each allocating its output, as the runtime's ops
  do), the host's clock around the calls alone, the device drained before and after outside it; fewer calls than
  the stream's queue holds, so the host never waits for the device. On CPU, where host and device are one, this
  is the CPU probe's op_overhead_us figure (plan/probe.py: an op's dispatch and its run, which add there);
* intra_bus_fraction: with two or more GPUs, an NCCL all-reduce of BUS_BYTES over all of them, its bus bandwidth
  (nccl-tests' busbw: algbw x 2 (n - 1) / n) over the intra-node link's bandwidth; with one GPU the file's value
  is kept, and inter_bus_fraction always (one node cannot measure the network between nodes).

Every rate is timed as back-to-back calls (`seconds`: CUDA events around a batch lasting about TARGET_S, after a
warm-up, the median of REPEATS batches); each kernel figure is the median of REPEATS batches after a warm-up one.
The measuring functions take the device and the peak as arguments, so they run on CPU with tiny sizes too
(tests/test_gpu_probe.py); only `probe_gpu` insists on CUDA.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable

from hybridpar.plan.gpu_model import FLASH_BACKWARD_RECOMPUTE, GpuCalibration
from hybridpar.plan.hardware import Hardware
from hybridpar.plan.matmul_table import MatmulTable

# 64 .. 16384: attention's per-head products (n or k = head_dim, 64-128) and a tp shard of a small model's
# projection up to a large model's microbatch of tokens
GRID = tuple(2**i for i in range(6, 15))
MEMORY_ELEMENTS = 1 << 28  # 512 MiB per bf16 tensor: far past every cache
ATTENTION_SEQS = (1024, 2048, 4096, 8192)
ATTENTION_TOKENS = 16384  # sequences x length at each length: the same FLOPs per token row
ATTENTION_HEADS, HEAD_DIM = 16, 128
BUS_BYTES = 1 << 28  # 256 MiB all-reduce: large enough that the ring's hops' latency is negligible
# Kernels and eager calls per batch for the kernel figures: enough that the events' resolution (about 0.5 us) is a
# small part of a batch, and fewer than the CUDA stream's queue of pending launches (about a thousand), past which
# the host would wait for the device. The floor's adds queue behind torch.cuda._sleep(HOLD_CYCLES): about 10 ms at
# a GPU's 1.4-2 GHz, twice the time 500 eager launches take a host (5-20 us each), doubled where it was not.
FLOOR_KERNELS = 500
DISPATCH_CALLS = 500
HOLD_CYCLES = 20_000_000
HOLD_DOUBLINGS = 5
REPEATS = 5
TARGET_S = 2e-3
FUSED = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
# What the calibration says of the training software rather than the device: kept from the datasheet file.
SOFTWARE_FACTS = ("overlap", "tp_comm_efficiency", "sp_backward", "cp_comm", "grad_accumulation", "p2p", "elementwise")


def seconds(fn: Callable[[], Any], device: Any, repeats: int = REPEATS, target_s: float = TARGET_S) -> float:
    """Median seconds of one `fn()` among back-to-back calls: each of `repeats` batches runs enough calls to last
    about `target_s` (a single short kernel's time would be its launch), after one warm-up call that also sizes
    the batch. On CUDA the batch is timed by events on the stream (the kernels' time, not the host's)."""
    import torch

    cuda = getattr(device, "type", device) == "cuda"

    def batch(calls: int) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - t0

    first = batch(1)  # warm-up: kernel selection, allocation
    calls = max(1, min(1000, math.ceil(target_s / max(batch(1), first * 1e-3, 1e-7))))
    return statistics.median(batch(calls) / calls for _ in range(repeats))


def gemm_fraction(m: int, n: int, k: int, peak_flops: float, device: Any, dtype: Any, repeats: int = REPEATS) -> float:
    """An (m x k) @ (k x n) torch.mm's FLOP rate (2 m n k per product) over `peak_flops`."""
    import torch

    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    c = torch.empty(m, n, device=device, dtype=dtype)
    return 2.0 * m * n * k / seconds(lambda: torch.mm(a, b, out=c), device, repeats) / peak_flops


def matmul_table(
    grid: tuple[int, ...], peak_flops: float, device: Any, dtype: Any, repeats: int = REPEATS
) -> MatmulTable:
    """Every (m, n, k) of grid^3 measured; fractions above 1 (a wrong peak) are left for the table's validation
    to refuse with the row named."""
    rows = [
        (m, n, k, gemm_fraction(m, n, k, peak_flops, device, dtype, repeats)) for m in grid for n in grid for k in grid
    ]
    return MatmulTable(tuple(rows))


def memory_fraction(elements: int, bandwidth_bps: float, device: Any, dtype: Any, repeats: int = REPEATS) -> float:
    """torch.add of two `elements`-long tensors into a third: bytes read and written per second over
    `bandwidth_bps`."""
    import torch

    x, y = torch.randn(elements, device=device, dtype=dtype), torch.randn(elements, device=device, dtype=dtype)
    z = torch.empty_like(x)
    moved = 3.0 * elements * x.element_size()
    return moved / seconds(lambda: torch.add(x, y, out=z), device, repeats) / bandwidth_bps


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention as the cost model counts them (gpu_model.layer_times): QK^T
    and PV over the causal half, the backward 2 + FLASH_BACKWARD_RECOMPUTE forwards."""
    forward = 4.0 * batch * heads * seq * seq * head_dim / 2
    return forward * (1 + 2 + FLASH_BACKWARD_RECOMPUTE)


def attention_fractions(
    seqs: tuple[int, ...],
    tokens: int,
    heads: int,
    head_dim: int,
    peak_flops: float,
    device: Any,
    dtype: Any,
    repeats: int = REPEATS,
) -> tuple[list[tuple[int, float]], str]:
    """(seq, rate over `peak_flops`) of causal SDPA forward + backward at each length (tokens // seq sequences),
    and the kernel torch chose for the longest."""
    import torch
    import torch.nn.functional as F

    from hybridpar.model.kvcache import attention_kernel

    out = []
    for s in seqs:
        b = max(1, tokens // s)
        q, k, v = (torch.randn(b, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, heads, s, head_dim, device=device, dtype=dtype)

        def step() -> None:  # autograd.grad, not backward: no accumulation into .grad (a pass of its own)
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad)

        out.append((s, attention_flops(b, heads, s, head_dim) / seconds(step, device, repeats) / peak_flops))
    return out, attention_kernel(heads, seqs[-1], head_dim, torch.device(device), dtype)


def kernel_floor_s(device: Any, kernels: int = FLOOR_KERNELS, repeats: int = REPEATS) -> float:
    """Median seconds per kernel of `kernels` 1-element in-place adds launched eagerly, as the runtime launches
    its ops, while the stream is held by a sleeping kernel: the host has queued them all before the device
    starts the first, so CUDA events around them time the device alone (each eager kernel's start-up and drain,
    no host in the loop). A CUDA graph would not do: its launches are cheaper than eager ones. A batch whose
    queueing outlasted the hold is taken again with a hold twice as long. On CPU (host and device are one)
    the adds are timed by `seconds`: dispatch and run together."""
    import torch

    x = torch.zeros(1, device=device)
    if getattr(device, "type", device) != "cuda":
        return seconds(lambda: x.add_(1), device, repeats)
    hold = HOLD_CYCLES

    def batch() -> float:
        nonlocal hold
        for _ in range(HOLD_DOUBLINGS):
            held, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            held.record()
            torch.cuda._sleep(hold)
            start.record()
            for _ in range(kernels):
                x.add_(1)
            end.record()
            queued_s = time.perf_counter() - t0
            end.synchronize()
            if held.elapsed_time(start) / 1e3 > queued_s:  # the device slept until every add was queued
                return start.elapsed_time(end) / 1e3 / kernels
            hold *= 2
        raise RuntimeError(f"kernel_floor_s: the host took longer to queue {kernels} adds than a hold of {hold} cycles")

    batch()  # warm-up: the adds' kernel loaded, the hold sized
    return statistics.median(batch() for _ in range(repeats))


def dispatch_s(device: Any, calls: int = DISPATCH_CALLS, repeats: int = REPEATS) -> float:
    """Median host seconds per eager 1-element add (`x + y`, its output allocated) among `calls` back-to-back
    calls: the host's clock around the calls alone, the device drained before and after outside it."""
    import torch

    x, y = torch.zeros(1, device=device), torch.ones(1, device=device)
    cuda = getattr(device, "type", device) == "cuda"

    def batch() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            x + y
        elapsed = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize(device)
        return elapsed / calls

    batch()  # warm-up: the allocator's blocks, the dispatcher's caches
    return statistics.median(batch() for _ in range(repeats))


def bus_bandwidth(nbytes: int, world: int, seconds_: float) -> float:
    """nccl-tests' bus bandwidth of an all-reduce of `nbytes` over `world` ranks taking `seconds_`: what one
    ring step moves per second (algbw x 2 (n - 1) / n)."""
    return nbytes / seconds_ * 2 * (world - 1) / world


def _bus_worker(nbytes: int, repeats: int) -> float:
    """One rank: the median seconds of an all-reduce of `nbytes` (fp32) over the default group (NCCL on CUDA)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    x = torch.ones(nbytes // 4, device=device)
    dist.all_reduce(x)  # warm-up: the communicator's setup
    t = seconds(lambda: dist.all_reduce(x), device, repeats, target_s=0.0)
    dist.destroy_process_group()
    return t


def intra_bus_fraction(gpus: int, link_gbs: float, nbytes: int = BUS_BYTES, repeats: int = REPEATS) -> float:
    """All-reduce bus bandwidth over `gpus` ranks (one per GPU) over the link's `link_gbs`."""
    from hybridpar.topology.spawn import run_ranks

    t = max(run_ranks(_bus_worker, gpus, nbytes, repeats, timeout_s=120))  # the slowest rank's view
    return bus_bandwidth(nbytes, gpus, t) / (link_gbs * 1e9)


def check_datasheet(hw: Hardware, where: str) -> None:
    """What a GPU probe divides by must be in the file; ValueError naming what is missing."""
    if hw.peak_flops("bf16") <= 0:
        raise ValueError(f"{where}: a GPU probe needs the datasheet's [peak_tflops] bf16 (> 0) to divide GEMM rates by")
    if hw.memory_bandwidth_gbs is None:
        raise ValueError(f"{where}: a GPU probe needs the datasheet's memory_bandwidth_gbs to divide the copy rate by")
    if hw.calibration is not None or hw.cores_per_node is not None:
        raise ValueError(
            f"{where}: describes a CPU host (a probe's [calibration] or cores_per_node); a GPU probe needs a GPU "
            "datasheet file such as docs/hardware/dgx-h100.toml"
        )


def calibrate_gpu(
    hw: Hardware, device: Any, dtype: Any, gpus: int, grid: tuple[int, ...] = GRID, sizes: dict | None = None
) -> tuple[GpuCalibration, dict]:
    """The measured `[gpu_calibration]` against `hw`'s datasheet figures, and the figures behind it (JSON-able).
    `sizes` shrinks MEMORY_ELEMENTS, ATTENTION_*, BUS_BYTES, FLOOR_KERNELS and DISPATCH_CALLS (keys: elements,
    seqs, tokens, heads, head_dim, repeats, bus_bytes, kernels, calls) for a CPU run of the plumbing (`gpus` >= 2
    then runs gloo ranks on CPU)."""
    s = {
        "elements": MEMORY_ELEMENTS,
        "seqs": ATTENTION_SEQS,
        "tokens": ATTENTION_TOKENS,
        "heads": ATTENTION_HEADS,
        "head_dim": HEAD_DIM,
        "repeats": REPEATS,
        "bus_bytes": BUS_BYTES,
        "kernels": FLOOR_KERNELS,
        "calls": DISPATCH_CALLS,
        **(sizes or {}),
    }
    peak, t0 = hw.peak_flops("bf16"), time.perf_counter()
    table = matmul_table(grid, peak, device, dtype, s["repeats"])
    mem = memory_fraction(s["elements"], hw.memory_bandwidth_gbs * 1e9, device, dtype, s["repeats"])
    att, kernel = attention_fractions(
        s["seqs"], s["tokens"], s["heads"], s["head_dim"], peak, device, dtype, s["repeats"]
    )
    try:  # optional figures (absent: no kernel priced): their failure must not cost the rest of the probe
        floor, failed = kernel_floor_s(device, s["kernels"], s["repeats"]), None
        dispatch = dispatch_s(device, s["calls"], s["repeats"])
    except (RuntimeError, AttributeError) as e:
        floor, dispatch, failed = 0.0, 0.0, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    old = hw.gpu_calibration
    bus = intra_bus_fraction(gpus, hw.intra_node.bandwidth_gbs, s["bus_bytes"], s["repeats"]) if gpus >= 2 else None
    figures = {
        "matmul_best": max(table.rows, key=lambda r: r[3]),
        "memory_fraction": mem,
        "attention": att,
        "attention_backend": kernel,
        "intra_bus_fraction": bus,
        "kernel_floor_us": floor * 1e6,
        "dispatch_us": dispatch * 1e6,
        "kernel_figures_failed": failed,
        "kernels": s["kernels"],
        "calls": s["calls"],
        "gpus": gpus,
        "bus_bytes": s["bus_bytes"],
        "repeats": s["repeats"],
        "head_dim": s["head_dim"],
        "timer": "CUDA events" if getattr(device, "type", device) == "cuda" else "the host's clock",
        "seconds": time.perf_counter() - t0,
    }
    kept = {
        "intra_bus_fraction": old.intra_bus_fraction if old else 1.0,
        "inter_bus_fraction": old.inter_bus_fraction if old else 1.0,
    }
    facts = {} if old is None else {f: getattr(old, f) for f in SOFTWARE_FACTS}
    cal = GpuCalibration(
        matmul_fraction=table.best(),
        memory_fraction=mem,
        attention_fraction=max(f for _, f in att),
        intra_bus_fraction=bus if bus is not None else kept["intra_bus_fraction"],
        inter_bus_fraction=kept["inter_bus_fraction"],
        attention_kernel="flash" if kernel in FUSED else "unfused",
        source="",
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        matmul_table=table,
        kernel_floor_us=floor * 1e6,
        dispatch_us=dispatch * 1e6,
        **facts,
    )
    return dataclasses.replace(cal, source=_source(hw, figures, device, old is not None)), figures


def _source(hw: Hardware, f: dict, device: Any, had: bool) -> str:
    """What was measured, on which device with which torch, and what was kept from the datasheet file."""
    import torch

    cuda = getattr(device, "type", device) == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else f"{device} (not a GPU)"
    m, n, k, best = f["matmul_best"]
    att = ", ".join(f"{s}: {x:.3f}" for s, x in f["attention"])
    where = (
        "the datasheet file's [gpu_calibration]"
        if had
        else "none in the datasheet file: 1.0, its link bandwidth as it stands"
    )
    intra = (
        f"intra_bus_fraction measured: NCCL all-reduce of {f['bus_bytes'] / 2**20:g} MiB over {f['gpus']} GPUs, bus "
        f"bandwidth over [intra_node] bandwidth_gbs {hw.intra_node.bandwidth_gbs:g}"
        if f["intra_bus_fraction"] is not None
        else f"intra_bus_fraction kept ({where}: one GPU has no link to measure)"
    )
    kernels = (
        f"kernel_floor_us, dispatch_us: not measured, no kernel priced ({f['kernel_figures_failed']})."
        if f["kernel_figures_failed"]
        else f"kernel_floor_us: {f['kernels']} 1-element adds "
        f"{'queued eagerly behind a sleeping kernel, CUDA events' if cuda else 'on the host clock'}, per kernel, "
        f"median of {f['repeats']}. dispatch_us: {f['calls']} eager 1-element adds, the host's clock around the "
        f"calls, per call, median of {f['repeats']}."
    )
    return (
        f"hybridpar plan --probe on {name}, torch {torch.__version__}, against {hw.name!r} "
        f"(bf16 peak {hw.peak_tflops['bf16']:g} TFLOP/s, memory {hw.memory_bandwidth_gbs:g} GB/s), in "
        f"{f['seconds']:.0f} s. matmul_table: torch.mm bf16 over the grid, {f['timer']}, median of {f['repeats']} "
        f"batches; best ({m}, {n}, {k}). memory_fraction: torch.add of two bf16 tensors into a third, 3 passes. "
        f"attention_fraction: the best of scaled_dot_product_attention causal bf16 forward + backward, head dim "
        f"{f['head_dim']}, by sequence length ({att}), the causal half and the backward as 2.5 forwards counted; "
        f"kernel {f['attention_backend']}. {kernels} {intra}. "
        f"inter_bus_fraction kept ({where}: one node cannot measure the network). Software facts "
        f"({', '.join(SOFTWARE_FACTS)}) kept from the datasheet file."
    )


def probe_gpu(hw: Hardware, where: str) -> tuple[Hardware, dict]:
    """`hw` (a datasheet file) with its `[gpu_calibration]` measured on this host's CUDA devices."""
    import torch

    check_datasheet(hw, where)
    if not torch.cuda.is_available():
        raise ValueError(
            f"--probe with --hardware measures CUDA GPUs against the datasheet file, and torch {torch.__version__} "
            "sees none here: on a CPU host run --probe without --hardware"
        )
    gpus = min(torch.cuda.device_count(), hw.devices_per_node)
    cal, figures = calibrate_gpu(hw, torch.device("cuda", 0), torch.bfloat16, gpus)
    check_measured(cal, where, torch.cuda.get_device_name(0))
    return dataclasses.replace(hw, gpu_calibration=cal), figures


def check_measured(cal: GpuCalibration, where: str, device_name: str) -> None:
    """A measured fraction above 1 means the datasheet's figure is below what the device ran: the wrong file for
    this device (an SXM file on a PCIe board, say). ValueError naming the figure, before anything is written."""
    rows = [(f"matmul_table row {list(r[:3])}", r[3], "[peak_tflops] bf16") for r in cal.matmul_table.rows]
    rows += [
        ("memory_fraction", cal.memory_fraction, "memory_bandwidth_gbs"),
        ("attention_fraction", cal.attention_fraction, "[peak_tflops] bf16"),
        ("intra_bus_fraction", cal.intra_bus_fraction, "[intra_node] bandwidth_gbs"),
    ]
    for what, value, figure in rows:
        if value > 1:
            raise ValueError(
                f"{where}: measured {what} {value:.3f} > 1 on {device_name}: the file's {figure} is below what this "
                "device reached; give the datasheet file of this device"
            )
