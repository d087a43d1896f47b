"""`hybridpar plan --probe` on this machine: two ranks for a few seconds, a loadable hardware file."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpar.plan.hardware import load_hardware, to_toml
from hybridpar.plan.probe import probe


@pytest.mark.multiprocess
def test_probe_writes_a_hardware_file(tmp_path: Path) -> None:
    hw = probe(2, seconds=0.05, round_trips=5)
    assert hw.nodes == 1 and hw.devices_per_node == 2 and hw.peak_flops("fp32") > 1e8
    assert 0 < hw.cores_per_node <= 2 and hw.memory_bandwidth_gbs > 0 and hw.op_overhead_us > 0
    assert hw.intra_node.latency_us > 0 and hw.intra_node.bandwidth_gbs > 0 and hw.collective_latency_us > 0
    (tmp_path / "me.toml").write_text(to_toml(hw))
    assert load_hardware(tmp_path / "me.toml") == hw


def test_probe_needs_two_ranks() -> None:
    with pytest.raises(ValueError, match="--world must be at least 2"):
        probe(1)
