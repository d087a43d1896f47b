"""The GPU probe (plan/gpu_probe.py) and its matmul table (plan/matmul_table.py), without CUDA: the table read
between its grid points (exact at them, log-linear between neighbours, clamped outside), refused with the row or
the missing shapes named, written and read back and used by the cost model; the measuring functions' fractions
are their measured rates over the given peak; `plan --probe` refuses the combinations it cannot run."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from hybridpar.config import Config
from hybridpar.plan import gpu_probe
from hybridpar.plan.cost import CostModel
from hybridpar.plan.gpu_model import Rates, parse_gpu_calibration
from hybridpar.plan.hardware import load_hardware, to_toml
from hybridpar.plan.main import run
from hybridpar.plan.matmul_table import MatmulTable, parse_matmul_table
from hybridpar.plan.step import predict
from tests.test_plan_gpu_model import table as calibration

ROOT = Path(__file__).parents[1]
H100 = ROOT / "docs" / "hardware" / "dgx-h100.toml"
GRID = (256, 1024, 4096)


def grid_rows(f=lambda m, n, k: 0.1 + 0.2 * math.log2(m) / 12 + 0.3 * math.log2(n) / 12 + 0.1 * math.log2(k) / 12):
    return [[m, n, k, f(m, n, k)] for m in GRID for n in GRID for k in GRID]


def fake_one_gpu(monkeypatch: pytest.MonkeyPatch, name: str, sizes: tuple[int, ...]) -> None:
    """One CUDA device named `name` as the probe sees it, its measurements run on the CPU at tiny sizes (GEMM
    grid `sizes`): the branches of a CUDA host that the CPU lanes cannot otherwise take."""
    import torch

    real = gpu_probe.calibrate_gpu
    tiny = dict(elements=4096, seqs=(16,), tokens=32, heads=2, head_dim=16, repeats=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(
        gpu_probe,
        "calibrate_gpu",
        lambda hw, device, dtype, gpus: real(hw, torch.device("cpu"), dtype, gpus, sizes, tiny),
    )


def test_table_is_exact_at_grid_points_log_linear_between_and_clamped_outside() -> None:
    rows = grid_rows()
    t = parse_matmul_table(rows, "t")
    assert all(t.fraction(m, n, k) == pytest.approx(f, rel=1e-12) for m, n, k, f in rows)
    # 512 is halfway between 256 and 1024 in log m: the two neighbours' mean (the rows are linear in log2 m)
    assert t.fraction(512, 1024, 4096) == pytest.approx(
        (t.fraction(256, 1024, 4096) + t.fraction(1024, 1024, 4096)) / 2
    )
    lo, hi = t.fraction(256, 256, 256), t.fraction(4096, 4096, 4096)
    assert lo < t.fraction(700, 300, 2000) < hi
    assert t.fraction(1, 2, 3) == lo and t.fraction(1e6, 1e7, 1e5) == hi  # clamped, not extrapolated
    assert t.fraction(300, 100, 4096) == t.fraction(300, 256, 4096)  # one coordinate clamped, the others read
    assert t.best() == pytest.approx(max(r[3] for r in rows))


def test_rates_read_a_gemm_from_the_table() -> None:
    t = parse_matmul_table(grid_rows(), "t")
    peak = 1e15
    r = Rates(flops=peak * t.best(), memory_bps=1e12, elem_bytes=2, table=t)
    for m, n, k in ((256, 256, 256), (2048, 700, 4096), (8192, 8192, 8192)):
        assert r.gemm_s(m, n, k) == pytest.approx(2.0 * m * n * k / (peak * t.fraction(m, n, k)))


@pytest.mark.parametrize(
    "rows, words",
    [
        ([], "must be a non-empty list of [m, n, k, fraction] rows"),
        ([[256, 256, 0.5]], "rows must be [m, n, k, fraction]"),
        ([[256, 256.0, 256, 0.5]], "m, n, k positive integers, got [256, 256.0, 256, 0.5]"),
        ([[256, 256, 256, 1.5]], "row [256, 256, 256, 1.5]: the fraction must be in (0, 1]"),
        ([[256, 256, 256, 0]], "the fraction must be in (0, 1]"),
        ([[256, 256, 256, 0.5], [256, 256, 256, 0.4]], "lists a shape twice: (256, 256, 256)"),
        (
            grid_rows()[:-1],
            "must be a full grid (every m of [256, 1024, 4096] with every n of [256, 1024, 4096] "
            "and every k of [256, 1024, 4096]); missing [4096, 4096, 4096]",
        ),
    ],
)
def test_bad_tables_are_refused_naming_what_is_wrong(rows, words) -> None:
    with pytest.raises(ValueError, match=r"^t: matmul_table ") as e:
        parse_matmul_table(rows, "t")
    assert words in str(e.value)


def test_matmul_fraction_must_be_the_tables_best() -> None:
    rows = grid_rows()
    best = max(r[3] for r in rows)
    assert parse_gpu_calibration({**calibration(), "matmul_fraction": best, "matmul_table": rows}, "f").matmul_table
    with pytest.raises(ValueError, match=r"matmul_fraction must be matmul_table's best fraction .* got 0.8$"):
        parse_gpu_calibration({**calibration(), "matmul_table": rows}, "f")


def test_measured_fractions_are_the_rates_over_the_given_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    calls = []
    monkeypatch.setattr(gpu_probe, "seconds", lambda fn, device, repeats=1, target_s=0: (calls.append(fn()), 0.5)[1])
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert gpu_probe.gemm_fraction(8, 16, 32, 1e9, cpu, bf16) == pytest.approx(2 * 8 * 16 * 32 / 0.5 / 1e9)
    assert gpu_probe.memory_fraction(64, 1e6, cpu, bf16) == pytest.approx(3 * 64 * 2 / 0.5 / 1e6)
    att, kernel = gpu_probe.attention_fractions((8, 16), 32, 2, 8, 1e9, cpu, bf16)
    assert att == [(s, pytest.approx(gpu_probe.attention_flops(32 // s, 2, s, 8) / 0.5 / 1e9)) for s in (8, 16)]
    assert kernel in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
    # forward QK^T and PV over the causal half, backward 2.5 forwards: 3.5 forwards in all
    assert gpu_probe.attention_flops(1, 1, 4, 2) == 4 * 16 * 2 / 2 * 3.5
    assert len(calls) == 4 and gpu_probe.bus_bandwidth(1000, 4, 1.0) == 1500.0  # busbw = algbw x 2 (n - 1) / n


def test_kernel_figures_on_cpu_are_eager_and_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU, host and device are one: the floor is the eager add timed by `seconds` (dispatch and run together),
    and the dispatch figure is the host's clock around a batch over its calls. Both measured for real too."""
    import torch

    cpu = torch.device("cpu")
    floor, dispatch = gpu_probe.kernel_floor_s(cpu, 20, 2), gpu_probe.dispatch_s(cpu, 20, 2)
    assert 0 < floor < 1e-3 and 0 < dispatch < 1e-3  # a 1-element add: microseconds, not milliseconds
    monkeypatch.setattr(gpu_probe, "seconds", lambda fn, device, repeats=1, target_s=0: (fn(), 0.25)[1])
    assert gpu_probe.kernel_floor_s(cpu, 20, 2) == 0.25
    ticks = iter(range(0, 1000, 10))  # each reading of the clock 10 s later: a batch of 5 calls takes 10 s
    monkeypatch.setattr(gpu_probe.time, "perf_counter", lambda: next(ticks))
    assert gpu_probe.dispatch_s(cpu, 5, 3) == 2.0


