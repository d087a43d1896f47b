"""`hybridpar serve` refuses a bad start before any replica loads (no processes): a port in use, a Hugging
Face directory whose config.json describes another model than its weights, a directory of weights without
its config.json. Each was found only after the workers had started (a port: once every replica had
loaded, minutes for a large model; a mismatch: a traceback from every worker, exit 1)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import hybridpar.serve.service
from hybridpar.config import ModelConfig
from hybridpar.model.registry import build_full_model, export_hf
from hybridpar.serve.main import main, prepare

SMALL = ModelConfig(dim=32, n_layers=2, n_heads=2, ffn_dim=64)
WIDER = ModelConfig(dim=64, n_layers=2, n_heads=2, ffn_dim=64)


def _no_replicas(*args: object, **kwargs: object) -> None:
    raise AssertionError("a replica was started")


def test_a_port_in_use_is_refused_before_the_replicas_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(hybridpar.serve.service, "Service", _no_replicas)
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code = main(["--source", "init:0", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot bind 127.0.0.1:{port}" in err and "--port" in err, err


def test_a_config_of_another_model_is_refused(tmp_path: Path) -> None:
    wide, small = tmp_path / "wide", tmp_path / "small"
    export_hf(build_full_model(WIDER, seed=0).state_dict(), WIDER, wide)
    export_hf(build_full_model(SMALL, seed=0).state_dict(), SMALL, small)
    (wide / "config.json").write_text((small / "config.json").read_text())  # another model's config.json
    with pytest.raises(ValueError, match="does not hold the model its config.json describes: tensor .* shape"):
        prepare(["--source", str(wide)])


def test_weights_without_their_config_are_named(tmp_path: Path) -> None:
    export_hf(build_full_model(SMALL, seed=0).state_dict(), SMALL, tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"holds \*\.safetensors but no config\.json"):
        prepare(["--source", str(tmp_path)])
