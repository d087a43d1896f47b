"""parallel.sequence_parallel (model/tp.py): the regions between the tp-sharded matmuls hold 1/tp of the
sequence. Bad settings are refused in one line before launch; the pipeline's messages carry 1/tp of the
sequence; and every schedule and axis it composes with trains the same model as one device (tp3 with an
odd vocabulary runs in tests/test_equivalence.py's world-3 launch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpar import cli
from hybridpar.config import Config
from hybridpar.model.reference import gpt2_config, tiny_config
from hybridpar.plan.memory_model import rank_memory
from hybridpar.plan.search import plan


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


def test_the_memory_model_holds_the_norm_regions_and_messages_at_one_tp_th() -> None:
    cfg = Config()  # tp2 x pp2, seq 128
    sp = Config.from_dict(cfg.to_dict())
    sp.parallel.sequence_parallel = True
    for plain, split in zip(rank_memory(cfg), rank_memory(sp)):
        assert split.activations < plain.activations and split.buffers < plain.buffers
        assert (split.params, split.grads, split.optimizer) == (plain.params, plain.grads, plain.optimizer)


def test_the_planner_searches_sequence_parallelism() -> None:
    from tests.test_plan_search import Est, hw

    def fits_with_sp_only(cfg: Config) -> list[Est]:
        return [Est(0 if cfg.parallel.sequence_parallel else 1 << 50)] * cfg.parallel.pp

    got = plan(Config(), hw(), fits_with_sp_only, world=4, top=5).candidates
    assert got and all(c.cfg.parallel.sequence_parallel and c.cfg.parallel.tp > 1 for c in got)
    assert all(c.label.endswith(" sp") or " sp " in c.label for c in got)
    assert got[0].to_dict()["parallel"]["sequence_parallel"] is True
    odd = Config()
    odd.train.seq_len = 127  # splits over no tp > 1: no layout may use it
    with pytest.raises(ValueError, match="no layout fits"):
        plan(odd, hw(), fits_with_sp_only, world=4)


def test_the_planner_searches_context_parallelism_with_sequence_parallelism() -> None:
    """At seq_len 1024 on 8 devices the search offers cp with sequence parallelism (each of a cp rank's two
    chunks split over tp), every such layout valid; where 2 cp tp does not divide the sequence, it does not."""
    from hybridpar.pipeline.schedules.config_rules import validate_config
    from tests.test_plan_search import Est, hw

    def fits_with_cp_and_sp_only(cfg: Config) -> list[Est]:
        p = cfg.parallel
        return [Est(0 if p.sequence_parallel and p.cp > 1 else 1 << 50)] * p.pp

    base = Config()
    base.model.n_layers, base.train.global_batch, base.train.seq_len = 2, 4, 1024
    fixed = {"parallel.schedule": "1f1b", "train.recompute": "none", "train.precision": "fp32"}  # a quicker search
    got = plan(base, hw(per_node=8), fits_with_cp_and_sp_only, world=8, top=50, fixed=fixed).candidates
    assert got and {(c.cfg.parallel.tp, c.cfg.parallel.cp) for c in got} >= {(2, 2), (2, 4), (4, 2)}
    for c in got:
        validate_config(c.cfg, 8)
        assert " sp " in c.label and f"cp{c.cfg.parallel.cp}" in c.label, c.label
    odd = Config.from_dict(base.to_dict())
    odd.train.seq_len = 1028  # 2 cp = 4 splits it (chunks of 257), 2 cp tp = 8 does not: no cp with sp
    with pytest.raises(ValueError, match="no layout fits"):
        plan(odd, hw(per_node=8), fits_with_cp_and_sp_only, world=8, top=5, fixed=fixed)


def sp_configs() -> list:
    """The layouts of the shared launch (world 4): both families, 1F1B and the zero-bubble B/W split, and
    ZeRO-2 over dp (the norm gradients summed over tp from kept slices). Model and train settings are
    tests/test_equivalence.py's, so its single-device references and yardsticks serve here too."""
    from tests.test_equivalence import grid_config

    sp = dict(tp=2, pp=2, dp=1, sequence_parallel=True)
    cfgs = [
        grid_config(2, "1f1b", 1, parallel=sp),
        grid_config(2, "zb-h1", 1, parallel=sp),
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
