"""bf16 mixed precision (`--train.precision bf16`): compute under bfloat16 autocast, fp32 master weights,
optimizer state and gradient reductions, pipeline messages in bfloat16.

The tolerance against one device, derived: a bf16 run is not bit-reproducible across layouts, because a
pipeline rounds the residual stream to bf16 at each stage boundary (and its gradient on the way back),
and tensor parallelism sums bf16 partial products. Each such rounding is at most bf16's unit roundoff,
u = 2^-9, relative. So (1) each step's loss must stay within u x |loss| of one-device bf16 training (one
rounding of the loss itself; measured: 2e-4 to 1.2e-3 at loss 5.5, bound 1.1e-2), and (2) the trained
parameters must be no farther from an fp64 run of the same training than one-device bf16 training is,
within 1.5x — DESIGN.md's criterion for fp32, with bf16's own noise as the yardstick (measured ratios
1.00-1.10 for the largest difference, 0.98-1.04 for the L2 norm)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridpar.config import Config
from hybridpar.model.reference import U_BF16, tiny_config
from hybridpar.topology.spawn import run_ranks
from tests.references import check_fp64, computing, ref_for
from tests.test_equivalence import _worker, grid_config

BF16 = dict(precision="bf16")


COPIES = dict(precision="bf16", bf16_weights="copies")
COMPILED = dict(compile=True, compile_backend="aot_eager", recompute="selective")  # tests/test_equivalence.py's
TREE = dict(global_batch=8, microbatches=2)  # parallel.grad_sum tree at dp 2: equal microbatches, powers of two
# Working copies' runs train 4 of the tiny model's 8 layers: their yardstick is 12 one-device runs of its own.
HALF = dict(n_layers=4)
GPT2_HALF = HALF | dict(family="gpt2", n_kv_heads=None, n_positions=24)  # model/reference.py's gpt2_config
# (tp, pp, dp, schedule, virtual stages, train settings, other parallel settings[, model settings]); bf16
# working copies (train.bf16_weights copies) are held to one-device training with working copies, by the same
# tolerances. GPT-2 with working copies at pp2: its tied embedding's two copies, one per end stage, each step
# a master of their own with the same summed gradient. Working copies under ZeRO-3 (bf16 slices gathered
# around each layer, fp32 master slices) compiled (aot_eager) with selective recomputation, and the tree
# gradient sum of their fp32 gradients. (Compiled under ZB-H1 at pp2 and at tp2: run once, docs/precision.md;
# compiled against eager working copies in process: tests/test_compile.py.)
LAYOUTS = {
    "world4": [
        (2, 2, 1, "1f1b", 1, BF16, {}),
        (1, 2, 2, "zb-h1", 1, BF16, {}),
        (2, 2, 1, "zb-h1", 1, COPIES, dict(sequence_parallel=True)),
        (1, 2, 1, "1f1b", 1, COPIES | dict(recompute="selective"), dict(cp=2)),
    ],
    "world2": [
        (1, 2, 1, "zb-v", 2, BF16, {}),
        (1, 2, 1, "interleaved-1f1b", 2, BF16, {}),
        (1, 1, 2, "1f1b", 1, COPIES, dict(zero=2)),
        (1, 1, 1, "1f1b", 1, COPIES | dict(recompute="full"), dict(cp=2)),
        (1, 2, 1, "1f1b", 1, COPIES, {}, GPT2_HALF),
        (1, 1, 2, "1f1b", 1, COPIES | COMPILED, dict(zero=3)),
        (1, 1, 2, "1f1b", 1, COPIES | TREE, dict(grad_sum="tree")),
    ],
}


def _model(train: dict, given: list[dict]) -> dict:
    return given[0] if given else HALF if "bf16_weights" in train else {}


def _layout_configs(key: str) -> list[Config]:
    return [
        grid_config(pp, s, v, parallel=dict(tp=tp, pp=pp, dp=dp, **more), train=t, model=_model(t, m))
        for tp, pp, dp, s, v, t, more, *m in LAYOUTS[key]
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize("key", list(LAYOUTS))
def test_bf16_layouts_match_one_device_bf16(key: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    layouts, cfgs = LAYOUTS[key], _layout_configs(key)
    if key == "world2":  # out of the module's one 2-rank launch
        out, ranks = request.getfixturevalue("world2")
        tmp_path, results = out / "layouts", ranks[0]["layouts"]
    else:
        with computing(cfgs):  # the references, while the ranks run
            results = run_ranks(_worker, 4, [c.to_dict() for c in cfgs], str(tmp_path), timeout_s=400)[0]
    for i, (cfg, (losses, _)) in enumerate(zip(cfgs, results)):
        ref_losses = ref_for(cfg)[0]  # one-device bf16: autocast over fp32 parameters, or working copies
        label = f"{layouts[i]}"
        for s, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(a - b) <= U_BF16 * abs(b), f"{label}: step {s} loss {a} vs one-device bf16 {b}"
        check_fp64(f"bf16 {label}", torch.load(tmp_path / f"state{i}.pt", weights_only=True), cfg)


def _bytes_worker(cfg_dicts: list[dict]) -> list[int]:
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    out = []
    for d in cfg_dicts:
        cfg = Config.from_dict(d)
        p = cfg.parallel
        tr = Trainer(cfg, build_topology(p.dp, p.pp, p.tp, "gloo", 60.0))
        tr.step(0)
        out.append(sum(s.sent_bytes for s in tr.p2p.stats.values()))
    return out


@pytest.mark.multiprocess
def test_bf16_halves_the_pipeline_bytes(world2: tuple[Path, list[dict]]) -> None:
    for fp32, bf16, copies in (r["bytes"] for r in world2[1]):  # working copies' messages are bf16 too
        assert fp32 > 0 and bf16 * 2 == fp32 and copies == bf16, (fp32, bf16, copies)


def _resume_worker(cfg_d: dict, run_dir: str) -> dict:
    from hybridpar.run.train import train

    cfg = Config.from_dict(cfg_d)
    cfg.run_dir = run_dir
    res = train(cfg, log=False)
    if res.state is not None:
        torch.save(res.state, Path(run_dir).with_suffix(".pt"))
    return {"losses": res.losses, "start": res.start_step}


STEPS = 4
TERM = "rank=1:term@step=1:phase=forward"


def _resume_config(fault: str, resume: str) -> dict:
    c = tiny_config(
        parallel=dict(tp=1, pp=2, dp=1, schedule="1f1b"),
        train=dict(steps=STEPS, **BF16),
        checkpoint=dict(every=STEPS, resume=resume),
        emulate=dict(fault=fault),
    )
    return c.to_dict()


def _across_runs(out: Path) -> list[tuple[dict, str]]:
    """A working-copies run of 3 steps at pp 2 checkpointed after step 2; then from that checkpoint the same
    run again, an autocast run at dp 2 under ZeRO-1 (another mode and layout), and a working-copies run at
    dp 2 under ZeRO-3 (the masters loaded into its fp32 slices, its bf16 slices rounded from them)."""
    ck = str(out / "copies" / "checkpoints" / "step-000002")
    runs = [
        (dict(pp=2), COPIES, "off", "copies"),
        (dict(pp=2), COPIES, ck, "again"),
        (dict(dp=2, zero=1), BF16, ck, "auto"),
        (dict(dp=2, zero=3), COPIES, ck, "zero3"),
    ]
    return [
        (
            tiny_config(
                model=HALF,
                parallel=dict(tp=1, pp=1, dp=1, schedule="1f1b") | par,
                train=dict(steps=3, **train),
                checkpoint=dict(every=2 if resume == "off" else 0, resume=resume),
            ).to_dict(),
            str(out / name),
        )
        for par, train, resume, name in runs
    ]


def _world2_worker(layouts: list[dict], bytes_cfgs: list[dict], resume_runs: list[tuple[dict, str]], out: str) -> dict:
    """The 2-rank tests' work in turn, each from scratch: the bf16 layouts, the pipeline bytes, then the
    uninterrupted and the preempted bf16 runs (the preempted one last: its SIGTERM ends the training)."""
    res = {"layouts": _worker(layouts, f"{out}/layouts"), "bytes": _bytes_worker(bytes_cfgs)}
    res["resume"] = [_resume_worker(*run) for run in resume_runs]
    return res


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> tuple[Path, list[dict]]:
    """One launch for the 2-rank work of the tests here (a launch costs ~2.5 s of two interpreters
    importing torch before their first step); each test reads only its own part. The launch does the parts
    of the tests this session runs: tests/test_kernels.py's lanes run the bf16 layouts alone (each lane's
    resume and byte runs cost 10 s at load 4, and nothing read them)."""
    runs = {item.originalname for item in request.session.items if item.path == request.path}
    out = tmp_path_factory.mktemp("world2")
    (out / "layouts").mkdir()
    layouts, bytes_cfgs, resume = [], [], []
    if "test_bf16_layouts_match_one_device_bf16" in runs:
        layouts = [c.to_dict() for c in _layout_configs("world2")]
    if "test_bf16_halves_the_pipeline_bytes" in runs:
        bytes_cfgs = [tiny_config(parallel=dict(tp=1, pp=2, dp=1), train=tr).to_dict() for tr in ({}, BF16, COPIES)]
    if "test_copies_checkpoint_the_masters_and_resume_across_modes" in runs:
        resume = _across_runs(out)
    if "test_bf16_resumes_exactly_from_its_fp32_masters" in runs:  # the preempted run stays last
        resume += [(_resume_config("", "off"), str(out / "whole")), (_resume_config(TERM, "off"), str(out / "cut"))]
    with computing(_layout_configs("world2") if layouts else []):  # the layouts' references, while the ranks run
        return out, run_ranks(_world2_worker, 2, layouts, bytes_cfgs, resume, str(out), timeout_s=400)


@pytest.mark.multiprocess
def test_bf16_resumes_exactly_from_its_fp32_masters(world2: tuple[Path, list[dict]]) -> None:
    """Checkpoints hold the fp32 masters and AdamW state: a bf16 run preempted after step 2 and resumed
    ends bit for bit where the uninterrupted bf16 run does."""
    tmp_path, ranks = world2
    whole, first = ranks[0]["resume"][-2:]
    # The resume needs a launch of its own, as after a real preemption.
    second = run_ranks(_resume_worker, 2, _resume_config("", "auto"), str(tmp_path / "cut"), timeout_s=240)[0]
    assert second["start"] == 2 and first["losses"] + second["losses"] == whole["losses"]
    a = torch.load(tmp_path / "whole.pt", weights_only=True)
    b = torch.load(tmp_path / "cut.pt", weights_only=True)
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.multiprocess
def test_copies_checkpoint_the_masters_and_resume_across_modes(world2: tuple[Path, list[dict]]) -> None:
    """A working-copies checkpoint holds the fp32 masters and their AdamW state (the bf16 copies are made from
    them): resumed as it was it ends bit for bit where the uninterrupted run does; resumed by autocast at
    another layout, or by working copies under ZeRO-3, its steps stay within bf16's unit roundoff of the
    working-copies run's."""
    tmp_path, ranks = world2
    whole, again, auto, zero3 = ranks[0]["resume"][:4]
    assert again["start"] == auto["start"] == zero3["start"] == 2 and again["losses"] == whole["losses"][2:]
    a = torch.load(tmp_path / "copies.pt", weights_only=True)
    b = torch.load(tmp_path / "again.pt", weights_only=True)
    assert all(a[n].dtype == torch.float32 and torch.equal(a[n], b[n]) for n in a)
    for other in (auto, zero3):
        for x, y in zip(other["losses"], whole["losses"][2:], strict=True):
            assert abs(x - y) <= U_BF16 * abs(y), (other["losses"], whole["losses"])