def test_probe_output_round_trips_and_drives_the_cost_model(tmp_path: Path) -> None:
    """The whole measurement on CPU with tiny sizes (the plumbing: its numbers are a CPU's, not a GPU's), the
    file written as `plan --probe --out` writes it, read back, and a GEMM costed from its table."""
    import torch

    hw = load_hardware(H100)
    facts = dict(overlap=("tp_comm",), tp_comm_efficiency=0.2)  # the software's, kept with the others
    hw = dataclasses.replace(hw, gpu_calibration=dataclasses.replace(hw.gpu_calibration, **facts))
    tiny = dict(elements=4096, seqs=(16, 32), tokens=64, heads=2, head_dim=16, repeats=1)
    cal, figures = gpu_probe.calibrate_gpu(hw, torch.device("cpu"), torch.bfloat16, 1, (8, 16), tiny)
    assert cal.matmul_fraction == max(r[3] for r in cal.matmul_table.rows) and len(cal.matmul_table.rows) == 8
    assert cal.attention_fraction == max(f for _, f in figures["attention"])
    assert (cal.intra_bus_fraction, cal.inter_bus_fraction) == (0.8, 0.9)  # kept: one device, one node
    assert cal.grad_accumulation == "separate" and "kept from the datasheet file" in cal.source
    assert (cal.overlap, cal.tp_comm_efficiency) == (("tp_comm",), 0.2)
    assert (cal.kernel_floor_us, cal.dispatch_us) == (figures["kernel_floor_us"], figures["dispatch_us"])
    assert cal.kernel_floor_us > 0 and cal.dispatch_us > 0 and "adds on the host clock" in cal.source
    path = tmp_path / "probed.toml"
    path.write_text(to_toml(dataclasses.replace(hw, gpu_calibration=cal)))
    back = load_hardware(path)
    assert back.gpu_calibration == cal and back.peak_tflops == hw.peak_tflops
    rates = back.gpu_rates("bf16")
    assert rates.gemm_s(8, 16, 8) == pytest.approx(2 * 8 * 16 * 8 / (989e12 * cal.matmul_table.fraction(8, 16, 8)))
    cfg = Config()
    cfg.train.precision = "bf16"
    assert predict(CostModel(cfg.model, back), cfg).step_s > predict(CostModel(cfg.model, hw), cfg).step_s


