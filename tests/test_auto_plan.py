"""Planning at launch (`--parallel.auto true`, plan/launch.py): the user's keys held fixed, the chosen layout
handed to the workers, plan.json, the elastic re-plan through the planner, a heterogeneous start (uneven
stages and replica shares from the hardware's speeds), and impossible requests refused in one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpar import cli
from hybridpar.config import Config, parse_args
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.plan.hardware import load_hardware, parse_hardware
from hybridpar.plan.launch import (
    PLAN_FILE,
    auto_plan,
    constraints,
    given_by_value,
    record,
    replan_with_planner,
    write_record,
)
from hybridpar.plan.memory_model import rank_memory
from hybridpar.plan.search import plan
from hybridpar.resilience.elastic import layout_for_world
from hybridpar.trainer.build import layer_partition
from tests.test_cli import no_launch  # noqa: F401  (the fixture)
from tests.tiny_flags import tiny_flags

HW = """name = "test host"
source = "hand-written for tests"
nodes = 1
devices_per_node = {n}
device_memory_gib = {gib}
memory_bandwidth_gbs = 10.0
cores_per_node = 2.0
op_overhead_us = 5.0
{speed}
[peak_tflops]
fp32 = 0.05
bf16 = 0.1

[intra_node]
bandwidth_gbs = 5.0
latency_us = 20.0

