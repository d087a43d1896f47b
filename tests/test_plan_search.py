"""Layout search (plan/search.py) and `hybridpar plan` on synthetic hardware where the answer is known,
with a fake memory model (the search takes the memory model as an argument)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from hybridpar.config import Config
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.plan.cost import placement
from hybridpar.plan.hardware import parse_hardware
from hybridpar.plan.main import main, run
from hybridpar.plan.search import GIB, plan

DOCS = Path(__file__).parents[1] / "docs" / "hardware"


@dataclass
class Est:
    total: int


def params_memory(per_param_bytes: float = 16.0):
    """Fake memory: weights, gradients and AdamW state of the rank's share, nothing else."""

    def memory(cfg: Config) -> list[Est]:
        m, p = cfg.model, cfg.parallel
        n = m.n_layers * (4 * m.dim * m.dim + 3 * m.dim * m.ffn_dim) + 2 * m.vocab_size * m.dim
        return [Est(int(n * per_param_bytes / (p.tp * p.pp)))] * p.pp

    return memory


def no_memory(cfg: Config) -> list[Est]:
    return [Est(0)] * cfg.parallel.pp


def hw(nodes=1, per_node=4, memory_gib=16.0, inter_bw=10.0, **extra):
    return parse_hardware(
        {
            "name": "t",
            "source": "test",
            "nodes": nodes,
            "devices_per_node": per_node,
            "device_memory_gib": memory_gib,
            "peak_tflops": {"fp32": 1.0, "bf16": 0.0},
            "intra_node": {"bandwidth_gbs": 100.0, "latency_us": 2.0},
            "inter_node": {"bandwidth_gbs": inter_bw, "latency_us": 20.0},
            "memory_bandwidth_gbs": 200.0,
        }
        | extra
    )


def test_every_returned_layout_is_valid_and_ranked() -> None:
    result = plan(Config(), hw(), no_memory, world=4, top=10)
    got = result.candidates
    assert len(got) == 10 and result.simulated >= 10 and result.considered > result.simulated
    times = [c.prediction.step_s for c in got]
    assert times == sorted(times)
    for c in got:
        validate_config(c.cfg, 4)
        assert c.cfg.train.precision == "fp32"  # the hardware has no bf16
        assert c.tokens_per_s == pytest.approx(16 * 128 / c.prediction.step_s) and 0 < c.mfu < 1
        assert c.reason and 0 <= c.prediction.bubble < 1
    assert "vs #2" in got[0].reason and "slower than #1" in got[1].reason
    assert got[0].to_dict()["parallel"]["tp"] == got[0].cfg.parallel.tp


def test_memory_prunes_and_the_smallest_layout_is_named() -> None:
    one = Config()
    one.parallel.tp = one.parallel.pp = 1
    full = params_memory()(one)[0].total  # the whole model on one device
    tight = hw(memory_gib=full / 3 / GIB)  # needs tp x pp >= 4 to fit
    got = plan(Config(), tight, params_memory(), world=4, top=5).candidates
    assert got and all(c.cfg.parallel.tp * c.cfg.parallel.pp == 4 for c in got)
    assert all(max(c.memory) <= tight.device_memory_bytes for c in got)
    hopeless = hw(memory_gib=full / 8 / GIB)
    with pytest.raises(ValueError) as e:
        plan(Config(), hopeless, params_memory(), world=4)
    msg = str(e.value)
    assert msg.startswith("no layout fits: the smallest needs ") and "GiB per device" in msg and "\n" not in msg
    assert f"the hardware has {hopeless.device_memory_gib:g}" in msg


