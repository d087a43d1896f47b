"""Device monitor: real readings on CPU, the CUDA/NVML paths through fakes, timelines built by hand."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import FrozenInstanceError
from types import SimpleNamespace

import psutil
import pytest
import torch

from hybridpar.balance import monitor as mon
from hybridpar.balance.monitor import DeviceMonitor, PeakTracker, aggregate, stage_times
from hybridpar.pipeline.p2p import LinkStats
from hybridpar.pipeline.runtime import ActionTime
from hybridpar.pipeline.schedules import Action, Op

MiB = 1 << 20


def test_cpu_sample_is_measured() -> None:
    s = DeviceMonitor(torch.device("cpu")).sample()
    assert s.memory_used_bytes == s.host_rss_bytes > 10 * MiB  # a Python with torch loaded
    assert s.memory_peak_bytes >= s.memory_used_bytes
    assert s.memory_total_bytes == psutil.virtual_memory().total
    if sys.platform.startswith("linux"):  # ru_maxrss is in KiB there; converted to bytes
        assert s.host_maxrss_bytes >= s.memory_used_bytes * 0.5
    assert s.utilization_pct is None and s.temperature_c is None and s.power_w is None
    with pytest.raises(FrozenInstanceError):
        s.memory_used_bytes = 0  # type: ignore[misc]
    json.dumps(s.to_dict())


def test_rss_grows_with_a_large_tensor_and_peak_is_tracked() -> None:
    m = DeviceMonitor(torch.device("cpu"))
    m.reset_peak()
    before = m.sample()
    big = torch.ones(64 * MiB, dtype=torch.float32)  # 256 MiB, written so its pages are resident
    during = m.sample()
    assert during.memory_used_bytes - before.memory_used_bytes > 200 * MiB
    del big
    after = m.sample()
    assert after.memory_peak_bytes >= during.memory_used_bytes  # the peak outlives the tensor
    m.reset_peak()
    assert m.tracker.peak == m.tracker.current < during.memory_used_bytes + MiB


def test_peak_tracker_poll_keeps_the_maximum() -> None:
    t = PeakTracker()
    start = t.poll()
    x = torch.ones(32 * MiB, dtype=torch.float32)  # 128 MiB
    high = t.poll()
    del x
    t.poll()
    assert high - start > 100 * MiB and t.peak >= high


class FakeCuda:
    """Enough of torch.cuda for DeviceMonitor's CUDA branch, with known numbers."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.resets = 0
        props = SimpleNamespace(total_memory=80 * 1024 * MiB, uuid="abcd-1234")
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 3 * MiB)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 7 * MiB)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: self._reset())

    def _reset(self) -> None:
        self.resets += 1


def test_cuda_without_pynvml_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda(monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    m = DeviceMonitor(torch.device("cuda"))
    s = m.sample()
    assert (s.memory_used_bytes, s.memory_peak_bytes, s.memory_total_bytes) == (3 * MiB, 7 * MiB, 80 * 1024 * MiB)
    assert s.utilization_pct is None and s.temperature_c is None and s.power_w is None
    m.reset_peak()
    assert fake.resets == 1


def fake_pynvml(power_supported: bool = True) -> types.ModuleType:
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def power(h: str) -> int:
        if not power_supported:
            raise NVMLError("Not Supported")
        return 312_500  # mW

    def by_uuid(u: str) -> str:
        if u != "GPU-abcd-1234":
            raise NVMLError("not found")
        return "handle0"

    nv.NVMLError = NVMLError
    nv.NVML_TEMPERATURE_GPU = 0
    nv.nvmlInit = lambda: None
    nv.nvmlDeviceGetHandleByUUID = by_uuid
    nv.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=87, memory=40)
    nv.nvmlDeviceGetTemperature = lambda h, sensor: 61
    nv.nvmlDeviceGetPowerUsage = power
    return nv


def test_cuda_with_pynvml_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    s = DeviceMonitor(torch.device("cuda:0")).sample()
    assert (s.utilization_pct, s.temperature_c, s.power_w) == (87.0, 61.0, 312.5)
    # A query the device does not support is None on its own; the rest still read.
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(power_supported=False))
    s = DeviceMonitor(torch.device("cuda:0")).sample()
    assert (s.utilization_pct, s.power_w) == (87.0, None)


def test_nvml_never_guesses_another_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(monkeypatch)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=1, uuid="not-this-one")
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    assert DeviceMonitor(torch.device("cuda")).sample().utilization_pct is None


