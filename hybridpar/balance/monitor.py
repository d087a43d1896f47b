"""Measured device state for the microbatch planner and the balancer: memory, utilisation, per-stage
compute times, per-link traffic.

Every number is read from the system; a quantity that cannot be read is None, never a placeholder.

Sources: on CUDA, torch's caching-allocator counters (exact, including the peak) and NVML through
`pynvml` (package nvidia-ml-py, optional extra `gpu`) for utilisation, temperature and power. On CPU,
psutil's resident set size of this process. The OS offers no resettable RSS high-water mark, so the
CPU peak is the maximum of the samples taken (`PeakTracker`): it is exact only at the granularity the
caller polls at (the runtime can poll once per action). `ru_maxrss` is the kernel's own lifetime
high-water mark, reported beside it as a second opinion that never resets.

`MonitorDuty` gathers every rank's reading into the step's record, as a duty of the training loop
(trainer/duty.py).
"""

from __future__ import annotations

import importlib
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Protocol, Sequence

import psutil
import torch

from hybridpar.config import Config
from hybridpar.pipeline.runtime import PipelineRuntime, StepOutput
from hybridpar.pipeline.schedules import COMPUTE_OPS, Action
from hybridpar.topology.collectives import all_gather_json
from hybridpar.topology.mesh import Topology


class MonitoredStep(Protocol):
    """What `MonitorDuty` reads of the trainer (trainer/step.py's `Trainer` has it): a protocol, so that
    balance/ stays a layer below the trainer."""

    cfg: Config
    topo: Topology
    runtime: PipelineRuntime
    last_output: StepOutput
    monitor: DeviceMonitor
    p2p: Any  # pipeline/p2p.py's P2P: its per-link statistics
    memory: dict[str, int]
    policy: Any  # batching/policy.py's microbatch policy: its statistics()


@dataclass(frozen=True)
class DeviceSample:
    """One reading of one rank's device. Bytes are bytes; None means 'not measurable here'."""

    device: str
    time_s: float  # wall clock (time.time), so samples from different ranks line up in metrics.jsonl
    memory_used_bytes: int  # CUDA: allocated by torch; CPU: this process's RSS
    memory_peak_bytes: int  # CUDA: max allocated since reset_peak(); CPU: max RSS seen by the tracker
    memory_total_bytes: int  # CUDA: device memory; CPU: physical memory of the machine
    host_rss_bytes: int  # this process's RSS, on every device (host-side leaks show here)
    host_maxrss_bytes: int | None  # ru_maxrss: lifetime high-water mark; None where getrusage is absent
    utilization_pct: float | None  # NVML: % of the last sample period in which a kernel ran
    temperature_c: float | None
    power_w: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _maxrss_bytes() -> int | None:
    try:
        import resource  # absent on Windows
    except ImportError:
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # getrusage(2): Linux reports KiB, macOS bytes.
    if sys.platform.startswith("linux"):
        return rss * 1024
    return rss if sys.platform == "darwin" else None


