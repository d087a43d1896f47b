"""The GPU check (scripts/gpu_check.sh): its --dry-run runs every check on CPU processes over gloo and prints
one JSON summary with real figures; the layouts it plans per GPU count, and a summary that names a
check's timeout."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybridpar.bench.gpu_check import equivalence_layouts, main, mfu_option
from hybridpar.bench.gpu_predict import datasheet_for
from hybridpar.plan.hardware import load_hardware

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_dry_run_passes_with_figures(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = ["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run", "--python", sys.executable, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)  # the one JSON summary is all the script prints on stdout
    assert out == json.loads((tmp_path / "summary.json").read_text())
    assert out["dry_run"] and out["passed"] and list(out["checks"]) == ["env", "equivalence", "pipeline", "mfu"]
    eq = out["checks"]["equivalence"]
    assert [r["layout"] for r in eq["layouts"]] == [
        "tp1 pp1 dp1 fp32",
        "tp1 pp1 dp1 bf16",
        "tp2 pp1 dp1 fp32",
        "tp1 pp2 dp1 fp32",
        "tp1 pp1 dp2 fp32",
    ]
    for r in eq["layouts"]:
        print(f"fp64 criterion gpu_check {r['layout']}: worst margin {r['worst_fp64_margin']:.3f}")  # shown by -s
        assert r["passed"] and 0 <= r["max_loss_diff"] and math.isfinite(r["max_param_diff"]), r
        if r["layout"].endswith("fp32"):  # fp32 runs that sum in another order differ by up to 3e-5 (DESIGN.md)
            assert r["max_param_diff"] < 1e-4, r
    pipe = out["checks"]["pipeline"]
    assert pipe["backend"] == "gloo" and pipe["ratio"] > 0 and pipe["loss_rel_diff"] <= 1e-5
    mfu = out["checks"]["mfu"]
    assert [r["option"] for r in mfu["options"]] == ["eager", "copies"] and mfu["steps_timed"] == 2
    for r in mfu["options"]:
        assert r["tokens_per_s"] > 0 and r["mfu"] > 0 and r["peak"]["device"] == "cpu", r
        assert r["attention_kernel"] in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"), r
    copies = mfu["options"][1]
    assert copies["train"] == {"bf16_weights": "copies"} and 0 < copies["loss_max_rel_diff"] < 2**-7, copies
    assert mfu["best"] in ("eager", "copies") and mfu["mfu"] == max(r["mfu"] for r in mfu["options"])
    # the GPU probe's plumbing on CPU (bench/gpu_predict.py): the probed file is a hardware file, the planner's
    # prediction of the eager step on it beside the eager step measured
    probe = mfu["probe"]
    assert load_hardware(probe["probed_file"]).gpu_calibration.matmul_table is not None, probe
    assert probe["datasheet"] == "docs/hardware/dgx-h100.toml" and probe["calibration"]["attention_kernel"] == "flash"
    # as if there were two GPUs: the all-reduce bus bandwidth measured over two gloo ranks
    assert probe["calibration"]["intra_bus_measured_over_gpus"] == 2 and probe["calibration"]["intra_bus_fraction"] > 0
    assert probe["measured_step_s"] == mfu["options"][0]["step_time_s"] and probe["predicted_step_s"] > 0
    # the kernel figures measured (on CPU: eagerly) and priced: the prediction without them is shorter
    assert probe["calibration"]["kernel_floor_us"] > 0 and probe["calibration"]["dispatch_us"] > 0
    assert probe["predicted_step_s_without_kernel_figures"] < probe["predicted_step_s"]
    assert probe["measured_over_predicted"] == probe["measured_step_s"] / probe["predicted_step_s"]


@pytest.mark.multiprocess
def test_bad_option_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), "--dryrun"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "gpu_check.sh: unknown option --dryrun (options: --dry-run, --no-setup, --python PY, --out DIR, "
        "--checks LIST, --mfu-options LIST)"
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), "--checks", "mfu,speed"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "gpu_check.sh: unknown check speed in --checks (checks: env, equivalence, pipeline, mfu)"
    )


def test_mfu_options_parse_and_name_a_bad_part() -> None:
    assert mfu_option("eager") == {} and mfu_option("compile+copies+m1") == {
        "compile": True,
        "bf16_weights": "copies",
        "microbatches": 1,
    }
    assert mfu_option("unfused") == {"fused_adamw": "off"}
    with pytest.raises(ValueError, match=r"unknown part 'fast' \(parts: eager, compile, copies, unfused, m1"):
        mfu_option("compile+fast")


def test_the_probe_picks_the_datasheet_by_device_name() -> None:
    assert datasheet_for("NVIDIA H100 80GB HBM3").name == "dgx-h100.toml"
    assert datasheet_for("NVIDIA H200").name == "dgx-h200.toml"
    for other in ("NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB"):
        with pytest.raises(ValueError, match=rf"^no datasheet file for '{other}': .* --probe --hardware FILE"):
            datasheet_for(other)


def test_layouts_fit_the_gpus() -> None:
    assert equivalence_layouts(1) == [(1, 1, 1, "fp32"), (1, 1, 1, "bf16")]
    assert [lay[:3] for lay in equivalence_layouts(8)][2:] == [(2, 1, 1), (1, 2, 1), (1, 1, 2)]


def test_summary_names_a_timeout_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "env.json").write_text(json.dumps({"passed": True}))
    (tmp_path / "mfu.log").write_text("step 1\nstep 2\n")
    rc = ["--rc", "setup=0", "--rc", "env=0", "--rc", "mfu=124"]
    assert main(["summary", "--dir", str(tmp_path), *rc]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["passed"] and out["checks"]["setup"] == {"passed": True, "exit_code": 0}
    assert out["checks"]["mfu"] == {"passed": False, "error": "timed out", "log_tail": ["step 1", "step 2"]}
    assert out["checks"]["equivalence"]["error"] == "not run"
    # a subset run (--checks) is summed up over the checks it ran only
    assert main(["summary", "--dir", str(tmp_path), "--checks", "env", "--rc", "env=0"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "dry_run": False,
        "checks": {"env": {"passed": True}},
        "passed": True,
    }


def test_mfu_writes_each_piece_as_it_finishes_within_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The one GPU call must return what finished even if it is killed: the probe's figures are on disk before
    the first option runs, each row as soon as it ran; an option that times out is its row, and one that no
    longer fits the budget is not started (runs faked here, the clock too: no process, no waiting)."""
    from hybridpar.bench import gpu_check

    out, now, seen = tmp_path / "mfu.json", [0.0], []

    def run(a: Any, option: str, steps: int, timeout_s: float) -> dict:
        seen.append((option, timeout_s, json.loads(out.read_text())))  # the file as this run starts
        now[0] += {"eager": 30.0, "copies": 30.0}.get(option, 300.0)
        if option == "compile":
            raise TimeoutError(f"ranks [0] of 1 still running after {timeout_s:.0f} s: killed")
        return {"option": option, "mfu": 0.3 if option == "eager" else 0.4, "tokens_per_s": 1.0, "losses": [2.0, 1.0]}

    def probe(a: Any) -> dict:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    monkeypatch.setattr(gpu_check, "probe", probe)  # CUDA failing in the probe: the options still run
    monkeypatch.setattr(gpu_check, "_mfu_run", run)
    a = argparse.Namespace(dry_run=False, out=str(out), options="eager,copies,compile,compile+copies")
    a.budget_s, a.recompute = 400.0, "none"
    res = gpu_check.check_mfu(a, clock=lambda: now[0])
    assert [(o, t) for o, t, _ in seen] == [("eager", 120.0), ("copies", 120.0), ("compile", 240.0)]
    assert seen[0][2]["probe"] == {"error": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    assert seen[0][2]["options"] == []
    assert [r["option"] for r in seen[2][2]["options"]] == ["eager", "copies"] and not seen[2][2]["complete"]
    rows = {r["option"]: r for r in res["options"]}
    assert rows["compile"]["error"] == "TimeoutError: ranks [0] of 1 still running after 240 s: killed"
    assert rows["compile+copies"]["error"] == "not run: 40 s of --budget-s 400 left, under the 60 s it needs"
    assert res["complete"] and not res["passed"] and res["best"] == "copies" and res["mfu"] == 0.4
    assert json.loads(out.read_text()) == res
    assert gpu_check.said(MemoryError()) == "MemoryError: "  # an error without a message is a row too
    # Killed before the end: the summary keeps the finished rows and says why the check failed.
    (tmp_path / "mfu.json").write_text(json.dumps({**seen[2][2], "passed": True}))
    capsys.readouterr()
    assert main(["summary", "--dir", str(tmp_path), "--checks", "mfu", "--rc", "mfu=124"]) == 0
    mfu = json.loads(capsys.readouterr().out)["checks"]["mfu"]
    assert not mfu["passed"] and mfu["error"] == "timed out: the figures that finished before"
    assert [r["option"] for r in mfu["options"]] == ["eager", "copies"]


def test_the_mfu_probe_on_a_cuda_host_writes_the_probed_file_and_predicts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mfu check's probe as on one H100 (the branch --dry-run does not take): the datasheet picked by the
    device's name, no all-reduce with one GPU (the file's bus fraction kept), the probed file written, and the
    prediction read back from it beside the measured step (the device and sizes swapped for tiny CPU ones)."""
    from hybridpar.bench import gpu_check, gpu_predict
    from tests.test_gpu_probe import fake_one_gpu

    fake_one_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", (8,))
    a = argparse.Namespace(dry_run=False, out=str(tmp_path / "mfu.json"), recompute="none", gpus=1)
    probed = gpu_predict.probe(a)
    assert probed["datasheet"] == "docs/hardware/dgx-h100.toml" and probed["device"] == "NVIDIA H100 80GB HBM3"
    assert probed["calibration"]["intra_bus_measured_over_gpus"] is None and Path(probed["probed_file"]).is_file()
    assert (
        probed["calibration"]["intra_bus_fraction"]
        == load_hardware(ROOT / probed["datasheet"]).gpu_calibration.intra_bus_fraction
    )
    before = gpu_predict.prediction(a, probed, None, gpu_check.mfu_config)
    after = gpu_predict.prediction(a, probed, {"option": "eager", "step_time_s": 0.42}, gpu_check.mfu_config)
    assert before["measured_step_s"] is None and before["predicted_step_s"] == after["predicted_step_s"] > 0
    assert after["measured_over_predicted"] == 0.42 / after["predicted_step_s"]