def test_working_copies_are_chosen_only_where_autocast_does_not_fit() -> None:
    """bf16 working copies cost what autocast costs and hold less: the search tries them where a bf16 layout
    does not fit under autocast (here: no model split, dp4), nowhere else, and not where the weights are held."""

    def memory(cfg: Config) -> list[Est]:
        return params_memory(10.0 if cfg.train.bf16_weights == "copies" else 16.0)(cfg)

    one = Config()
    one.model.n_layers, one.parallel.tp, one.parallel.pp = 2, 1, 1
    whole = params_memory()(one)[0].total  # autocast, the whole model on one device: 16 bytes a parameter
    h = hw(memory_gib=whole / 1.5 / GIB, peak_tflops={"fp32": 1.0, "bf16": 2.0})
    base = Config()
    base.model.n_layers, base.train.global_batch = 2, 4
    fixed = {"train.precision": "bf16", "parallel.schedule": "1f1b", "train.recompute": "none"}
    got = plan(base, h, memory, world=4, top=100, fixed=fixed).candidates
    copies = [c.cfg.train.bf16_weights == "copies" for c in got]
    assert any(copies) and not all(copies)
    for c, on in zip(got, copies):
        assert on == (c.cfg.parallel.tp * c.cfg.parallel.pp == 1), c.label
        assert ("copies" in c.label) == on and c.to_dict()["train"]["bf16_weights"] == c.cfg.train.bf16_weights
        validate_config(c.cfg, 4)
    held = plan(base, h, memory, world=4, top=100, fixed={**fixed, "train.bf16_weights": "autocast"})
    assert all(
        c.cfg.train.bf16_weights == "autocast" and c.cfg.parallel.tp * c.cfg.parallel.pp > 1 for c in held.candidates
    )


def test_slow_inter_node_link_keeps_gradient_reductions_inside_nodes() -> None:
    cfg = Config()
    cfg.model.dim, cfg.model.ffn_dim, cfg.train.seq_len, cfg.train.global_batch = 256, 704, 16, 8
    fast, slow = hw(nodes=2, per_node=2, inter_bw=100.0), hw(nodes=2, per_node=2, inter_bw=0.01)
    top_slow = plan(cfg, slow, no_memory, top=1).candidates[0]
    p = top_slow.cfg.parallel
    assert p.dp == 1 or placement(p, slow).dp is slow.intra_node  # no gradient all-reduce across nodes
    assert p.tp <= 2  # and tensor parallelism never leaves a node
    assert plan(cfg, fast, no_memory, top=1).candidates[0].prediction.step_s < top_slow.prediction.step_s


def test_impossible_worlds_are_one_line() -> None:
    with pytest.raises(ValueError, match=r"^world 7 cannot be split: .*train.global_batch=16$"):
        plan(Config(), hw(per_node=8), no_memory, world=7)
    with pytest.raises(ValueError, match="world 8 exceeds the 4 devices"):
        plan(Config(), hw(), no_memory, world=8)


def test_plan_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    f = DOCS / "dgx-a100-80gb.toml"
    result, got_hw, _ = run(["--hardware", str(f), "--world", "8", "--top", "3", "--model.n_layers", "8"], no_memory)
    assert len(result.candidates) == 3 and got_hw.name.startswith("DGX A100")
    assert all(c.cfg.model.n_layers == 8 and c.cfg.parallel.world_size == 8 for c in result.candidates)
    assert main(["--hardware", str(tmp_path / "missing.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hybridpar plan: cannot read hardware file") and "\n" not in err
    assert main(["--hardware", str(f), "--model.dim", "102"]) == 2  # dim not divisible by heads
    assert "model.dim=102 is not divisible by model.n_heads=4" in capsys.readouterr().err
    # The schedule's rules (above config/) run too, before anything is planned.
    assert main(["--hardware", str(f), "--parallel.schedule", "zb_v"]) == 2
    assert "parallel.schedule='zb_v' is not one of gpipe, 1f1b" in capsys.readouterr().err


def test_context_parallel_layouts_are_searched_where_the_sequence_is_long() -> None:
    """cp is a knob where each of a rank's two chunks holds MIN_CP_CHUNK tokens: at seq_len 1024, cp2 and
    cp4 (chunks of 256 and 128); at the default 128, none (a chunk of 32)."""
    base = Config()
    base.model.n_layers, base.train.global_batch = 2, 4
    fixed = {"parallel.schedule": "1f1b", "train.recompute": "none", "train.precision": "fp32"}
    with pytest.raises(ValueError, match="parallel.cp=2"):
        plan(base, hw(), params_memory(), world=4, fixed={**fixed, "parallel.cp": 2})
    base.train.seq_len = 1024
    found = plan(base, hw(), params_memory(), world=4, top=100, fixed=fixed).candidates
    cps = {c.cfg.parallel.cp for c in found}
    assert cps == {1, 2, 4}, cps
    for c in found:
        validate_config(c.cfg, 4)
        assert ("cp" in c.label) == (c.cfg.parallel.cp > 1) and c.to_dict()["parallel"]["cp"] == c.cfg.parallel.cp