class PeakTracker:
    """Running maximum of this process's RSS. `poll()` is one read of /proc/self/statm through psutil
    (microseconds), cheap enough to call after every pipeline action."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self.current = self._proc.memory_info().rss
        self.peak = self.current

    def poll(self) -> int:
        self.current = self._proc.memory_info().rss
        if self.current > self.peak:
            self.peak = self.current
        return self.current

    def reset(self) -> None:
        self.peak = self.poll()


class _Nvml:
    """NVML handle for one CUDA device, or nothing at all (every reading None)."""

    def __init__(self, index: int) -> None:
        self.lib: Any = None
        self.handle: Any = None
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            return
        try:
            nvml.nvmlInit()
            self.handle = self._find(nvml, index)
        except Exception:  # no driver, no permission, old library: the readings stay None
            self.handle = None
        if self.handle is not None:
            self.lib = nvml

    @staticmethod
    def _find(nvml: Any, index: int) -> Any:
        # torch's index is relative to CUDA_VISIBLE_DEVICES and NVML's is not, so the device is found
        # by identity (UUID, then PCI address). Never guess by index: it would report another GPU.
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            try:
                return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            except Exception:
                pass
        if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            try:
                return nvml.nvmlDeviceGetHandleByPciBusId(bus)
            except Exception:
                pass
        return None

    def read(self) -> tuple[float | None, float | None, float | None]:
        if self.lib is None:
            return None, None, None
        nvml, h = self.lib, self.handle

        def get(fn: Any) -> float | None:
            try:  # each query may be unsupported on its own (MIG slices have no utilisation)
                return float(fn())
            except nvml.NVMLError:
                return None

        util = get(lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu)
        temp = get(lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
        power_mw = get(lambda: nvml.nvmlDeviceGetPowerUsage(h))
        return util, temp, None if power_mw is None else power_mw / 1000.0


class _HasLinkStats(Protocol):
    stats: Mapping[int, Any]  # peer -> LinkStats (pipeline/p2p.py)


class DeviceMonitor:
    """Readings of one rank's device. The trainer calls `reset_peak()` before a step and `sample()`
    (plus `stage_times`, `link_stats`) after it, so each sample's peak belongs to that step."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.index = (
            (self.device.index if self.device.index is not None else torch.cuda.current_device()) if self.cuda else None
        )
        self.tracker = PeakTracker()
        self._nvml = _Nvml(self.index) if self.cuda else None
        self._links: dict[int, dict[str, float]] = {}

    def sample(self) -> DeviceSample:
        rss = self.tracker.poll()
        if self.cuda:
            used = torch.cuda.memory_allocated(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            util, temp, power = self._nvml.read() if self._nvml is not None else (None, None, None)
        else:
            used, peak, total = rss, self.tracker.peak, psutil.virtual_memory().total
            util = temp = power = None  # no CPU counterpart is measured; never invented
        return DeviceSample(
            str(self.device),
            time.time(),
            int(used),
            int(peak),
            int(total),
            int(rss),
            _maxrss_bytes(),
            util,
            temp,
            power,
        )

    def reset_peak(self) -> None:
        """Start a new peak window. ru_maxrss cannot be reset: it stays the lifetime maximum."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.tracker.reset()

    def link_stats(self, p2p: _HasLinkStats) -> dict[int, dict[str, float]]:
        """Per-peer P2P counters accumulated since the previous call (the counters only ever grow)."""
        out: dict[int, dict[str, float]] = {}
        for peer, st in sorted(p2p.stats.items()):
            now = st.to_dict()
            before = self._links.get(peer, {})
            out[peer] = {k: v - before.get(k, 0) for k, v in now.items()}
            self._links[peer] = now
        return out

    def record(self, step_output: Any = None, p2p: _HasLinkStats | None = None) -> dict[str, Any]:
        """This rank's JSON-ready record for one step: the sample, stage times keyed "F0", links."""
        rec = self.sample().to_dict()
        if step_output is not None:
            rec["stage_times_s"] = {f"{op}{s}": t for (op, s), t in sorted(stage_times(step_output).items())}
        if p2p is not None:
            rec["links"] = {str(peer): d for peer, d in self.link_stats(p2p).items()}
        return rec


class _Timed(Protocol):
    action: Action
    start: float
    end: float


def stage_times(step_output: Any) -> dict[tuple[str, int], list[float]]:
    """Compute seconds of each (op, stage) per microbatch (list index = microbatch order), from
    `StepOutput.timeline`, minus the time the action spent blocked on a message (`waits`, recorded
    inside the F/B action that waited) — what remains is the stage's own cost, which is what the
    balancer and the simulator need; the waits are the bubble and the link. An action that carries its
    emulated seconds (`emulate.layer_timing=emulated`, pipeline/runtime.py) counts those instead."""
    timeline: Sequence[_Timed] = step_output.timeline
    waits: Sequence[_Timed] = step_output.waits
    by_key: dict[tuple[int, int], list[_Timed]] = {}
    for w in waits:
        by_key.setdefault((w.action.stage, w.action.microbatch), []).append(w)
    per: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for t in timeline:
        a = t.action
        if a.op not in COMPUTE_OPS:
            continue
        # Clip each wait to the action's interval: only the overlap belongs to this action (F and B
        # of one microbatch share the key, their waits fall in different intervals).
        blocked = sum(
            max(0.0, min(w.end, t.end) - max(w.start, t.start)) for w in by_key.get((a.stage, a.microbatch), ())
        )
        took = max(0.0, t.end - t.start - blocked)
        # An emulated cost read as such (emulate.layer_timing=emulated): what the emulated device takes.
        took = took if getattr(t, "emulated", None) is None else t.emulated
        per.setdefault((a.op.value, a.stage), []).append((a.microbatch, took))
    return {k: [d for _, d in sorted(v)] for k, v in per.items()}


def aggregate(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-rank records (in rank order, e.g. from all_gather_object) -> one metrics.jsonl record whose
    every field is a list indexed by rank; a field a rank lacks is None there."""
    keys: list[str] = []
    for s in samples:
        keys.extend(k for k in s if k not in keys)
    out: dict[str, Any] = {"ranks": len(samples)}
    for k in keys:
        out[k] = [s.get(k) for s in samples]
    return out


class MonitorDuty:
    """Collective, every train.monitor_every steps: every rank's device reading, link traffic, stage times
    and memory at the step's peak, as one field per rank in the step's record, with the microbatch
    policy's statistics; then the peak counters start again."""

    def __init__(self, trainer: MonitoredStep) -> None:
        self.trainer, self.every = trainer, trainer.cfg.train.monitor_every

    def begin(self, step: int) -> None:
        pass

    def after_step(self, step: int, rec: dict[str, Any]) -> bool:
        if not (self.every and (step + 1) % self.every == 0):
            return False
        tr = self.trainer
        mine = tr.monitor.record(tr.last_output, tr.p2p)
        mine["activation_peak_bytes"] = tr.runtime.meter.peak  # this rank's, for this step
        mine["memory"] = tr.memory  # bytes per component at the step's peak (trainer/held.py)
        rec["monitor"] = aggregate(all_gather_json(mine, tr.topo.device))
        rec["batching"] = tr.policy.statistics()
        tr.monitor.reset_peak()
        return False

    def finish(self) -> None:
        pass
