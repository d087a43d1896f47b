"""`hybridpar plan --probe` on this machine: two ranks for a few seconds, a loadable hardware file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hybridpar.config import ModelConfig
from hybridpar.plan.hardware import load_hardware, to_toml
from hybridpar.plan.probe import probe


@pytest.mark.multiprocess
def test_probe_writes_a_hardware_file(tmp_path: Path) -> None:
    m = ModelConfig(dim=32, n_layers=2, n_heads=2, ffn_dim=64)
    hw = probe(2, seconds=0.05, round_trips=5, model=m, seq_len=16, shapes=[(1, 1), (2, 2)])
    cal = hw.calibration
    assert cal is not None and cal.fits(m, 16) and [(r.tp, r.tokens) for r in cal.layers] == [(1, 16), (2, 32)]
    assert [r.tokens for r in cal.ends] == [16, 32] and all(r.f > 0 and r.b > 0 for r in cal.layers)
    # tp=2 measured in place, both ranks reducing (tp=1 has nothing to reduce)
    assert [(r.tp, r.tokens) for r in cal.collectives] == [(2, 32)] and cal.collectives[0].all_reduce > 0
    assert hw.nodes == 1 and hw.devices_per_node == 2 and hw.peak_flops("fp32") > 1e8
    assert 0 < hw.cores_per_node <= 2 and hw.memory_bandwidth_gbs > 0 and hw.op_overhead_us > 0
    assert hw.intra_node.latency_us > 0 and hw.intra_node.bandwidth_gbs > 0 and hw.collective_latency_us > 0
    assert hw.step_sync_us > 0 and hw.collective_bandwidth_gbs > 0
    # one group of both ranks, after each amount of work (plan/probe.py SYNC_WAIT_WORK_S)
    assert [(n, w) for n, w, _ in hw.sync_wait] == [(2, 2000.0), (2, 50000.0)]
    assert all(x >= 0 for _, _, x in hw.sync_wait)
    (tmp_path / "me.toml").write_text(to_toml(hw))
    again = load_hardware(tmp_path / "me.toml")
    assert replace(again, calibration=None) == replace(hw, calibration=None)  # the calibration: to 0.01 us
    assert again.calibration.layers[0].f == pytest.approx(cal.layers[0].f, abs=1e-8)
    assert again.calibration.collectives[0].all_reduce == pytest.approx(cal.collectives[0].all_reduce, abs=1e-8)
    assert again.calibration.collectives[0].head == pytest.approx(cal.collectives[0].head, abs=1e-8)


def test_probe_needs_two_ranks() -> None:
    with pytest.raises(ValueError, match="--world must be at least 2"):
        probe(1)