def test_a_kernel_figure_that_fails_leaves_the_rest_of_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel figures are optional (absent: none priced): a failure to measure them keeps the GEMM table and
    the fractions, writes no figure and says why in the source."""
    import torch

    def fails(*_a, **_k):
        raise RuntimeError("kernel_floor_s: the host took longer to queue 500 adds than a hold of 1 cycles")

    monkeypatch.setattr(gpu_probe, "kernel_floor_s", fails)
    tiny = dict(elements=4096, seqs=(16,), tokens=32, heads=2, head_dim=16, repeats=1)
    cal, figures = gpu_probe.calibrate_gpu(load_hardware(H100), torch.device("cpu"), torch.bfloat16, 1, (8,), tiny)
    assert cal.matmul_table is not None and len(cal.matmul_table.rows) == 1 and cal.memory_fraction > 0
    assert (cal.kernel_floor_us, cal.dispatch_us) == (0.0, 0.0) and "kernel_floor_us =" not in cal.to_toml()
    assert figures["kernel_figures_failed"].startswith("RuntimeError: kernel_floor_s: the host took longer")
    assert "kernel_floor_us, dispatch_us: not measured, no kernel priced (RuntimeError: " in cal.source


def test_plan_probe_with_a_datasheet_writes_the_probed_file_and_plans_on_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`plan --probe --hardware FILE --out OUT` as on a CUDA host, the device and sizes swapped for CPU ones."""
    fake_one_gpu(monkeypatch, "a CPU standing in", (8, 16))
    out = tmp_path / "probed.toml"
    result, hw, _ = run(["--probe", "--hardware", str(H100), "--out", str(out), "--world", "1", "--top", "1"])
    assert load_hardware(out) == hw and hw.gpu_calibration.matmul_table is not None and result.candidates
    assert re.fullmatch(
        r"hybridpar plan: probed in \d+ s: matmul_fraction \S+ \(at \(\d+, \d+, \d+\)\), memory_fraction \S+, "
        r"attention_fraction \S+ \(\w+\), intra_bus_fraction 0.800 \(kept: one GPU\), "
        r"kernel_floor_us \d+\.\d\d, dispatch_us \d+\.\d\d\n",
        capsys.readouterr().err,
    )


def test_plan_probe_refuses_what_it_cannot_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import hybridpar.plan.main as plan_main

    with pytest.raises(ValueError, match=r"^needs --hardware FILE .* or --probe"):
        run([])
    with pytest.raises(ValueError, match=r"^--out writes a probed hardware file: it needs --probe$"):
        run(["--hardware", str(H100), "--out", str(tmp_path / "x.toml")])
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"sees none here: on a CPU host run --probe without --hardware$"):
        run(["--probe", "--hardware", str(H100)])
    monkeypatch.setattr(plan_main, "_has_cuda", lambda: True)
    with pytest.raises(ValueError, match=r"^this host has CUDA GPUs: .* --probe --hardware DATASHEET.toml"):
        run(["--probe"])
    no_bw = tmp_path / "no_bw.toml"
    no_bw.write_text("\n".join(x for x in H100.read_text().splitlines() if not x.startswith("memory_bandwidth_gbs")))
    with pytest.raises(ValueError, match=r"no_bw.toml'?: a GPU probe needs the datasheet's memory_bandwidth_gbs"):
        run(["--probe", "--hardware", str(no_bw)])


def test_a_fraction_above_one_names_the_datasheet_figure() -> None:
    rows = tuple((m, n, k, 0.5) for m in (1, 2) for n in (1, 2) for k in (1, 2))
    cal = parse_gpu_calibration({**calibration(), "matmul_fraction": 0.5}, "f")
    gpu_probe.check_measured(dataclasses.replace(cal, matmul_table=MatmulTable(rows)), "f", "GPU")
    fast = MatmulTable(rows[:-1] + ((2, 2, 2, 1.2),))
    with pytest.raises(ValueError, match=r"^f: measured matmul_table row \[2, 2, 2\] 1.200 > 1 on GPU: the file's "):
        gpu_probe.check_measured(dataclasses.replace(cal, matmul_table=fast), "f", "GPU")
    with pytest.raises(ValueError, match=r"memory_fraction 1.100 > 1 on GPU: the file's memory_bandwidth_gbs is below"):
        gpu_probe.check_measured(
            dataclasses.replace(cal, matmul_table=MatmulTable(rows), memory_fraction=1.1), "f", "GPU"
        )


def test_table_toml_is_what_the_parser_reads() -> None:
    import tomllib

    t = MatmulTable(tuple((m, n, k, 0.5) for m in (1, 2) for n in (1, 2) for k in (1, 2)))
    assert parse_matmul_table(tomllib.loads(t.to_toml())["matmul_table"], "t") == t
