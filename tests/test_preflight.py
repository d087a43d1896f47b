"""The one pre-flight (hybridpar/run/preflight.py): bad command lines of `hybridpar train` — config, layout,
data, directories, what a resume would load, another run's directory — each end with one error line and
exit code 2, before any worker starts and without creating the run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from hybridpar.cli import main
from hybridpar.resilience.commits import write_manifest

BASE = ["--data.max_tokens", "200000", "--train.steps", "2"]


def _files(tmp: Path) -> dict[str, str]:
    """Bad inputs on disk, by name."""
    d = tmp / "inputs"
    d.mkdir()
    (d / "empty.txt").write_bytes(b"")
    (d / "short.txt").write_bytes(b"x" * 100)
    (d / "odd.bin").write_bytes(b"\x01\x00\x02")
    (d / "empty.bin").write_bytes(b"")
    np.array([1, 2, 300] * 20000, dtype="<u2").tofile(d / "oov.bin")
    (d / "nofiles").mkdir()
    (d / "hidden").mkdir()
    (d / "hidden" / ".secret").write_text("text" * 1000)
    (d / "hf").mkdir()
    (d / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "hf" / "model.safetensors").write_bytes(b"\0" * 16)
    (d / "plain").mkdir()
    other = d / "other-model" / "step-000004"  # a verified checkpoint of another model (dim 64)
    other.mkdir(parents=True)
    (other / ".metadata").write_bytes(b"m")
    (other / "trainer_state.json").write_text(json.dumps({"step": 4, "run_id": "r0", "config": {"model": {"dim": 64}}}))
    write_manifest(other, 4, "r0")
    (d / "a_file").write_text("x")
    (d / "bad.toml").write_text("[train\nsteps = 3")
    taken = d / "taken-run"  # a run directory holding another run
    taken.mkdir()
    (taken / "run.json").write_text(
        json.dumps({"format": "hybridpar-run/1", "run_id": "abc", "state": "finished", "step": 120})
    )
    foreign = d / "foreign-run" / "checkpoints" / "step-000120"  # checkpoints but no run record
    foreign.mkdir(parents=True)
    (foreign / ".metadata").write_bytes(b"m")
    (foreign / "trainer_state.json").write_text(json.dumps({"step": 120}))
    write_manifest(foreign, 120, "older")
    (d / "damaged-run").mkdir()
    (d / "damaged-run" / "run.json").write_text("{torn")
    return {p.name: str(p) for p in d.iterdir()}


# (flags, a fragment the one error line must contain); RUN is replaced by a fresh run dir per case.
CASES: list[tuple[list[str], str]] = [
    (["--data.path", "/no/such/corpus.txt"], "does not exist"),
    (["--data.path", "@empty.txt"], "is empty"),
    (["--data.path", "@short.txt"], "corpus has 100 tokens"),
    (["--data.path", "@odd.bin"], "odd size 3 bytes"),
    (["--data.path", "@empty.bin"], "token file"),
    (["--data.path", "@oov.bin"], "model.vocab_size=256 must be at least 301"),
    (["--data.path", "@nofiles"], "contains no"),
    (["--data.path", "@hidden"], "contains no"),
    (["--data.path", "/dev/null"], "neither a regular file nor a folder"),
    (["--data.max_tokens", "0"], "data.max_tokens must be a positive integer or none"),
    (["--data.max_bytes", "1000"], "--data.max_bytes: data.max_bytes is gone"),
    (["--data.val_fraction", "0.6"], "data.val_fraction must be in (0, 0.5)"),
    (["--data.val_fraction", "nan"], "data.val_fraction"),
    (["--train.lr", "inf"], "train.lr must be a finite number, got inf"),
    (["--train.lr", "nan"], "train.lr must be a finite number, got nan"),
    (["--train.lr", "-1"], "train.lr must be > 0"),
    (["--train.lr", "0"], "train.lr must be > 0"),
    (["--train.min_lr", "1"], "train.min_lr must be between 0 and train.lr"),
    (["--train.steps", "0"], "train.steps must be a positive integer"),
    (["--train.steps", "-5"], "train.steps must be a positive integer"),
    (["--train.steps", "abc"], "--train.steps expects int, got 'abc'"),
    (["--train.global_batch", "0"], "train.global_batch must be a positive integer"),
    (["--train.beta1", "1.0"], "train.beta1 must be in [0, 1)"),
    (["--train.eps", "inf"], "train.eps must be a finite number"),
    (["--train.grad_clip", "-1"], "train.grad_clip must be >= 0"),
    (["--train.seq_len", "0"], "train.seq_len must be a positive integer"),
    (["--model.dim", "0"], "model.dim must be a positive integer"),
    (["--model.n_heads", "3"], "n_heads"),
    (["--parallel.tp", "3"], "parallel.tp"),
    (["--parallel.pp", "0"], "parallel.pp must be a positive integer"),
    (["--parallel.schedule", "zigzag"], "parallel.schedule='zigzag' is not one of"),
    (["--parallel.timeout_s", "inf"], "parallel.timeout_s must be a finite number"),
    (["--parallel.timeout_s", "0"], "parallel.timeout_s must be > 0"),
    (["--model.norm_eps", "inf"], "model.norm_eps must be a finite number"),
    (["--resilience.max_restarts", "-1"], "resilience.max_restarts must be a non-negative integer"),
    (["--resilience.hang_timeout_s", "1", "--resilience.heartbeat_s", "1"], "at least twice"),
    (["--checkpoint.keep", "0"], "checkpoint.keep must be a positive integer"),
    (["--checkpoint.every", "-1"], "checkpoint.every must be a non-negative integer"),
    (["--checkpoint.resume", "/no/such/checkpoint"], "checkpoint.resume='/no/such/checkpoint' must be"),
    (["--checkpoint.resume", "@hf"], "is a Hugging Face model directory, not a hybridpar checkpoint"),
    (["--checkpoint.resume", "@plain"], "manifest.json is missing"),
    (["--checkpoint.resume", "@foreign-run"], "foreign-run' is a run directory, not one checkpoint: give one (the"),
    (["--checkpoint.resume", "@foreign-run/checkpoints"], "is a folder of checkpoints, not one checkpoint"),
    (["--checkpoint.resume", "@other-model/step-000004"], "holds another model: model.dim=128 (checkpoint: 64)"),
    (["--run-dir", "@a_file"], "run_dir='"),
    (["--checkpoint.dir", "@a_file"], "checkpoint.dir='"),
    (["--run-dir", "@a_file/sub"], "cannot be created"),
    (["--run-dir", "@taken-run"], "holds run abc (finished at step 120): pass --resume auto"),
    (["--run-dir", "@foreign-run", "--resume", "auto"], "holds checkpoints of another run (step-000120, run older)"),
    (["--run-dir", "@damaged-run"], "run.json is damaged"),
    (["--train.lrr", "1"], "unknown option --train.lrr (did you mean --train.lr?)"),
    (["--foo.bar", "1"], "unknown option --foo.bar"),
    (["--train.steps"], "missing value for --train.steps"),
    (["--config", "/no/such.toml"], "cannot read config file"),
    (["--config", "@bad.toml"], "is not valid TOML"),
    (["--emulate.slowdown", "rank=x"], "emulate.slowdown="),
    (["--emulate.fault", "rank=0:explode@step=1"], "fault"),
    (["--emulate.slowdown", "rank=9:2.0"], "world size is 4"),
    (["--batching.policy", "foo"], "batching.policy='foo' is not one of"),
    (["--nproc-per-node", "3"], "3"),
    (["positional"], "unexpected argument 'positional'"),
    (["--model.vocab_size", "100"], "holds token ids up to 125: model.vocab_size=100 must be at least 126"),
]


def _argv(flags: list[str], files: dict[str, str], run: Path) -> list[str]:
    out = [
        files[f[1:].split("/")[0]] + f[1:].partition("/")[1] + f[1:].partition("/")[2] if f.startswith("@") else f
        for f in flags
    ]
    return ["train", *BASE, *([] if "--run-dir" in flags else ["--run-dir", str(run)]), *out]


def test_fuzz_bad_command_lines(tmp_path: Path, capsys) -> None:
    assert len(CASES) >= 50
    files = _files(tmp_path)
    me = psutil.Process()
    already = {p.pid for p in me.children(recursive=True)}  # what earlier tests left (e.g. a resource tracker)
    failures = []
    for i, (flags, expect) in enumerate(CASES):
        run = tmp_path / "runs" / f"case{i}"
        before = {p: sorted(os.listdir(p)) for p in map(Path, files.values()) if p.is_dir()}
        rc = main(_argv(flags, files, run))
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        ok = (
            rc == 2
            and len(lines) == 1
            and lines[0].startswith("hybridpar: error: ")
            and expect in lines[0]
            and not run.exists()
            and not {p.pid for p in me.children(recursive=True)} - already
            and before == {p: sorted(os.listdir(p)) for p in before}
        )  # nothing created anywhere
        if not ok:
            failures.append(f"{flags}: rc={rc} stderr={err.strip()[:300]!r} stdout={out[:200]!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.multiprocess
@pytest.mark.parametrize("flags", [["--train.lr", "inf"], ["--data.path", "/no/such/corpus.txt"]])
def test_bad_command_line_through_the_real_cli(tmp_path: Path, flags: list[str]) -> None:
    """The installed `hybridpar` command: one line, exit 2, no worker, no run directory."""
    exe = Path(sys.executable).with_name("hybridpar")
    out = subprocess.run(
        [str(exe), "train", *BASE, "--run-dir", str(tmp_path / "run"), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("hybridpar: error: ") and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("gpus", "flags", "refused"),
    [(1, [], True), (4, [], False), (1, ["--parallel.tp", "1", "--parallel.pp", "1"], False)],
)
def test_more_nccl_ranks_than_gpus_is_refused(
    tmp_path: Path, capsys, monkeypatch, gpus: int, flags: list[str], refused: bool
) -> None:
    """NCCL takes one GPU per rank: the default tp2 x pp2 on a one-GPU machine ends with one line naming
    both counts before any worker starts (torch's own error would come from every worker: an invalid device
    ordinal). CUDA is faked; only the pre-flight runs (a layout that fits stops at the next check)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    run = tmp_path / "run"
    rc = main(["train", *BASE, "--run-dir", str(run), "--data.path", "/no/such/corpus.txt", *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and not run.exists(), err
    expect = "4 ranks on this node over NCCL need 4 GPUs, one each, and it has 1" if refused else "/no/such/corpus.txt"
    assert expect in err, err