[inter_node]
bandwidth_gbs = 5.0
latency_us = 20.0
"""


def _hw(tmp_path: Path, n: int = 4, gib: float = 4.0, speed: list[float] | None = None) -> str:
    path = tmp_path / f"hw{n}-{gib}-{speed}.toml"
    path.write_text(HW.format(n=n, gib=gib, speed=f"speed = {speed}\n" if speed else ""))
    return str(path)


def _parse(argv: list[str]) -> tuple[Config, set[str]]:
    given: set[str] = set()
    return parse_args(argv, given), given


def test_parser_reports_the_keys_given(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('run_dir = "x"\n[parallel]\ntp = 1\n')
    cfg, given = _parse(["--config", str(conf), "--train.precision", "fp32", "--parallel.auto", "true"])
    assert given == {"run_dir", "parallel.tp", "train.precision", "parallel.auto"}
    assert cfg.parallel.tp == 1 and cfg.parallel.auto is True
    # The Python API has no command line: what differs from the defaults counts as given.
    assert given_by_value(cfg) == {"parallel.tp"}


def test_given_keys_are_held_and_precision_kept_unless_asked(tmp_path: Path) -> None:
    hw = _hw(tmp_path)
    cfg, given = _parse(["--parallel.auto", "true", "--parallel.hardware", hw, "--parallel.tp", "1"])
    assert constraints(cfg, given) == {"parallel.tp": 1, "train.precision": "fp32"}
    ap = auto_plan(cfg, given, 4)
    assert ap.cfg.parallel.tp == 1 and ap.cfg.train.precision == "fp32"  # bf16 is faster here, but not asked
    assert all(c.cfg.parallel.tp == 1 and c.cfg.train.precision == "fp32" for c in ap.result.candidates)
    assert ap.cfg.parallel.world_size == 4
    validate_config(ap.cfg, world_size=4)
    cfg.parallel.auto_precision = True  # now the planner may choose it, and bf16's peak is twice fp32's here
    assert auto_plan(cfg, given, 4).cfg.train.precision == "bf16"


def test_ranks_sharing_cores_are_bound_unless_the_binding_was_given(tmp_path: Path) -> None:
    from hybridpar.plan.launch import summary
    from hybridpar.run.launcher import planned_flags

    cfg, given = _parse(["--parallel.auto", "true", "--parallel.hardware", _hw(tmp_path, n=4)])
    ap = auto_plan(cfg, given, 4)  # 4 ranks on 2 cores
    assert ap.cfg.parallel.cpu_bind == "cores" and "--parallel.cpu_bind=cores" in planned_flags(ap.cfg)
    assert "cpu_bind=cores" in summary(ap).splitlines()[-1]
    cfg, given = _parse(
        ["--parallel.auto", "true", "--parallel.hardware", _hw(tmp_path, n=4), "--parallel.cpu_bind", "none"]
    )
    assert auto_plan(cfg, given, 4).cfg.parallel.cpu_bind == "none"  # given: kept
    cfg, given = _parse(["--parallel.auto", "true", "--parallel.hardware", _hw(tmp_path, n=1)])
    assert auto_plan(cfg, given, 1).cfg.parallel.cpu_bind == "none"  # cores to spare: the OS places it


def test_plan_record_is_json_with_the_hardware_and_every_candidate(tmp_path: Path) -> None:
    cfg, given = _parse(["--parallel.auto", "true", "--parallel.hardware", _hw(tmp_path), "--train.microbatches", "2"])
    ap = auto_plan(cfg, given, 4)
    path = write_record(tmp_path, record(ap, 4))
    rec = json.loads(path.read_text())
    assert parse_hardware(rec["hardware"]) == load_hardware(cfg.parallel.hardware)  # re-plans read it back
    assert rec["fixed"] == {"train.microbatches": 2, "train.precision": "fp32"} and rec["world"] == 4
    assert rec["runs"]["parallel"]["tp"] == ap.cfg.parallel.tp and rec["runs"]["train"]["microbatches"] == 2
    first = rec["candidates"][0]
    assert first["step_s"] > 0 and first["memory_per_rank_gib"] and first["reason"]
    assert first["settings"]["parallel"]["dp"] == ap.cfg.parallel.dp
    steps = [c["step_s"] for c in rec["candidates"]]
    assert steps == sorted(steps) and len(steps) > 1


def test_heterogeneous_devices_start_with_uneven_stages_and_replica_shares(tmp_path: Path) -> None:
    # Devices are numbered tp fastest, then pp, then dp: with pp2 x dp2, replica 0 is devices 0-1 and its
    # second stage (device 1) runs at a third of the speed; replica 1 is at full speed.
    hw = _hw(tmp_path, speed=[1.0, 1 / 3, 1.0, 1.0])
    cfg, given = _parse(
        ["--parallel.auto", "true", "--parallel.hardware", hw, "--model.n_layers", "8", "--train.global_batch", "32"]
        + ["--parallel.tp", "1", "--parallel.pp", "2", "--parallel.schedule", "1f1b", "--train.microbatches", "2"]
    )
    ap = auto_plan(cfg, given, 4)
    p = ap.cfg.parallel
    assert (p.pp, p.dp, p.partition) == (2, 2, "layers")
    assert p.stage_layers[0] > p.stage_layers[1] and sum(p.stage_layers) == 8  # fewer layers on the slow rank
    # What the runtime builds is what the planner costed.
    assert [(r.start, r.stop) for r in layer_partition(ap.cfg)] == list(ap.result.candidates[0].prediction.parts)
    shares = p.replica_batch
    assert sum(shares) == 32 and shares[1] > shares[0]  # the replica without the slow device takes more
    validate_config(ap.cfg, world_size=4)
    # Equal speeds: the even split and the runtime's own partition (nothing to write down).
    even = auto_plan(parse_args(["--parallel.hardware", _hw(tmp_path), "--parallel.auto", "true"]), set(), 4).cfg
    assert even.parallel.replica_batch is None and even.parallel.partition == "params"


def _resumed(tmp_path: Path, world: int) -> tuple[Config, Config]:
    cfg, given = _parse(["--parallel.auto", "true", "--parallel.hardware", _hw(tmp_path), "--run-dir", str(tmp_path)])
    ap = auto_plan(cfg, given, world)
    write_record(tmp_path, record(ap, world))
    ap.cfg.checkpoint.resume = "auto"
    return cfg, ap.cfg


def test_elastic_replan_goes_through_the_planner(tmp_path: Path) -> None:
    user, running = _resumed(tmp_path, 4)
    new, note = layout_for_world(running, 2, 0, replan_with_planner)
    assert new.parallel.world_size == 2 and "(planner)" in note and "-> tp=" in note
    direct = plan(user, load_hardware(user.parallel.hardware), rank_memory, world=2, top=1).candidates[0].cfg
    assert (new.parallel.tp, new.parallel.pp, new.parallel.dp, new.parallel.schedule) == (
        direct.parallel.tp,
        direct.parallel.pp,
        direct.parallel.dp,
        direct.parallel.schedule,
    )
    assert new.train.global_batch == running.train.global_batch  # the run's batch never changes
    # The same world: nothing to re-plan.
    assert layout_for_world(running, 4, 0, replan_with_planner) == (running, None)


def test_replan_lets_go_of_keys_the_new_world_cannot_keep(tmp_path: Path) -> None:
    cfg, given = _parse(["--parallel.auto", "true", "--parallel.hardware", _hw(tmp_path), "--run-dir", str(tmp_path)])
    cfg.parallel.schedule = "zb-v"  # needs two pipeline ranks: none in a world of 1
    ap = auto_plan(cfg, given | {"parallel.schedule"}, 4)
    write_record(tmp_path, record(ap, 4))
    assert ap.cfg.parallel.schedule == "zb-v"
    ap.cfg.checkpoint.resume = "auto"
    new, _ = layout_for_world(ap.cfg, 1, 0, replan_with_planner)
    assert new.parallel.world_size == 1 and new.parallel.schedule != "zb-v"


def test_replan_without_the_launch_record_is_one_line(tmp_path: Path) -> None:
    _, running = _resumed(tmp_path, 4)
    (tmp_path / PLAN_FILE).unlink()
    with pytest.raises(ValueError, match="parallel.auto re-plans for 2 processes from .*plan.json") as e:
        layout_for_world(running, 2, 0, replan_with_planner)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "gib,extra,match",
    [
        (1e-6, [], "no layout fits: the smallest needs"),
        (4.0, ["--parallel.dp", "3"], "no layout of world 4 has parallel.dp=3: leave it to the planner"),
        (4.0, ["--batching.policy", "adaptive"], "parallel.auto chooses train.microbatches"),
        (4.0, ["--train.recompute", "full,none"], "gives a mode per stage"),
        (4.0, ["--nnodes", "1:2", "--nproc-per-node", "auto"], "parallel.auto plans for a known world size"),
        (4.0, ["--nnodes", "2", "--nproc-per-node", "2"], "parallel.auto on several nodes needs --parallel.hardware"),
    ],
)
@pytest.mark.usefixtures("no_launch")  # tests/test_cli.py's: a launched worker fails the test
def test_impossible_requests_are_one_line_and_exit_2(gib, extra, match, tmp_path, capsys) -> None:
    argv = ["train", "--parallel.auto", "true"]
    argv += [] if "--nnodes" in extra else ["--parallel.hardware", _hw(tmp_path, gib=gib)]
    argv += extra if "--nproc-per-node" in extra else ["--nproc-per-node", "4", *extra]
    assert cli.main([*argv, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run" / PLAN_FILE).exists()


@pytest.mark.usefixtures("no_launch")
def test_layout_defaults_the_planner_replaces_are_not_held_against_the_model(tmp_path, capsys) -> None:
    # 3 heads (tp=2, the default, does not divide them) and 2 sequences (fewer than the default 4
    # microbatches): fine, the planner chooses tp and microbatches; an impossible memory ends it after.
    argv = ["train", "--nproc-per-node", "2", "--parallel.auto", "true", "--parallel.hardware"]
    argv += [_hw(tmp_path, n=2, gib=1e-6), "--model.n_heads", "3", "--model.dim", "96", "--train.global_batch", "2"]
    assert cli.main([*argv, "--run-dir", str(tmp_path / "run")]) == 2
    assert "no layout fits" in capsys.readouterr().err


def test_an_elastic_launch_plans_for_its_largest_world() -> None:
    assert cli.planned_world(None, "1:3", "2") == 6  # fewer nodes re-plan through the planner
    assert cli.planned_world(8, "2", "4") == 8
    assert cli.planned_world(None, "1:2", "auto") is None


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--parallel.hardware", "x.toml"], "parallel.hardware is read by the planner only: add --parallel.auto true"),
        (["--parallel.stage_layers", "3,1"], "parallel.stage_layers=[3, 1] goes with parallel.partition='layers'"),
        (["--parallel.partition", "layers"], "parallel.stage_layers=None goes with parallel.partition='layers'"),
        (["--parallel.partition", "layers", "--parallel.stage_layers", "3"], "has 1 entries but the layout has 2"),
        (["--parallel.partition", "layers", "--parallel.stage_layers", "3,2"], "sums to 5 but model.n_layers=4"),
        (["--parallel.partition", "layers", "--parallel.stage_layers", "4,0"], "stage_layers[1]=0 must be a positive"),
        (["--parallel.dp", "2", "--parallel.replica_batch", "16"], "replica_batch has 1 entries but parallel.dp=2"),
        (["--parallel.dp", "2", "--parallel.replica_batch", "9,6"], "sums to 15 but train.global_batch=16"),
        (["--parallel.dp", "2", "--parallel.replica_batch", "13,3"], "train.microbatches=4 exceeds the 3 samples"),
        (
            ["--parallel.dp", "2", "--parallel.replica_batch", "10,6", "--batching.policy", "adaptive"],
            "parallel.replica_batch splits the batch unevenly, which batching.policy=adaptive",
        ),
    ],
)
def test_bad_planner_keys_are_refused(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        validate_config(parse_args(argv))


def _losses(run_dir: Path) -> list[float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "step" in r and not r.get("final")]


def _train(args: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hybridpar.cli", "train", *args, "--run-dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.multiprocess
def test_train_auto_runs_the_planned_layout(tmp_path: Path) -> None:
    """2 ranks, the second half as fast, dp held at 2: the planner splits the batch 5:3, writes plan.json,
    and the run's losses are those of the same layout given by hand."""
    tiny = [*tiny_flags(2), "--train.global_batch", "8"]
    hw = _hw(tmp_path, n=2, speed=[1.0, 0.5])
    auto = _train(["--nproc-per-node", "2", "--parallel.auto", "true", "--parallel.hardware", hw, "--parallel.dp", "2"]
                  + tiny, tmp_path / "auto")  # fmt: skip
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert "hybridpar: running #1: tp=1 pp=1 dp=2" in auto.stdout and "replica_batch=[5, 3]" in auto.stdout
    rec = json.loads((tmp_path / "auto" / PLAN_FILE).read_text())
    p, t = rec["runs"]["parallel"], rec["runs"]["train"]
    assert p["replica_batch"] == [5, 3] and rec["candidates"][0]["settings"]["parallel"]["dp"] == 2
    keys = ("tp", "pp", "dp", "schedule", "zero", "partition")
    by_hand = [f"--parallel.{k}={p[k]}" for k in keys] + ["--parallel.replica_batch=5,3"]
    by_hand += [f"--train.microbatches={t['microbatches']}", f"--train.recompute={t['recompute']}"]
    manual = _train(["--nproc-per-node", "2", *tiny, *by_hand], tmp_path / "manual")
    assert manual.returncode == 0, manual.stderr[-3000:]
    got, want = _losses(tmp_path / "auto"), _losses(tmp_path / "manual")
    assert len(got) == 2 and got == pytest.approx(want, abs=1e-6)
    first = json.loads((tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()[0])
    assert sum(first["microbatches"]) == 5  # replica 0's microbatches: its share of the batch, as planned


@pytest.mark.multiprocess
def test_uneven_stages_and_replica_shares_train_the_one_device_model(tmp_path: Path) -> None:
    """What the planner writes for unequal devices is exact: explicit stage sizes and an uneven batch
    split against the single-device run (losses within 1e-5, parameters by the fp64 criterion)."""
    from hybridpar.model.reference import tiny_config
    from tests.test_equivalence import check_layouts

    layout = dict(tp=1, pp=2, dp=2, partition="layers", stage_layers=[6, 2], replica_batch=[7, 4])
    cfgs = [tiny_config(parallel={**layout, "schedule": s}) for s in ("1f1b", "gpipe")]
    for cfg in cfgs:
        validate_config(cfg, world_size=4)
    check_layouts(cfgs, tmp_path)


@pytest.mark.multiprocess
def test_launch_api_plans_too(tmp_path: Path) -> None:
    """`hybridpar.launch(cfg, nproc=2)`: the keys set to other than their defaults (dp=2) are held, the
    plan is printed and written, and the run takes the planned shares."""
    from tests.launches import run_forked

    hw = _hw(tmp_path, n=2, speed=[1.0, 0.5])
    cfg = parse_args([*tiny_flags(2), "--train.global_batch", "8", "--parallel.tp", "1", "--parallel.pp", "1"])
    cfg.parallel.dp, cfg.parallel.auto, cfg.parallel.hardware = 2, True, hw
    cfg.run_dir = str(tmp_path / "run")
    result, out = run_forked(cfg, 2)
    assert len(result["losses"]) == 2 and "hybridpar: running #1: tp=1 pp=1 dp=2" in out
    rec = json.loads((tmp_path / "run" / PLAN_FILE).read_text())
    assert rec["fixed"]["parallel.dp"] == 2 and rec["runs"]["parallel"]["replica_batch"] == [5, 3]
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert sum(first["microbatches"]) == 5
