"""`hybridpar serve` options: bad values are refused before anything starts, naming the option."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpar.cli import main
from hybridpar.serve.config import ServeConfig, parse_serve_args
from hybridpar.serve.main import prepare


def test_parse_and_defaults() -> None:
    cfg, model = parse_serve_args(
        ["--source", "init:1", "--dp", "2", "--port=0", "--model.dim", "64", "--emulate-slowdown", "1:2.0"]
    )
    assert (cfg.source, cfg.dp, cfg.port, model.dim) == ("init:1", 2, 0, 64)
    assert cfg.host == "127.0.0.1" and cfg.slowdowns() == [1.0, 2.0]
    assert ServeConfig().slowdowns() == [1.0]  # emulation is off by default


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--bogus", "1"], "unknown option --bogus; options: "),
        (["--sourc", "x"], "unknown option --sourc; did you mean --source?"),
        (["--tp", "two"], "--tp expects an integer, got 'two'"),
        (["--dp", "1.5"], "--dp expects an integer, got '1.5'"),
        (["--port", "1e3"], "--port expects an integer, got '1e3'"),
        (["--timeout-s", "soon"], "--timeout-s expects a number, got 'soon'"),
        (["--source", "init:0", "--tp", "3"], "tp=3 does not divide model n_heads=4"),
        (["--source", "init:0", "--pp", "9"], "pp=9 exceeds the model's n_layers=4"),
        (["--source", "init:0", "--strategy", "fastest"], "strategy='fastest' is not one of"),
        (["--source", "init:0", "--emulate-slowdown", "5:2"], "replica must be in 0..0"),
        (["--source", "init:0", "--max-batch", "0"], "max_batch must be a positive integer"),
        (
            ["--source", "init:0", "--max-step-tokens", "8"],
            "max_step_tokens=8 must be 0 \\(no limit\\) or more than max_batch=8",
        ),
        (["--source", "init:0", "--max-step-tokens", "-1"], "max_step_tokens=-1 must be 0"),
        (["--source", "init:0", "--kv-tokens", "8"], "kv_tokens=8 must hold at least one block \\(block_size=16\\)"),
        (["--source", "init:0", "--imbalance", "2"], "imbalance=2.0 must be in"),
        (["--source", "/no/such/dir"], "is not init:SEED"),
        (
            ["--source", "init:0", "--model.family", "gpt2", "--model.n_positions", "64"],
            "max_seq_len=1024 exceeds the model's 64 learned positions",
        ),
        (
            ["--source", "init:0", "--model.family", "gpt2", "--model.n_kv_heads", "2"],
            "model.n_kv_heads=2 configures grouped-query attention",
        ),
        (["--source", "init:0", "--model.family", "gpt2", "--tp", "3"], "tp=3 does not divide model n_heads=4"),
    ],
)
def test_bad_options_are_refused(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prepare(argv)


SECONDS = ["request_timeout_s", "timeout_s", "client_timeout_s"]


@pytest.mark.parametrize(
    "name,value,match",
    [
        *(
            (n, v, rf"serve {n}={re.escape(repr(float(v)))} must be a number of seconds in \(0, 604800\]")
            for n in SECONDS
            for v in ("inf", "-inf", "nan", "0", "-1", "1e9")
        ),
        *(
            (n, v, rf"router {n}=.* must be in \(0, 1\]")
            for n in ("memory_pressure", "performance_pressure", "imbalance")
            for v in ("nan", "inf", "0", "-0.5")
        ),
        *(
            (n, v, f"serve {n} must be a positive integer, got {v}")
            for n in (
                "tp",
                "pp",
                "dp",
                "max_batch",
                "max_groups",
                "kv_tokens",
                "block_size",
                "max_seq_len",
                "max_outstanding",
                "max_pending",
            )
            for v in ("0", "-3")
        ),
        ("port", "-1", "serve port must be in 0..65535, got -1"),
        ("port", "65536", "serve port must be in 0..65535, got 65536"),
        ("emulate_slowdown", "0:inf", "factor a number >= 1"),
        ("emulate_slowdown", "0:nan", "factor a number >= 1"),
    ],
)
def test_bad_numbers_are_refused_naming_the_value(name: str, value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prepare(["--source", "init:0", f"--{name.replace('_', '-')}", value])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "flag,value", [("--request-timeout-s", "inf"), ("--timeout-s", "nan"), ("--client-timeout-s", "0")]
)
def test_serve_refuses_a_bad_number_in_one_line_with_exit_2(flag: str, value: str) -> None:
    """Through the real command: refused before any worker starts (a server that started would still be
    running when the 60 s bound passes; its whole process group is killed then)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridpar.cli", "serve", "--source", "init:0", "--port", "0", flag, value],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"hybridpar serve {flag} {value} started serving") from None
    lines = err.decode().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("hybridpar: error: serve "), lines
    assert value in lines[0] and "seconds in (0, 604800]" in lines[0] and not out


def test_cli_exits_2_on_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--source", str(tmp_path / "missing")]) == 2
    assert "hybridpar: error:" in capsys.readouterr().err
    assert main(["serve", "--help"]) == 0
    assert "--strategy" in capsys.readouterr().out
