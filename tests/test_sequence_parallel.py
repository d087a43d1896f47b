"""parallel.sequence_parallel (model/tp.py): the regions between the tp-sharded matmuls hold 1/tp of the
sequence. Bad settings are refused in one line before launch; the pipeline's messages carry 1/tp of the
sequence; and every schedule and axis it composes with trains the same model as one device (tp3 with an
odd vocabulary runs in tests/test_equivalence.py's world-3 launch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpar import cli
from hybridpar.model.reference import gpt2_config, tiny_config


def _refused(flags: list[str], run: Path, capsys: pytest.CaptureFixture) -> str:
    capsys.readouterr()
    rc = cli.main(["train", *flags, "--parallel.pp", "1", "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and not run.exists(), err
    return err


def test_bad_settings_are_refused_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sp = ["--parallel.sequence_parallel", "true"]
    err = _refused([*sp, "--parallel.tp", "1"], tmp_path / "r", capsys)
    assert "parallel.sequence_parallel splits the sequence over the tp ranks, but parallel.tp=1" in err
    err = _refused([*sp, "--parallel.tp", "2", "--train.seq_len", "33"], tmp_path / "r", capsys)
    assert "parallel.tp=2 does not divide train.seq_len=33 (use a multiple of 2)" in err


def sp_configs() -> list:
    """The layouts of the shared launch (world 4): both families, 1F1B and the zero-bubble B/W split
    under selective recomputation, and ZeRO-2 over dp (the norm gradients summed over tp from kept slices)."""
    from tests.test_equivalence import grid_config

    sp = dict(tp=2, pp=2, dp=1, sequence_parallel=True)
    cfgs = [
        grid_config(2, "1f1b", 1, parallel=sp),
        grid_config(2, "zb-h1", 1, parallel=sp, train=dict(recompute="selective")),
        grid_config(1, "1f1b", 1, parallel=dict(sp, pp=1, dp=2, zero=2)),
        gpt2_config(**sp, schedule="1f1b"),
    ]
    return cfgs


@pytest.mark.multiprocess
def test_sequence_parallel_layouts_equal_one_device(tmp_path: Path) -> None:
    from tests.test_equivalence import check_layouts

    cfgs = sp_configs()
    assert tiny_config().parallel.sequence_parallel is False  # the default stays off
    check_layouts(cfgs, tmp_path)
