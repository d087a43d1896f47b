"""The counted memory traffic of hybridpar's own eager runtime (plan/traffic.py) and the GPU cost model's use of it:
an op's bytes are what it reads and writes, views and matmuls move none; a pass's bytes are affine in its tokens;
the closed form solved from two scaled-down shapes is the direct count; the per-parameter facts (autocast's weight
casts, fp32 accumulation, fused AdamW) come out of the count; and only a calibration saying `elementwise =
"counted"` uses it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridpar.config import Config, ModelConfig
from hybridpar.model.registry import param_counts
from hybridpar.plan.cost import CLIP_BYTES, CostModel
from hybridpar.plan.hardware import parse_hardware
from hybridpar.plan.step import optimizer_s, predict
from hybridpar.plan.traffic import (
    SEQ,
    Counter,
    Settings,
    Tally,
    Traffic,
    _affine,
    count_optimizer,
    count_stage,
    traffic,
)
from tests.test_plan_gpu_model import table
from tests.test_plan_hardware import good

SMALL = ModelConfig(dim=256, n_layers=2, n_heads=8, ffn_dim=704, vocab_size=256)  # counted at scales 4 and 8


def test_an_op_counts_what_it_reads_and_writes_and_views_and_matmuls_nothing() -> None:
    a, b, row = torch.ones(4, 4), torch.ones(4, 4), torch.ones(4)
    with Counter() as c:
        a + b  # reads 2 x 64 bytes, writes 64
    assert c.tally == Tally(192, 1)
    with Counter() as c:
        a.add_(b)  # reads a and b, writes a
        a.view(16)  # a view: nothing
        a @ b  # a matmul: costed at its FLOP rate, not here; counted apart (its dispatch)
    assert c.tally == Tally(192, 1, 1)
    with Counter() as c:
        a * row.expand(4, 4)  # a broadcast operand is read once
    assert c.tally == Tally(64 + 16 + 64, 1)
    with Counter() as c:
        a.to(torch.bfloat16)  # a cast: 4 bytes read, 2 written per element
    assert c.tally == Tally(16 * 6, 1)


@pytest.fixture(scope="module")
def direct() -> tuple:
    return _affine(SMALL, Settings())  # (layer forward, layer backward, ends forward, ends backward) counted


def test_a_pass_is_affine_in_its_tokens(direct: tuple) -> None:
    far = 3 * SEQ[1]
    one = count_stage(SMALL, Settings(), 1, far)  # a one-layer stage: a layer and the ends
    for counted, layer, ends in ((one.forward, direct[0], direct[2]), (one.backward, direct[1], direct[3])):
        assert counted.nbytes == pytest.approx((layer.at(far) + ends.at(far)).nbytes, rel=1e-9)
        assert counted.ops == (layer.at(far) + ends.at(far)).ops > 0  # the same kernels whatever the tokens
        assert layer.per_token.ops == ends.per_token.ops == 0


def test_the_closed_form_from_scaled_shapes_is_the_direct_count(direct: tuple) -> None:
    solved = traffic(SMALL, Settings())
    for a, b in zip((solved.layer_f, solved.layer_b, solved.ends_f, solved.ends_b), direct):
        for tokens in (SEQ[0], 2048):
            assert a.at(tokens).nbytes == pytest.approx(b.at(tokens).nbytes, rel=0.01)
            assert a.at(tokens).ops == pytest.approx(b.at(tokens).ops)


def test_the_count_finds_the_casts_the_accumulation_and_the_fused_adamw(direct: tuple) -> None:
    norms = 2 * SMALL.dim  # the layer's two norm weights, read once a pass
    matrices = param_counts(SMALL).layer - norms
    copies, fp32 = _affine(SMALL, Settings(weights="copies")), _affine(SMALL, Settings(precision="fp32"))
    # autocast casts each weight matrix once a pass (4 bytes read, 2 written); working copies and fp32 do not.
    assert direct[0].per_pass.nbytes == 6 * matrices + 4 * norms
    assert copies[0].per_pass.nbytes == 2 * norms and fp32[0].per_pass.nbytes == 4 * norms
    # fp32: each weight gradient summed into .grad (read both, write one: 12 bytes); autocast's bf16 gradient of
    # a matrix is widened first (2 read, 4 written), as working copies' are.
    assert fp32[1].per_pass.nbytes == pytest.approx(12 * (matrices + norms), rel=0.01)
    assert direct[1].per_pass.nbytes == pytest.approx(18 * matrices + 12 * norms, rel=0.01)
    fused, _ = count_optimizer(SMALL, Settings())
    assert fused == pytest.approx(28 + CLIP_BYTES, rel=1e-3)  # p, g, m, v read, p, m, v written, once
    assert count_optimizer(SMALL, Settings(fused=False))[0] > fused  # foreach: a pass per arithmetic op
    assert count_optimizer(SMALL, Settings(weights="copies"))[0] == pytest.approx(fused + 6, rel=1e-3)


def _hw(elementwise: str | None):  # noqa: ANN202
    d = good() | {"memory_bandwidth_gbs": 1000.0}
    d["gpu_calibration"] = table() | ({} if elementwise is None else {"elementwise": elementwise})
    return parse_hardware(d, "test")


def test_only_a_counted_calibration_uses_the_count_and_a_compiled_run_keeps_the_fixed_one(direct: tuple) -> None:
    cfg = Config()
    cfg.model, cfg.train.precision = SMALL, "bf16"
    counted, fixed = CostModel(SMALL, _hw("counted")), CostModel(SMALL, _hw(None))
    link = counted.hw.intra_node
    tokens = 4 * cfg.train.seq_len
    ct = Traffic(*direct)  # the count the cost model would make, given (counting is tested above)
    counted._traffic[Settings.of(cfg.train, "none")] = ct
    lay = counted.layer(cfg.train, 1, tokens, link, "none")
    bw = counted.hw.memory_bps()
    assert lay.f.memory_s == pytest.approx(ct.layer_f.at(tokens).nbytes / bw)
    assert lay.b.memory_s == pytest.approx(ct.layer_b.at(tokens).nbytes / bw)
    assert fixed.layer(cfg.train, 1, tokens, link, "none").f.memory_s < lay.f.memory_s
    assert fixed.counted(cfg.train, "none") is None and fixed.optimizer_bytes("bf16", False, "auto") is None
    embed, head = counted.ends(cfg.train, 1, tokens, link)  # the ends: their counted bytes between the two
    whole = ct.ends_f.at(tokens).nbytes + ct.ends_b.at(tokens).nbytes
    assert embed.memory_s + head.memory_s == pytest.approx(whole / bw) and 0 < embed.memory_s < head.memory_s
    # The optimizer: the runtime's AdamW as counted (clipping apart), foreach's passes dearer than fused's one.
    assert counted.optimizer_bytes("bf16", False, "auto") == pytest.approx(28, rel=1e-3)
    step = lambda model, fused: optimizer_s(model, 1, 1, 0, link, 1e6, fused_adamw=fused)  # noqa: E731
    assert step(counted, "off") > 2 * step(counted, "auto") and step(fixed, "off") == step(fixed, "auto")
    compiled = dataclasses.replace(cfg.train, compile=True)
    assert counted.layer(compiled, 1, tokens, link, "none") == fixed.layer(compiled, 1, tokens, link, "none")


@pytest.fixture(scope="module")
def full() -> tuple:
    return _affine(SMALL, Settings(recompute="full"))


def _kernels(floor_us: float, dispatch_us: float, direct: tuple, full: tuple) -> CostModel:
    """A cost model of SMALL on a counted calibration with the probe's kernel figures (0: absent, as in the
    hardware files), given the counts it would make (counting is tested above)."""
    figures = {k: v for k, v in (("kernel_floor_us", floor_us), ("dispatch_us", dispatch_us)) if v}
    d = good() | {"memory_bandwidth_gbs": 1000.0, "gpu_calibration": table() | {"elementwise": "counted", **figures}}
    model = CostModel(SMALL, parse_hardware(d, "test"))
    for recompute, counted in (("none", direct), ("full", full)):
        model._traffic[Settings.of(_bf16().train, recompute)] = Traffic(*counted)
    return model


def _bf16() -> Config:
    cfg = Config()
    cfg.model, cfg.train.precision, cfg.train.microbatches, cfg.train.global_batch = SMALL, "bf16", 2, 4
    cfg.parallel = dataclasses.replace(cfg.parallel, tp=1, pp=1)  # one device: the step is its passes in a row
    return cfg


def test_absent_kernel_figures_price_no_kernel_and_a_compiled_run_none(direct: tuple, full: tuple) -> None:
    cfg, link = _bf16(), _hw("counted").intra_node
    bare, priced = _kernels(0, 0, direct, full), _kernels(5.0, 20.0, direct, full)
    lay = bare.layer(cfg.train, 1, 512, link, "none")
    assert lay.f.ops_s == lay.b.ops_s == lay.w.ops_s == 0.0
    assert priced.layer(cfg.train, 1, 512, link, "none").f.ops_s > 0
    compiled = dataclasses.replace(cfg.train, compile=True)  # inductor's kernels are not the counted ones
    assert priced.layer(compiled, 1, 512, link, "none") == bare.layer(compiled, 1, 512, link, "none")


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_the_device_pays_a_floor_per_counted_kernel_and_the_host_a_dispatch_per_op(
    direct: tuple, full: tuple, recompute: str
) -> None:
    """Floor-bound (no dispatch figure): a pass's compute grows by its counted kernels x the floor, exactly;
    host-bound (a dispatch far above every kernel's time): it takes the host's dispatch of every op, GEMMs and
    attention included. The backward's count holds its recomputation's kernels."""
    cfg, link, tokens = _bf16(), _hw("counted").intra_node, 512
    f, b = direct[0].at(tokens), (direct if recompute == "none" else full)[1].at(tokens)
    assert (f.ops, f.matmuls, b.ops) == (44, 8, 94 if recompute == "none" else 128)
    bare = _kernels(0, 0, direct, full).layer(cfg.train, 1, tokens, link, recompute)
    floor = _kernels(7.0, 0, direct, full).layer(cfg.train, 1, tokens, link, recompute)
    assert floor.f.compute == pytest.approx(bare.f.compute + f.ops * 7e-6, rel=1e-12)
    assert floor.b.compute + floor.w.compute == pytest.approx(bare.b.compute + bare.w.compute + b.ops * 7e-6)
    host = _kernels(0, 900.0, direct, full).layer(cfg.train, 1, tokens, link, recompute)
    assert host.f.compute == pytest.approx((f.ops + f.matmuls) * 900e-6, rel=1e-12)
    assert host.b.compute + host.w.compute == pytest.approx((b.ops + b.matmuls) * 900e-6, rel=1e-12)


def test_the_step_pays_the_floor_of_every_kernel_it_runs(direct: tuple, full: tuple) -> None:
    """A step of m microbatches through L layers and the ends costs m x (L x a layer's kernels + the ends') floors
    more than without the figure: the test that fails if the floor is not applied."""
    cfg = _bf16()
    base, floor = (predict(_kernels(us, 0, direct, full), cfg).step_s for us in (0, 3.0))
    layer, ends = direct[0].at(1).ops + direct[1].at(1).ops, direct[2].at(1).ops + direct[3].at(1).ops
    assert floor - base == pytest.approx(cfg.train.microbatches * (SMALL.n_layers * layer + ends) * 3e-6, rel=1e-9)
