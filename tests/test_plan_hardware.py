"""Hardware descriptions (plan/hardware.py): the example files load, round-trip, and bad files are refused
with one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpar.plan.hardware import load_hardware, parse_hardware, to_toml

EXAMPLES = sorted((Path(__file__).parents[1] / "docs" / "hardware").glob("*.toml"))


def good() -> dict:
    return {
        "name": "test box",
        "source": "made up for a test",
        "nodes": 2,
        "devices_per_node": 4,
        "device_memory_gib": 16.0,
        "peak_tflops": {"fp32": 10.0, "bf16": 100.0},
        "intra_node": {"bandwidth_gbs": 100.0, "latency_us": 2.0},
        "inter_node": {"bandwidth_gbs": 10.0, "latency_us": 10.0},
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load_and_round_trip(path: Path, tmp_path: Path) -> None:
    hw = load_hardware(path)
    assert hw.devices == hw.nodes * hw.devices_per_node and "datasheet" in hw.source
    (tmp_path / "again.toml").write_text(to_toml(hw))
    assert load_hardware(tmp_path / "again.toml") == hw


def test_examples_exist() -> None:
    assert len(EXAMPLES) >= 2


def test_optional_keys_round_trip(tmp_path: Path) -> None:
    d = good() | {
        "speed": [1.0] * 7 + [0.5],
        "memory_bandwidth_gbs": 900.0,
        "cores_per_node": 1.5,
        "op_overhead_us": 4.0,
        "collective_latency_us": 30.0,
        "sync_wait": [[2, 2000.0, 500.0], [2, 20000.0, 5000.0], [4, 20000.0, 9000.0]],
    }
    hw = parse_hardware(d)
    assert hw.device_speed(7) == 0.5 and hw.device_speed(0) == 1.0 and hw.precisions() == ("fp32", "bf16")
    (tmp_path / "h.toml").write_text(to_toml(hw))
    assert load_hardware(tmp_path / "h.toml") == hw


def test_ranks_fill_the_cores_only_on_hosts_that_say_how_many_they_have() -> None:
    assert not parse_hardware(good()).fills_cores(8)  # GPUs: no cores_per_node
    cpu = lambda cores: parse_hardware(good() | {"cores_per_node": cores})  # noqa: E731  (4 ranks a node)
    assert cpu(1.96).fills_cores(2) and cpu(2.05).fills_cores(2) and cpu(1.96).fills_cores(8)
    assert not cpu(1.96).fills_cores(1) and not cpu(7.7).fills_cores(4) and not cpu(7.7).fills_cores(8)


def test_sync_wait_reads_between_measured_works_and_holds_beyond() -> None:
    hw = parse_hardware(good() | {"sync_wait": [[2, 2000.0, 500.0], [2, 20000.0, 5000.0], [4, 20000.0, 9000.0]]})
    assert hw.sync_wait_s(2, 11e-3) == pytest.approx(2.75e-3)  # halfway between the two works
    assert hw.sync_wait_s(2, 1e-3) == pytest.approx(0.5e-3) and hw.sync_wait_s(2, 1.0) == pytest.approx(5e-3)
    assert hw.sync_wait_s(4, 1e-3) == pytest.approx(9e-3)  # one row at 4 ranks: flat
    assert hw.sync_wait_s(8, 20e-3) == pytest.approx(9e-3)  # 8 ranks: the nearest size measured
    assert hw.sync_wait_s(3, 20e-3) == pytest.approx(5e-3)  # as near to 2 as to 4: the smaller
    assert hw.sync_wait_s(1, 1.0) == 0.0 and parse_hardware(good()).sync_wait_s(2, 1.0) == 0.0


@pytest.mark.parametrize(
    "change, words",
    [
        ({"nodes": 0}, "nodes must be a positive integer"),
        ({"devices_per_node": None}, "missing key 'devices_per_node' (a positive integer)"),
        ({"device_memory_gib": -1}, "device_memory_gib must be a number > 0"),
        ({"peak_tflops": {"fp32": 10.0}}, "[peak_tflops] needs bf16"),
        ({"peak_tflops": {"fp32": 1.0, "bf16": 2.0, "fp8": 3.0}}, "unknown precision(s) in [peak_tflops]: fp8"),
        ({"intra_node": {"bandwidth_gbs": 0, "latency_us": 1.0}}, "[intra_node]: bandwidth_gbs must be a number > 0"),
        ({"inter_node": None}, "missing table [inter_node]"),
        ({"speed": [1.0, 2.0]}, "speed must list one factor per device (nodes x devices_per_node = 8)"),
        ({"colour": "red"}, "unknown key(s) colour"),
        ({"name": ""}, "name must be a non-empty string"),
        ({"sync_wait": [[2, 1000.0]]}, "sync_wait must list [ranks, work_us, wait_us] rows"),
        ({"sync_wait": [[1, 1000.0, 5.0]]}, "sync_wait: ranks must be an integer >= 2, got 1"),
        ({"sync_wait": [[2, 1000.0, -5.0]]}, "wait_us must be a number >= 0, got -5.0"),
        ({"sync_wait": [[2, 1e3, 5.0], [2, 1e3, 6.0]]}, "sync_wait lists a (ranks, work_us) twice"),
    ],
)
def test_bad_files_name_the_key(change: dict, words: str) -> None:
    d = {k: v for k, v in (good() | change).items() if v is not None}
    with pytest.raises(ValueError) as e:
        parse_hardware(d, "hardware file 'x.toml'")
    assert words in str(e.value) and str(e.value).startswith("hardware file 'x.toml'") and "\n" not in str(e.value)


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read hardware file"):
        load_hardware(tmp_path / "none.toml")
    (tmp_path / "bad.toml").write_text("nodes = = 1")
    with pytest.raises(ValueError, match="is not valid TOML"):
        load_hardware(tmp_path / "bad.toml")