def at(stage: int, op: Op, mb: int, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(action=Action(stage, op, mb), start=start, end=end)


def test_stage_times_subtract_waits_inside_each_action() -> None:
    out = SimpleNamespace(
        loss=None,
        timeline=[
            at(1, Op.RECV_F, 1, 0.0, 0.0),
            at(1, Op.FORWARD, 1, 0.0, 1.0),  # waited 0.0-0.4 for its input
            at(1, Op.FORWARD, 0, 1.0, 1.5),  # microbatch 0 after 1: lists are by microbatch, not time
            at(1, Op.SEND_F, 0, 1.5, 1.6),
            at(1, Op.BACKWARD, 0, 2.0, 3.0),  # waited 2.0-2.25 for its gradient
            at(1, Op.BACKWARD, 1, 3.0, 3.5),
            at(1, Op.WEIGHT, 0, 3.5, 3.7),
        ],
        waits=[
            at(1, Op.RECV_F, 1, 0.0, 0.4),
            at(1, Op.RECV_B, 0, 2.0, 2.25),
            at(1, Op.RECV_B, 1, 2.9, 3.1),  # straddles B(1,1)'s start: only 0.1 s of it is inside
        ],
    )
    got = stage_times(out)
    assert set(got) == {("F", 1), ("B", 1), ("W", 1)}
    assert got[("F", 1)] == pytest.approx([0.5, 0.6])
    assert got[("B", 1)] == pytest.approx([0.75, 0.4])
    assert got[("W", 1)] == pytest.approx([0.2])
    # emulate.layer_timing=emulated: an action carrying its emulated seconds counts those, waits or not.
    out.timeline[1] = ActionTime(Action(1, Op.FORWARD, 1), 0.0, 1.0, emulated=0.25)
    out.timeline[4] = ActionTime(Action(1, Op.BACKWARD, 0), 2.0, 3.0, emulated=0.5)
    got = stage_times(out)
    assert got[("F", 1)] == pytest.approx([0.5, 0.25]) and got[("B", 1)] == pytest.approx([0.5, 0.4])


class FakeP2P:
    def __init__(self) -> None:
        self.stats = {1: LinkStats(), 3: LinkStats()}


def test_link_stats_are_deltas_since_the_last_call() -> None:
    p2p, m = FakeP2P(), DeviceMonitor(torch.device("cpu"))
    p2p.stats[1].sent_bytes, p2p.stats[1].recv_wait_s = 1000, 0.5
    first = m.link_stats(p2p)
    assert first[1]["sent_bytes"] == 1000 and first[3]["sent_bytes"] == 0
    p2p.stats[1].sent_bytes, p2p.stats[1].recv_wait_s = 1500, 0.75
    p2p.stats[3].recv_msgs = 2
    second = m.link_stats(p2p)
    assert second[1]["sent_bytes"] == 500 and second[1]["recv_wait_s"] == pytest.approx(0.25)
    assert second[3]["recv_msgs"] == 2


def test_aggregate_makes_per_rank_lists_and_record_is_json() -> None:
    m = DeviceMonitor(torch.device("cpu"))
    out = SimpleNamespace(timeline=[at(0, Op.FORWARD, 0, 0.0, 0.5)], waits=[])
    r0 = m.record(out, FakeP2P())
    r1 = {"memory_used_bytes": 5, "extra": 1}
    agg = aggregate([r0, r1])
    assert agg["ranks"] == 2
    assert agg["memory_used_bytes"] == [r0["memory_used_bytes"], 5]
    assert agg["extra"] == [None, 1] and agg["stage_times_s"] == [{"F0": [0.5]}, None]
    assert agg["links"][0]["1"]["sent_bytes"] == 0
    json.dumps(agg)


def test_maxrss_is_none_without_getrusage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "resource", None)
    assert mon._maxrss_bytes() is None


def _slowed_stage_times(cfg_dict: dict) -> dict:
    from hybridpar.config import Config
    from hybridpar.emulate.attach import emulated_devices
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    tr = Trainer(cfg, build_topology(p.dp, p.pp, p.tp, "gloo", 60))
    tr.attach(emulated_devices(cfg, tr.topo))  # as the run entry does: the slowdown is an attachment
    out = {}
    for step in range(4):
        tr.step(step)
        out[step] = tr.monitor.record(tr.last_output)["stage_times_s"]
    return out


@pytest.mark.multiprocess
def test_emulated_slow_rank_shows_longer_measured_stage_times():
    """Two data-parallel replicas run identical work; rank 1 is emulated 4x slower from step 2.
    The monitor's measured forward times must show it — and only from that step. Each compute action
    lasts an emulated cost (emulate.layer_ms, the real compute inside it): stretching the tiny model's
    own few ms instead, a rank delayed by another test's ranks on the 2 shared cores once measured more
    than the slowed one."""
    import statistics

    from test_equivalence import tiny_config

    from hybridpar.topology.spawn import run_ranks

    cfg = tiny_config(
        parallel=dict(tp=1, pp=1, dp=2, schedule="1f1b"), emulate=dict(slowdown="rank=1:4.0@step=2", layer_ms=2.0)
    )
    r0, r1 = run_ranks(_slowed_stage_times, 2, cfg.to_dict())
    med = lambda rec, step: statistics.median(rec[str(step)]["F0"] + rec[str(step)]["B0"])  # noqa: E731
    assert med(r1, 3) > 2.0 * med(r0, 3), (r0, r1)  # slowed 4x: a wide margin for noise on 2 cores
    assert med(r1, 1) < 2.0 * med(r0, 1), (r0, r1)  # not yet slowed at step 1
