"""Hardware descriptions: one TOML file per machine or cluster, read into a validated `Hardware`.

Required keys (units in the names; 1 GB = 1e9 bytes):

    name, source                      strings: what it is, where each figure comes from
    nodes, devices_per_node           positive integers
    device_memory_gib                 > 0
    [peak_tflops]                     dense TFLOP/s per device by precision: fp32, bf16 (fp16, tf32 optional)
    [intra_node]  bandwidth_gbs, latency_us   between two devices of one node, per direction
    [inter_node]  bandwidth_gbs, latency_us   between nodes, per device (its share of the NICs), per direction

Optional keys:

    speed = [1.0, 0.5, ...]           relative speed of each device (nodes x devices_per_node entries)
    memory_bandwidth_gbs              device memory bandwidth: the time of memory-bound work (elementwise
                                      ops, the optimizer step); none = those are not timed
    cores_per_node                    CPU machines whose ranks share cores: how many ranks' worth of compute
                                      a node sustains at once (the probe measures it); none = every device
                                      computes on its own (GPUs)
    op_overhead_us                    fixed cost of launching one framework operation (the Python dispatch
                                      and run of an eager CPU op, which add); default 0. A GPU's kernels are
                                      priced by `[gpu_calibration]`'s kernel_floor_us and dispatch_us instead
                                      (they overlap there: plan/gpu_model.py)
    collective_latency_us             latency of one step of a ring collective (all-reduce, all-gather),
                                      where it differs from the link's (CPU ranks: gloo over loopback,
                                      while the pipeline's messages go through shared memory); none = the
                                      link's latency_us
    collective_bandwidth_gbs          bandwidth of a ring collective's step where it is below the link's
                                      (CPU ranks: gloo over loopback, measured by the probe with a 4 MiB
                                      all-reduce after compute); none = the link's bandwidth_gbs
    step_sync_us                      what a step's closing reductions take (loss and flags, step time and
                                      peak, gradient norm: three small all-reduces over every rank, each
                                      after compute), measured in place by the probe: on a CPU host whose
                                      ranks outnumber its cores, 10 ms where an idle 8-byte all-reduce
                                      says 1.3; none = three all-reduces by collective_latency_us
    sync_wait = [[ranks, work_us, wait_us], ...]
                                      what a collective over groups of `ranks` waits beyond an idle one when
                                      it follows `work_us` of compute on each rank, every group at once (a
                                      data-parallel reduction after the pipeline): where ranks share cores
                                      the scheduler's time slices make ranks that did the same work arrive
                                      apart, by more the longer they computed; none = they arrive together
    [gpu_calibration]                 what fraction of the datasheet figures a GPU's kernels and collectives
                                      reach, each with its source (plan/gpu_model.py); none = the datasheet
                                      figures as they stand
    [calibration]                     the model's own layers, embedding, head and optimizer timed on this
                                      machine at given (tp, tokens) shapes (plan/calibrate.py); the cost
                                      model uses them for that model shape in fp32, FLOPs otherwise

`plan --probe` writes every key for this machine (plan/probe.py); `plan --probe --hardware FILE` on a CUDA host
writes FILE's keys with a measured `[gpu_calibration]` (plan/gpu_probe.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hybridpar.config.parse import load_toml
from hybridpar.plan.calibrate import Calibration, parse_calibration
from hybridpar.plan.gpu_model import GpuCalibration, Rates, parse_gpu_calibration

PRECISIONS = ("fp32", "bf16", "fp16", "tf32")
REQUIRED_PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Link:
    bandwidth_gbs: float  # GB/s per direction
    latency_us: float

    def seconds(self, nbytes: float) -> float:
        """One message of `nbytes` over this link: latency + size / bandwidth."""
        return self.latency_us * 1e-6 + nbytes / (self.bandwidth_gbs * 1e9)


@dataclass(frozen=True)
class Hardware:
    name: str
    source: str
    nodes: int
    devices_per_node: int
    device_memory_gib: float
    peak_tflops: dict[str, float]
    intra_node: Link
    inter_node: Link
    speed: tuple[float, ...] | None = None
    memory_bandwidth_gbs: float | None = None
    cores_per_node: float | None = None
    op_overhead_us: float = 0.0
    collective_latency_us: float | None = None
    collective_bandwidth_gbs: float | None = None
    step_sync_us: float | None = None
    sync_wait: tuple[tuple[int, float, float], ...] | None = None
    calibration: Calibration | None = None
    gpu_calibration: GpuCalibration | None = None

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def device_memory_bytes(self) -> int:
        return int(self.device_memory_gib * 2**30)

    def fills_cores(self, world: int) -> bool:
        """Whether `world` ranks take all the cores of a node or more (a CPU host; the probe measures a
        little under or over the whole cores it finds, 1.92-2.05 of 2 here, hence the rounding). The cost
        model counts the cores as one pool that the computing ranks split (plan/cost.py); left to the OS,
        tensor-parallel partners or a stage's replicas can land on one core and wait for each other at
        every collective (tp2 x dp2 at 4 ranks on 2 cores stepped 0.24-0.26 s against 0.19-0.20 bound).
        Ranks bound stage-major (parallel.cpu_bind=cores, topology/cpus.py) run as predicted, so
        `--parallel.auto` binds them here (plan/launch.py)."""
        return self.cores_per_node is not None and min(world, self.devices_per_node) >= round(self.cores_per_node)

    def peak_flops(self, precision: str) -> float:
        """Dense FLOP/s per device in `precision` ("fp32" or "bf16"); 0 where the hardware has none."""
        return self.peak_tflops.get(precision, 0.0) * 1e12

    def precisions(self) -> tuple[str, ...]:
        """The training precisions the planner offers on this hardware: those it computes (a positive
        peak); where it carries a calibration (a CPU host's probe), only fp32, the one timed. There the
        eager per-operation work outweighs the matmuls, so a FLOP peak says nothing of a precision: on
        the development machine bf16 trains the default model 4.7x slower than fp32, where the peaks
        alone predicted it about 6x faster."""
        if self.calibration is not None:
            return ("fp32",) if self.peak_flops("fp32") > 0 else ()
        return tuple(p for p in REQUIRED_PRECISIONS if self.peak_flops(p) > 0)

    def memory_bps(self) -> float | None:
        """Memory bytes/s that memory-bound work reaches: the datasheet's, at the GPU calibration's fraction."""
        if self.memory_bandwidth_gbs is None:
            return None
        g = self.gpu_calibration
        return self.memory_bandwidth_gbs * 1e9 * (1.0 if g is None else g.memory_fraction)

    def link_bps(self, link: Link) -> float:
        """Bytes/s a collective's ring step or a hand-off reaches over `link`: its bandwidth, at the GPU
        calibration's bus fraction for the link where there is one."""
        g = self.gpu_calibration
        frac = 1.0 if g is None else (g.inter_bus_fraction if link is self.inter_node else g.intra_bus_fraction)
        return link.bandwidth_gbs * 1e9 * frac

    def gpu_rates(self, precision: str) -> Rates | None:
        """The GPU calibration's achievable rates in `precision`; None without one (or a memory bandwidth)."""
        g, mem = self.gpu_calibration, self.memory_bps()
        if g is None or mem is None:
            return None
        return Rates(
            self.peak_flops(precision) * g.matmul_fraction, mem, 4 if precision == "fp32" else 2, g.matmul_table
        )

    def device_speed(self, device: int) -> float:
        return 1.0 if self.speed is None else self.speed[device]

    def sync_wait_s(self, ranks: int, work_s: float) -> float:
        """Seconds a collective over `ranks` waits for ranks arriving apart after `work_s` of compute
        each (`sync_wait`): the rows of the nearest group size, linear in the work between them, flat
        beyond; 0 without the table or for one rank."""
        if self.sync_wait is None or ranks <= 1:
            return 0.0
        n = min({r for r, _, _ in self.sync_wait}, key=lambda r: (abs(r - ranks), r))
        pts = sorted((w * 1e-6, x * 1e-6) for r, w, x in self.sync_wait if r == n)
        if work_s <= pts[0][0]:
            return pts[0][1]
        for (w0, x0), (w1, x1) in zip(pts, pts[1:]):
            if work_s <= w1:
                return x0 + (x1 - x0) * (work_s - w0) / (w1 - w0)
        return pts[-1][1]


def _need(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {message}")


def _number(d: dict[str, Any], key: str, where: str, *, positive: bool = True, default: Any = ...) -> float:
    """d[key] as a finite float (> 0, or >= 0 when not `positive`); `default` where it may be absent."""
    if key not in d:
        _need(default is not ..., where, f"missing key {key!r}")
        return default
    v = d[key]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    _need(
        ok and (v > 0 if positive else v >= 0),
        where,
        f"{key} must be a number {'> 0' if positive else '>= 0'}, got {v!r}",
    )
    return float(v)


def _link(d: dict[str, Any], key: str, where: str) -> Link:
    t = d.get(key)
    _need(isinstance(t, dict), where, f"missing table [{key}] with bandwidth_gbs and latency_us")
    unknown = sorted(set(t) - {"bandwidth_gbs", "latency_us"})
    _need(not unknown, where, f"unknown key(s) in [{key}]: {', '.join(unknown)} (known: bandwidth_gbs, latency_us)")
    return Link(
        _number(t, "bandwidth_gbs", f"{where} [{key}]"), _number(t, "latency_us", f"{where} [{key}]", positive=False)
    )


def parse_hardware(d: dict[str, Any], where: str = "hardware") -> Hardware:
    """A `Hardware` from the TOML's dict; ValueError naming the file, the key and what it must be."""
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(d) - known)
    _need(not unknown, where, f"unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    for key in ("name", "source"):
        _need(isinstance(d.get(key), str) and d[key].strip() != "", where, f"{key} must be a non-empty string")
    for key in ("nodes", "devices_per_node"):
        _need(key in d, where, f"missing key {key!r} (a positive integer)")
        v = d[key]
        _need(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1,
            where,
            f"{key} must be a positive integer, got {v!r}",
        )
    peaks = d.get("peak_tflops")
    _need(isinstance(peaks, dict), where, "missing table [peak_tflops] (dense TFLOP/s per device: fp32, bf16)")
    bad = sorted(set(peaks) - set(PRECISIONS))
    _need(not bad, where, f"unknown precision(s) in [peak_tflops]: {', '.join(bad)} (known: {', '.join(PRECISIONS)})")
    for p in REQUIRED_PRECISIONS:
        _need(p in peaks, where, f"[peak_tflops] needs {p} (0 where the device has no {p} units)")
    tflops = {p: _number(peaks, p, f"{where} [peak_tflops]", positive=False) for p in peaks}
    _need(tflops["fp32"] > 0 or tflops["bf16"] > 0, where, "[peak_tflops] fp32 and bf16 are both 0")
    n = d["nodes"] * d["devices_per_node"]
    speed = d.get("speed")
    if speed is not None:
        _need(
            isinstance(speed, list) and len(speed) == n,
            where,
            f"speed must list one factor per device (nodes x devices_per_node = {n}), got {speed!r}",
        )
        speed = tuple(_number({"speed": s}, "speed", where) for s in speed)
    opt = lambda key: _number(d, key, where, default=None)  # noqa: E731
    return Hardware(
        name=d["name"],
        source=d["source"],
        nodes=d["nodes"],
        devices_per_node=d["devices_per_node"],
        device_memory_gib=_number(d, "device_memory_gib", where),
        peak_tflops=tflops,
        intra_node=_link(d, "intra_node", where),
        inter_node=_link(d, "inter_node", where),
        speed=speed,
        memory_bandwidth_gbs=opt("memory_bandwidth_gbs"),
        cores_per_node=opt("cores_per_node"),
        op_overhead_us=_number(d, "op_overhead_us", where, positive=False, default=0.0),
        collective_latency_us=_number(d, "collective_latency_us", where, positive=False, default=None),
        collective_bandwidth_gbs=opt("collective_bandwidth_gbs"),
        step_sync_us=_number(d, "step_sync_us", where, positive=False, default=None),
        sync_wait=_sync_wait(d.get("sync_wait"), where),
        calibration=None if "calibration" not in d else parse_calibration(d["calibration"], where),
        gpu_calibration=None if "gpu_calibration" not in d else parse_gpu_calibration(d["gpu_calibration"], where),
    )


def _sync_wait(rows: Any, where: str) -> tuple[tuple[int, float, float], ...] | None:
    if rows is None:
        return None
    ok = isinstance(rows, list) and rows and all(isinstance(r, list) and len(r) == 3 for r in rows)
    _need(ok, where, f"sync_wait must list [ranks, work_us, wait_us] rows, got {rows!r}")
    out = []
    for r in rows:
        n, w, x = r
        _need(
            isinstance(n, int) and not isinstance(n, bool) and n >= 2,
            where,
            f"sync_wait: ranks must be an integer >= 2, got {n!r}",
        )
        out.append(
            (
                n,
                _number({"work_us": w}, "work_us", where, positive=False),
                _number({"wait_us": x}, "wait_us", where, positive=False),
            )
        )
    works = [(n, w) for n, w, _ in out]
    _need(len(set(works)) == len(works), where, f"sync_wait lists a (ranks, work_us) twice: {rows!r}")
    return tuple(out)


def load_hardware(path: str | Path) -> Hardware:
    d = load_toml(str(path), "hardware file")
    return parse_hardware(d, f"hardware file {str(path)!r}")


def _value(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return repr(v)


def to_toml(hw: Hardware) -> str:
    """The TOML text `load_hardware` reads back as `hw`."""
    lines, tables = [], []
    for f in fields(Hardware):
        v = getattr(hw, f.name)
        if v is None:
            continue
        if isinstance(v, (Calibration, GpuCalibration)):
            tables.append(v.to_toml())
        elif isinstance(v, Link):
            tables.append(f"\n[{f.name}]\nbandwidth_gbs = {v.bandwidth_gbs!r}\nlatency_us = {v.latency_us!r}")
        elif isinstance(v, dict):
            tables.append(f"\n[{f.name}]\n" + "\n".join(f"{k} = {x!r}" for k, x in v.items()))
        else:
            lines.append(f"{f.name} = {_value(v)}")
    return "\n".join(lines + tables) + "\n"
