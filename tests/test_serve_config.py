"""`hybridpar serve` options: bad values are refused before anything starts, naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpar.cli import main
from hybridpar.serve.config import ServeConfig, parse_serve_args
from hybridpar.serve.main import prepare


def test_parse_and_defaults() -> None:
    cfg, model = parse_serve_args(["--source", "init:1", "--dp", "2", "--port=0", "--model.dim", "64",
                                   "--emulate-slowdown", "1:2.0"])
    assert (cfg.source, cfg.dp, cfg.port, model.dim) == ("init:1", 2, 0, 64)
    assert cfg.host == "127.0.0.1" and cfg.slowdowns() == [1.0, 2.0]
    assert ServeConfig().slowdowns() == [1.0]  # emulation is off by default


@pytest.mark.parametrize("argv,match", [
    (["--bogus", "1"], "unknown serve option --bogus"),
    (["--tp", "two"], "--tp expects a int"),
    (["--source", "init:0", "--tp", "3"], "tp=3 does not divide model n_heads=4"),
    (["--source", "init:0", "--pp", "9"], "pp=9 exceeds the model's n_layers=4"),
    (["--source", "init:0", "--strategy", "fastest"], "strategy='fastest' is not one of"),
    (["--source", "init:0", "--emulate-slowdown", "5:2"], "replica must be in 0..0"),
    (["--source", "init:0", "--max-batch", "0"], "max_batch must be a positive integer"),
    (["--source", "init:0", "--imbalance", "2"], "imbalance=2.0 must be in"),
    (["--source", "/no/such/dir"], "is not init:SEED"),
    (["--source", "init:0", "--model.family", "gpt2", "--model.n_positions", "64"],
     "max_seq_len=1024 exceeds the model's 64 learned positions"),
    (["--source", "init:0", "--model.family", "gpt2", "--model.n_kv_heads", "2"],
     "model.n_kv_heads=2 configures grouped-query attention"),
    (["--source", "init:0", "--model.family", "gpt2", "--tp", "3"], "tp=3 does not divide model n_heads=4"),
])
def test_bad_options_are_refused(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prepare(argv)


def test_cli_exits_2_on_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--source", str(tmp_path / "missing")]) == 2
    assert "hybridpar: error:" in capsys.readouterr().err
    assert main(["serve", "--help"]) == 0
    assert "--strategy" in capsys.readouterr().out
