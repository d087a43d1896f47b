"""The command line: bad input is refused before any process starts; `hybridpar train` (torch's
elastic launcher) and plain `torchrun -m hybridpar.run.train` both train and write metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridpar import cli
from tests.tiny_flags import tiny_flags

TINY = [*tiny_flags(3, val_every=2, sample_tokens=8), "--train.val_batches", "1"]


@pytest.fixture
def no_launch(monkeypatch):
    import torch.distributed.run as tdr

    def boom(*a, **k):
        raise AssertionError("a worker was launched for an invalid config")

    monkeypatch.setattr(tdr, "run", boom)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--parallel.tp", "3"], "parallel.tp=3 does not divide model.n_heads=4"),
        (["--parallel.tpp", "2"], "did you mean --parallel.tp"),
        (["--nproc-per-node", "3"], "= 4, but 3 processes"),
        (["--parallel.pp", "4", "--model.n_layers", "2"], "model.n_layers=2"),
        (["--train.microbatches", "1"], "needs train.microbatches"),
        (["--parallel.schedule", "zb_v"], "parallel.schedule='zb_v' is not one of gpipe, 1f1b"),
        (["--train.global_batch", "2", "--train.microbatches", "4", "--parallel.schedule", "gpipe"], "exceeds"),
        (["--train.seq_len", "0"], "train.seq_len"),
        (["--emulate.slowdown", "rank=7:2.0@step=1"], "emulate.slowdown='rank=7:2.0@step=1': slowdown names rank"),
        (["--emulate.slowdown", "rank=1:fast"], "emulate.slowdown='rank=1:fast'"),
    ],
)
def test_bad_config_refused_before_launch(argv, match, no_launch, capsys):
    assert cli.main(["train", *argv]) == 2
    assert match in capsys.readouterr().err


def test_split_argv_separates_torchrun_flags():
    theirs, ours = cli.split_argv(["--nproc-per-node", "4", "--parallel.tp=2", "--max-restarts=1", "--run-dir", "x"])
    assert theirs == ["--nproc-per-node", "4", "--max-restarts=1"]
    assert ours == ["--parallel.tp=2", "--run-dir", "x"]


def test_restarts_without_checkpoints_are_warned() -> None:
    from hybridpar.run.launcher import restart_note

    warning = restart_note("1", "2", 0)
    assert warning is not None and "--checkpoint.every" in warning and "step 0" in warning
    assert restart_note("2", "1", 0) is not None  # a fixed number of nodes restarts the same way
    assert restart_note("1", "2", 10) is None  # a restart resumes from the newest checkpoint
    assert restart_note("1", "0", 0) is None and restart_note("1", None, 0) is None  # none asked for
    assert restart_note("1:2", "2", 0) is None  # elastic: elastic_note says it


@pytest.mark.parametrize(
    "argv,warned",
    [
        (["--max-restarts", "2"], True),
        (["--max-restarts=2"], True),
        (["--resilience.max_restarts", "1"], True),
        (["--max-restarts", "2", "--checkpoint.every", "5"], False),
        ([], False),  # the default's restarts: the README's first command warns of nothing
    ],
)
def test_the_launcher_warns_of_restarts_that_start_over(argv, warned, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "_run_agent", lambda *a: 0)  # the warning comes before any agent starts
    flags = ["--parallel.tp", "1", "--parallel.pp", "1", *tiny_flags(2), "--run-dir", str(tmp_path / "run")]
    assert cli.main(["train", *argv, *flags]) == 0
    assert ("restart(s) asked for" in capsys.readouterr().err) == warned


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_run(run_dir: Path, steps: int) -> None:
    recs = _records(run_dir)
    per_step = [r for r in recs if "step" in r and not r.get("final")]
    assert [r["step"] for r in per_step] == list(range(steps))
    for r in per_step:
        assert {"loss", "lr", "tokens_per_s", "step_time_s"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0
    assert any("val_loss" in r for r in per_step)
    final = recs[-1]
    assert final["final"] is True and len(final["params_digest"]) == 64


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _tree(root: int) -> set[int]:
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, grew = {root}, True
    while grew:
        new = {p for p, pp in parents.items() if pp in tree} - tree
        tree |= new
        grew = bool(new)
    return tree


def _listening(pids: set[int]) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of the sockets these processes listen on."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            pass
    addrs = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                addrs.add(f[1].split(":")[0])
    return addrs


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")
def test_hybridpar_train_launches_through_torchrun_on_loopback(tmp_path):
    run_dir = tmp_path / "run"
    exe = Path(sys.executable).with_name("hybridpar")
    proc = subprocess.Popen(
        [str(exe), "train", "--parallel.tp", "2", "--parallel.pp", "2", *TINY, "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    seen: set[str] = set()
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:  # sample the launcher's and workers' sockets
            seen |= _listening(_tree(proc.pid))
            time.sleep(0.2)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    _check_run(run_dir, 3)
    assert "sample from the trained model" in out
    assert seen, "no listening socket observed: the check saw nothing"
    assert seen <= LOOPBACK, f"listening on non-loopback addresses: {seen - LOOPBACK}"


@pytest.mark.multiprocess
def test_plain_torchrun_module(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "hybridpar-loopback",
        "--rdzv-endpoint",
        "127.0.0.1:0",
        "--local-addr",
        "127.0.0.1",
        "-m",
        "hybridpar.run.train",
        "--parallel.tp",
        "1",
        "--parallel.pp",
        "1",
        "--parallel.dp",
        "2",
        *TINY,
        "--run-dir",
        str(run_dir),
        "--trace",
        str(tmp_path / "trace.json"),
        "--train.monitor_every",
        "2",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    _check_run(run_dir, 3)
    monitored = [r["monitor"] for r in _records(run_dir) if "monitor" in r]
    assert len(monitored) == 1 and monitored[0]["ranks"] == 2  # step 2 of 3
    mon = monitored[0]
    assert all(v > 0 for v in mon["memory_used_bytes"]) and all(v > 0 for v in mon["memory_total_bytes"])
    assert mon["utilization_pct"] == [None, None] and mon["power_w"] == [None, None]  # no sensor: null
    assert all(len(st["F0"]) == 2 and min(st["F0"]) > 0 for st in mon["stage_times_s"])  # 2 microbatches
    # Bytes held by component (trainer/held.py): both replicas hold the whole model, its gradients and state.
    held = mon["memory"]
    assert all(m["params"] > 0 and m["grads"] == m["params"] and m["optimizer"] > m["params"] for m in held)
    assert all(m["activations"] > 0 and m["buffers"] >= m["grads"] for m in held)  # dp=2: gradient buckets
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in slices} == {0, 1}, "one track per rank"
    assert {e["name"] for e in slices if e["cat"] == "compute"} >= {"F0.0", "B0.1"}
    assert all(e["dur"] >= 0 for e in slices)


def test_bare_command_prints_help_and_starts_nothing(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "launch_train", lambda rest: pytest.fail("a bare `hybridpar` launched a run"))
    assert cli.main([]) == 0
    assert capsys.readouterr().out.startswith("usage: hybridpar [--version] [--help]")


def test_train_help_lists_every_schedule(capsys, monkeypatch) -> None:
    # The config's help names no schedule (config/ sits below the registry); the CLI adds the registry's.
    from hybridpar.pipeline.schedules import SCHEDULES

    monkeypatch.setattr(cli, "launch_train", lambda rest: pytest.fail("`hybridpar train --help` launched a run"))
    assert cli.main(["train", "--help"]) == 0
    tail = capsys.readouterr().out.split("pipeline schedules (--parallel.schedule NAME):")[1]
    for spec in SCHEDULES.values():
        assert f"  {spec.name} " in tail and spec.summary in tail


def test_a_misspelt_command_names_the_one_meant(capsys) -> None:
    assert cli.main(["trian"]) == 2
    assert capsys.readouterr().err.startswith("hybridpar: unknown command 'trian' (did you mean 'train'?); commands: ")
    assert cli.main(["frobnicate"]) == 2
    assert capsys.readouterr().err.startswith("hybridpar: unknown command 'frobnicate'; commands: train, serve")


def test_version(capsys) -> None:
    from importlib.metadata import version

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"hybridpar {version('hybridpar')}\n"
