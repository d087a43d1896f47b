"""ZeRO-1 and ZeRO-2 (`--parallel.zero 1`, `2`): each dp rank holds the AdamW state of 1/dp of every
parameter (and under ZeRO-2 its 1/dp slice of every gradient at rest) and the run still trains the
one-device model — every layout with dp > 1 (replicas of 6 and 5 samples), tied embeddings, a live
re-partition, and checkpoints resumed at another dp and ZeRO level (and back)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridpar.config import Config
from hybridpar.dataparallel.zero import keep_slice, part, slice_of, summed_grad
from hybridpar.plan.memory_model import rank_memory, stage_shapes
from hybridpar.topology.spawn import run_ranks
from tests.references import check_fp64, ref_for
from tests.test_copies import COPIES
from tests.test_equivalence import TOL, _worker, check_results, grid_config, tiny_config


def test_zero2_keeps_a_dp_th_of_the_gradients_in_tensors_of_their_own() -> None:
    """In process: the four dp ranks' kept slices of the default model's gradients (tp2's shapes, a
    column-parallel bias among them) are its gradient bytes / 4 within 2%, each in its own storage; the
    memory model says the same at dp=4."""
    cfg = tiny_config(parallel=dict(tp=2, pp=1, dp=4, zero=2), train=dict(global_batch=16))
    shapes = stage_shapes(cfg, [range(cfg.model.n_layers)], 0)
    whole = 4 * sum(torch.Size(s).numel() for s, _ in shapes)
    for r in range(4):
        kept = 0
        for shape, d in shapes:
            p = torch.nn.Parameter(torch.zeros(shape))
            p.grad = torch.randn(shape)
            s = slice_of(p.shape, d, 4)
            expect = part(p.grad, s, r).clone()
            keep_slice(p, s, r)
            g = summed_grad(p, s, r)
            assert torch.equal(g, expect) and (p.grad is None) == (s.dim is not None)
            kept += g.untyped_storage().nbytes()
        assert abs(kept - whole / 4) <= 0.02 * whole / 4, (r, kept, whole / 4)
    est = rank_memory(cfg)[0]
    assert est.grads == whole and abs(est.grads_at_rest - whole / 4) <= 0.02 * whole / 4


def test_zero_levels_are_checked_before_launch() -> None:
    """dp = 1 shards nothing: zero 1, 2 and 3 are accepted there and act as 0 (an elastic restart that
    shrinks dp keeps its configuration); a level that does not exist is named with the ones that do, and so
    is an unknown regather. Live re-partition runs under ZeRO-2 and 3 (tests/test_rebalance.py)."""
    from hybridpar.pipeline.schedules.config_rules import validate_config

    for zero in (1, 2, 3):
        validate_config(tiny_config(parallel=dict(dp=1, zero=zero)))
    with pytest.raises(ValueError, match=r"parallel.zero=4 is not one of 0, 1, 2, 3"):
        validate_config(tiny_config(parallel=dict(zero=4)))
    with pytest.raises(ValueError, match=r"parallel.zero3_regather='layer' is not one of microbatch, step"):
        validate_config(tiny_config(parallel=dict(zero=3, zero3_regather="layer")))
    balance = dict(mode="auto")
    for zero in (2, 3):
        validate_config(tiny_config(parallel=dict(tp=1, pp=2, dp=2, schedule="1f1b", zero=zero), balance=balance))


def test_slices_are_rows_of_the_local_tensor_with_the_left_over_on_rank_0() -> None:
    """Every slice is one block of the local tensor's storage (its first dimension, whatever tp shards):
    n // dp rows each, dp rank 0 first with the n % dp rows left over; the equal shares lie one after the
    other, so the collectives work in place."""
    from hybridpar.dataparallel.zero import equal_rows, left_over, share

    s = slice_of(torch.Size([10, 6]), None, 3)
    assert (s.dim, s.offsets, s.sizes, left_over(s)) == (0, (0, 4, 7), (4, 3, 3), 1)
    assert slice_of(torch.Size([8, 6]), 0, 2) == slice_of(torch.Size([8, 6]), 1, 2)  # tp's dim: the same cut
    assert slice_of(torch.Size([8, 6]), 0, 2).sizes == (4, 4)
    s = slice_of(torch.Size([3]), None, 4)  # fewer rows than ranks: all on rank 0
    assert (s.offsets, s.sizes) == ((0, 3, 3, 3), (3, 0, 0, 0))
    assert slice_of(torch.Size([8]), 0, 2).sizes == (4, 4)  # a column-parallel bias is sliced too
    assert slice_of(torch.Size([8, 8]), None, 1).dim is None
    for n, dp in ((10, 3), (3, 4), (12, 4), (7, 2)):
        x = torch.arange(n * 5.0).reshape(n, 5)
        s = slice_of(x.shape, 0, dp)
        assert torch.equal(torch.cat([part(x, s, r) for r in range(dp)]), x)  # blocks in rank order, covering x
        flat = equal_rows(x, s)
        assert flat.numel() == dp * s.sizes[-1] * 5
        assert not flat.numel() or flat.data_ptr() == x[left_over(s)].data_ptr()
        for r in range(dp):  # rank r's share is the r-th equal piece of the rows after the left-over ones
            mine = share(part(x, s, r), s, r)
            assert mine.numel() == s.sizes[-1] * 5
            assert mine.numel() == 0 or mine.data_ptr() == flat[r * mine.numel() :].data_ptr()


def test_memory_model_knows_zero3() -> None:
    """At dp=4: ZeRO-3's parameters at rest are a quarter of ZeRO-0's (within 2%); at their peak the slices
    plus, per microbatch, the parameters outside layers and two layers, per step all of them; gradients
    whole at the peak and a quarter at rest (ZeRO-2's); optimizer state ZeRO-1's; never more than ZeRO-0."""
    est = {}
    for zero, mode in ((0, "microbatch"), (1, "microbatch"), (3, "microbatch"), (3, "step")):
        cfg = tiny_config(parallel=dict(tp=1, pp=1, dp=4, zero=zero, zero3_regather=mode), train=dict(global_batch=16))
        est[zero, mode] = rank_memory(cfg)[0]
    whole, z1, z3, z3s = est[0, "microbatch"], est[1, "microbatch"], est[3, "microbatch"], est[3, "step"]
    assert abs(z3.params_at_rest - whole.params / 4) <= 0.02 * whole.params / 4
    cfg = tiny_config(parallel=dict(tp=1, pp=1))
    middle = stage_shapes(cfg, [range(0, 1), range(1, 2), range(2, 3)], 1)  # a stage of one layer: a layer
    layer = 4 * sum(torch.Size(s).numel() for s, _ in middle)
    others = whole.params - cfg.model.n_layers * layer  # embedding, final norm, head
    assert others > 0 and z3.params == z3.params_at_rest + others + 2 * layer
    assert z3s.params == z3.params_at_rest + whole.params
    assert z3.grads == whole.grads and abs(z3.grads_at_rest - whole.grads / 4) <= 0.02 * whole.grads / 4
    assert z3.optimizer == z1.optimizer and z3.total <= whole.total and z3s.total <= whole.total
    # bf16 working copies: bf16 slices at rest and bf16 gathers (half the bytes), the fp32 master slices
    # beside the moments, gradients fp32 as before.
    copies = tiny_config(parallel=dict(tp=1, pp=1, dp=4, zero=3), train=dict(global_batch=16, **COPIES))
    c3 = rank_memory(copies)[0]
    assert 2 * c3.params_at_rest == z3.params_at_rest and 2 * c3.params == z3.params
    assert c3.grads == z3.grads and c3.grads_at_rest == z3.grads_at_rest
    assert c3.optimizer - z3.optimizer == z3.params_at_rest  # an fp32 master per element of the slices


def test_planner_offers_zero3_and_picks_it_where_memory_requires() -> None:
    """With a memory where only ZeRO-3 fits, every layout the planner returns is ZeRO-3 (dp > 1); with room
    for everything it prefers a cheaper level (ZeRO-3's per-use gathers cost time)."""
    from hybridpar.plan.search import GIB, plan
    from tests.test_plan_search import Est, hw

    def tight(cfg: Config) -> list[Est]:
        return [Est((2 if cfg.parallel.zero == 3 else 40) * GIB)] * cfg.parallel.pp

    got = plan(Config(), hw(), tight, world=4, top=3).candidates
    assert got and all(c.cfg.parallel.zero == 3 and c.cfg.parallel.dp > 1 for c in got), [c.label for c in got]
    roomy = plan(Config(), hw(), lambda cfg: [Est(0)] * cfg.parallel.pp, world=4, top=1).candidates[0]
    assert roomy.cfg.parallel.zero != 3, roomy.label


def _layout_configs() -> list[Config]:
    """Each layout under ZeRO-1, then under ZeRO-2 and 3 with tied embeddings (at pp2 the embedding's two
    copies sum their kept slices; under ZB-V both sit on rank 0, and the W pass writes gradients late).
    ZeRO-3: 1F1B with full recomputation and tp2 regather per microbatch (a layer recomputed in the backward
    is gathered again), ZB-V keeps its parameters through the step."""
    cfgs = []
    for zero in (1, 2, 3):
        tied = dict(tie_embeddings=zero >= 2)
        for s, v in (("1f1b", 1), ("zb-v", 2)):
            z = dict(zero=zero, zero3_regather="microbatch" if s == "1f1b" else "step")
            rec = dict(recompute="full" if zero == 3 and s == "1f1b" else "none")
            cfgs.append(grid_config(2, s, v, model=tied, parallel=dict(tp=1, pp=2, dp=2, **z), train=rec))
        cfgs.append(tiny_config(model=dict(tie_embeddings=True), parallel=dict(tp=2, pp=1, dp=2, zero=zero)))
    return cfgs


def _holds_configs() -> list[Config]:
    """No ZeRO, ZeRO-1, ZeRO-2, ZeRO-3 at dp=4, four microbatches a replica (gradients accumulate)."""
    return [tiny_config(parallel=dict(tp=1, pp=1, dp=4, zero=z), train=dict(global_batch=16)) for z in (0, 1, 2, 3)]


# The move comes at step 4 (the first full windows of readings); one a burst of load keeps from being confirmed
# is judged again at each next step (balance/control.py), and the steps after it are held to one device.
# Steps 8-11 of 12 only repeated the moved layout's steps (~1.3 s each at 4 ranks on 2 cores).
REBALANCE_STEPS = 8


def _rebalance_config() -> Config:
    return tiny_config(
        parallel=dict(tp=1, pp=2, dp=2, schedule="1f1b", partition="uniform", zero=3),
        train=dict(steps=REBALANCE_STEPS, val_every=REBALANCE_STEPS, monitor_every=0),
        # The emulated cost must dominate the real compute, whatever the load: the balancer moves on measured
        # speeds, and under ZeRO-3 a rank's compute includes its gathers (load-sensitive). At 2 ms a layer the
        # real compute of 4 ranks on 2 cores at load 13 (0.45-0.64 s a step per rank) drowned the emulated
        # 0.14 s (3x: 0.43 s) and nothing moved; at 8 ms (0.58 s, 3x: 1.73 s) it moves at step 4.
        emulate=dict(layer_ms=8.0, slowdown="rank=1:3.0@step=0"),
        balance=dict(mode="auto", interval=4, window=3, patience=2, threshold=1.6, persist=1),
    )


def _bf16_configs() -> list[Config]:
    """bf16 with selective recomputation at pp2 x dp2, tied: ZeRO-2, then ZeRO-3 (per-microbatch regather);
    then ZeRO-3 without recomputation, where the step keeps autocast's weight copies (runtime.step_casts)
    across microbatches and regathers."""
    over = dict(model=dict(tie_embeddings=True), train=dict(precision="bf16", recompute="selective"))
    cfgs = [grid_config(2, "1f1b", 1, parallel=dict(tp=1, pp=2, dp=2, zero=z), **over) for z in (2, 3)]
    over["train"] = dict(precision="bf16", recompute="none")
    return cfgs + [grid_config(2, "1f1b", 1, parallel=dict(tp=1, pp=2, dp=2, zero=3), **over)]


def _tp_resume_configs() -> list[Config]:
    """tp2 x dp2 with tied embeddings (column-parallel weights cut along their tp shard's rows), ZeRO-1
    preempted after step 1, resumed under ZeRO-3 to the end."""
    legs = ((1, "rank=0:term@step=0:phase=forward", "off"), (3, "", "auto"))
    return [
        tiny_config(
            model=dict(tie_embeddings=True),
            parallel=dict(tp=2, pp=1, dp=2, zero=zero),
            checkpoint=dict(every=3, keep=2, resume=resume),
            emulate=dict(fault=fault),
        )
        for zero, fault, resume in legs
    ]


def _world4_worker(
    layouts: list[dict], holds: list[dict], rebalance: dict, bf16: list[dict], tp_resume: list[dict], out: str
) -> dict:
    """The 4-rank tests' work in turn, each from scratch in its own directory (the live rebalance first:
    its timing sees nothing else run before it)."""
    return {
        "rebalance": _rebalance_worker(rebalance, str(Path(out, "rebalance"))),
        "layouts": _worker(layouts, str(Path(out, "layouts"))),
        "holds": _bytes_worker(holds),
        "bf16": _worker(bf16, str(Path(out, "bf16"))),
        "tp_resume": [_stage_worker(d, str(Path(out, "tp_resume", "run"))) for d in tp_resume],
    }


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """One launch for the 4-rank tests below: a launch costs ~5 s of four interpreters importing torch
    before their first step. Each test reads only its own part (rank 0's, or every rank's)."""
    out = tmp_path_factory.mktemp("world4")
    for d in ("rebalance", "layouts", "bf16", "tp_resume"):
        (out / d).mkdir()
    layouts, holds = [c.to_dict() for c in _layout_configs()], [c.to_dict() for c in _holds_configs()]
    bf16, rebalance = [c.to_dict() for c in _bf16_configs()], _rebalance_config().to_dict()
    resume = [c.to_dict() for c in _tp_resume_configs()]
    return out, run_ranks(_world4_worker, 4, layouts, holds, rebalance, bf16, resume, str(out), timeout_s=400)


@pytest.mark.multiprocess
def test_zero1_layouts_match_single_device(world4: tuple[Path, list[dict]]) -> None:
    """World 4: pp2 x dp2 under every schedule, tp2 x dp2 with tied embeddings. Global batch 11: the
    replicas hold 6 and 5 samples."""
    out, ranks = world4
    check_results([_as_reference(c) for c in _layout_configs()], ranks[0]["layouts"], out / "layouts")


@pytest.mark.multiprocess
def test_zero_checkpoint_at_tp2_resumes_under_another_level(world4: tuple[Path, list[dict]]) -> None:
    """World 4: tp2 x dp2 ZeRO-1 preempted after step 1 resumes under ZeRO-3 (slices of column-parallel
    weights are rows of their tp shard; a tp-replicated norm's slices written once): the one-device model."""
    out, ranks = world4
    first, second = ranks[0]["tp_resume"]
    assert (first["start"], first["preempted"], second["start"], second["preempted"]) == (0, 1, 1, None)
    ref = _as_reference(_tp_resume_configs()[1])
    ref_losses, _, ref_state = ref_for(ref)
    losses = first["losses"] + second["losses"]
    assert len(losses) == len(ref_losses) and max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    state = torch.load(out / "tp_resume" / "state.pt", weights_only=True)
    assert max((state[n] - t).abs().max().item() for n, t in ref_state.items()) <= TOL
    check_fp64("tp2 x dp2, ZeRO-1 -> ZeRO-3 across a checkpoint", state, ref)
    from hybridpar.resilience.packed import read_index

    pieces: dict[str, int] = {}
    for flat in read_index(out / "tp_resume" / "run" / "checkpoints" / "step-000001").values():
        for p in flat["pieces"]:
            pieces[p["key"]] = pieces.get(p["key"], 0) + 1
    # A tp-sharded tensor: a slice per (dp, tp) rank; a tp-replicated norm: one per dp rank (tp rank 0's).
    assert pieces["optim/model.layers.0.self_attn.q_proj.weight/exp_avg"] == 4
    assert pieces["optim/model.layers.0.input_layernorm.weight/exp_avg"] == 2, pieces


def _as_reference(cfg: Config) -> Config:
    """`cfg` with its one-device reference's recomputation: none, whose losses and parameters are
    bit-identical to full recomputation's (tests/test_recompute.py), so the reference and its fp64
    yardstick are computed once for both."""
    ref = Config.from_dict(cfg.to_dict())
    ref.train.recompute = "none"
    return ref


def _bytes_worker(cfg_dicts: list[dict]) -> list[list]:
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer

    out = []
    for d in cfg_dicts:
        cfg = Config.from_dict(d)
        p = cfg.parallel
        tr = Trainer(cfg, build_topology(p.dp, p.pp, p.tp, "gloo", 60.0))
        tr.step(0)
        held = sum(v.numel() * v.element_size() for st in tr.opt.state.values() for v in st.values())
        ps = [q for _, q in tr.mp.parameters()]
        # ZeRO-3: bytes in the parameters' own storages at rest (0 where sliced), and all-gathers started.
        rest, gathers = sum(q.untyped_storage().nbytes() for q in ps), 0 if tr.zero3 is None else tr.zero3.gathers
        out.append([held, tr.dp.grads.handed, sum(q.numel() for q in ps), tr.memory, rest, gathers, len(ps)])
    return out


@pytest.mark.multiprocess
def test_zero1_holds_a_dp_th_of_the_optimizer_state(world4: tuple[Path, list[dict]]) -> None:
    """Bytes of the tensors in each rank's optimizer state: total / dp within 2%. And the gradients are
    reduce-scattered, not all-reduced: every parameter of this model has a dimension to slice."""
    ranks = [r["holds"] for r in world4[1]]
    total = ranks[0][0][0]
    assert all(r[0][0] == total for r in ranks)  # without ZeRO every replica holds all of it
    for (_, plain, n, *_), (held, sharded, *_), (held2, sharded2, *_), _ in ranks:
        assert abs(held - total / 4) <= 0.02 * total / 4, (held, total / 4)
        assert held2 == held
        assert plain == {"all_reduce": n, "reduce_scatter": 0}
        assert sharded == sharded2 == {"all_reduce": 0, "reduce_scatter": n}


@pytest.mark.multiprocess
def test_zero2_holds_a_dp_th_of_the_gradients_at_rest(world4: tuple[Path, list[dict]]) -> None:
    """ZeRO-2 at dp=4, counted from each rank's tensors inside the optimizer step: gradients at rest
    (the kept slices) = the whole gradients / 4 within 2%, as the memory model says; at their peak
    (accumulating over the step's microbatches) they are whole, as without ZeRO-2."""
    ranks = [r["holds"] for r in world4[1]]
    whole = ranks[0][0][3]["grads"]
    model = rank_memory(_holds_configs()[2])[0]
    assert model.grads == whole and abs(model.grads_at_rest - whole / 4) <= 0.02 * whole / 4
    for plain, zero1, zero2, _ in ranks:
        assert plain[3]["grads_at_rest"] == zero1[3]["grads_at_rest"] == zero1[3]["grads"] == whole
        at_rest = zero2[3]["grads_at_rest"]
        assert abs(at_rest - whole / 4) <= 0.02 * whole / 4, (at_rest, whole / 4)
        assert abs(at_rest - model.grads_at_rest) <= 0.02 * whole / 4
        assert zero2[3]["grads"] == whole  # the peak: the whole gradients before the reduction


@pytest.mark.multiprocess
def test_zero3_holds_a_dp_th_of_parameters_gradients_and_state_at_rest(world4: tuple[Path, list[dict]]) -> None:
    """ZeRO-3 at dp=4, counted from each rank's tensors: parameters (the slices; the parameters' own
    storages are empty) + gradients + optimizer state at rest = the whole of them without ZeRO / 4 within
    2%; every parameter was gathered for each use: each microbatch's forward and backward. Parameters at
    their peak (slices + the most gathered at once) within 10% of the memory model's, at rest within 2%."""
    ranks = [r["holds"] for r in world4[1]]
    plain = ranks[0][0][3]
    total = plain["params"] + plain["grads"] + plain["optimizer"]
    model = rank_memory(_holds_configs()[3])[0]
    for _, _, _, zero3 in ranks:
        mem, rest, gathers, count = zero3[3], zero3[4], zero3[5], zero3[6]
        at_rest = mem["params_at_rest"] + mem["grads_at_rest"] + mem["optimizer"]
        assert abs(at_rest - total / 4) <= 0.02 * total / 4, (at_rest, total / 4, mem)
        assert rest == 0, rest  # every parameter of this model is sliced: nothing whole at rest
        assert mem["params"] > mem["params_at_rest"]  # the step's gathered layers, counted at their peak
        # The memory model: the slices, plus the parameters outside layers and two layers at the peak.
        assert abs(mem["params_at_rest"] - model.params_at_rest) <= 0.02 * model.params_at_rest, (mem, model)
        assert abs(mem["params"] - model.params) <= 0.10 * model.params, (mem["params"], model.params)
        assert gathers == 2 * _holds_configs()[3].train.microbatches * count, (gathers, count)


@pytest.mark.multiprocess
def test_zero3_under_bf16_is_zero2_bit_for_bit(world4: tuple[Path, list[dict]]) -> None:
    """bf16 autocast (its cache of low-precision weight copies) with selective recomputation: ZeRO-3's
    gathered parameters are the ones ZeRO-2 holds, so every loss and every final parameter is identical
    (ZeRO-2 itself is held to one device by the layout tests). Without recomputation the copies made from
    the first gather serve the step's every microbatch: identical too (recomputation changes no bit)."""
    out, ranks = world4
    zero2, zero3, kept = ranks[0]["bf16"]
    assert zero2 == zero3 == kept
    a, b, c = (torch.load(out / "bf16" / f"state{i}.pt", weights_only=True) for i in (0, 1, 2))
    assert a.keys() == b.keys() == c.keys() and all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)


def _stage_worker(cfg_d: dict, run_dir: str) -> dict:
    from hybridpar.run.train import train

    cfg = Config.from_dict(cfg_d)
    cfg.run_dir = run_dir
    res = train(cfg, log=False)
    if res.state is not None:
        torch.save(res.state, Path(run_dir).with_name("state.pt"))
    return {"losses": res.losses, "start": res.start_step, "preempted": res.preempted_at}


@pytest.mark.multiprocess
def test_zero_checkpoint_resumes_at_another_dp_and_level(tmp_path: Path) -> None:
    """dp=2 (ZeRO-1) is preempted after step 2, resumes at dp=4 (ZeRO-3) to step 3, at dp=1 to step 4,
    at dp=2 (ZeRO-2) to step 5 and at dp=3 (ZeRO-3: uneven chunks) to the end: the one-device model.
    Each ZeRO rank writes only its slice of the optimizer state, and under ZeRO-3 of the parameters too,
    packed in one flat tensor (a piece per dp rank in the index, resilience/packed.py), re-cut on resume."""
    steps = 6
    run = str(tmp_path / "run")
    legs = [(2, 1, "rank=0:term@step=1:phase=forward"), (4, 3, "rank=3:term@step=2:phase=forward")]
    legs += [(1, 0, "rank=0:term@step=3:phase=forward"), (2, 2, "rank=1:term@step=4:phase=forward"), (3, 3, "")]
    losses: dict[int, float] = {}
    for i, (dp, zero, fault) in enumerate(legs):
        cfg = tiny_config(
            parallel=dict(tp=1, pp=1, dp=dp, zero=zero),
            train=dict(steps=steps, microbatches=2),  # dp=4: replicas of 3, 3, 3 and 2 samples
            checkpoint=dict(every=steps, keep=4, resume="auto" if i else "off"),
            emulate=dict(fault=fault),
        )
        out = run_ranks(_stage_worker, dp, cfg.to_dict(), run, timeout_s=240)[0]
        assert out["start"] == (0, 2, 3, 4, 5)[i] and out["preempted"] == (2, 3, 4, 5, None)[i], out
        losses.update({out["start"] + k: v for k, v in enumerate(out["losses"])})
    ref = tiny_config(train=dict(steps=steps, microbatches=2))
    ref_losses, _, ref_state = ref_for(ref)
    assert max(abs(losses[s] - ref_losses[s]) for s in range(steps)) <= TOL
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    for name, t in ref_state.items():
        assert (state[name] - t).abs().max().item() <= TOL, name
    check_fp64("dp 2 -> 4 -> 1 -> 2 -> 3 under ZeRO 1, 3, 0, 2, 3", state, ref)
    from hybridpar.resilience.packed import read_index
    from hybridpar.resilience.safe_dcp import load_metadata

    for step, dp in ((3, 4), (4, 1), (5, 2), (6, 3)):  # written at dp 4 (ZeRO-3), 1, 2 (ZeRO-2), 3 (ZeRO-3)
        ckpt = tmp_path / "run" / "checkpoints" / f"step-{step:06d}"
        md = load_metadata(ckpt / ".metadata").state_dict_metadata
        pieces: dict[str, int] = {}  # ZeRO's slices: one packed flat tensor per rank, a piece per slice in it
        for name, flat in read_index(ckpt).items():
            assert name in md and md[name].size == (flat["numel"],), (step, name)
            for p in flat["pieces"]:
                pieces[p["key"]] = pieces.get(p["key"], 0) + 1
        moments = [k for k in md if k.startswith("optim/") and k.endswith("/exp_avg")]
        params = [k for k in md if k.startswith("model.") and k.endswith("proj.weight")]
        if dp == 1:  # no ZeRO: every tensor whole, in DCP's entries
            assert not pieces and moments and params, step
            continue
        zero3 = step in (3, 6)  # the parameters are written as slices too, one per dp rank, none gathered
        sliced = [k for k in pieces if k.startswith("optim/") and k.endswith("/exp_avg")]
        assert sliced and not moments and all(pieces[k] == dp for k in sliced), (step, pieces)
        param_pieces = [k for k in pieces if k.startswith("model.") and k.endswith("proj.weight")]
        assert (len(param_pieces) > 0 and not params) if zero3 else (not param_pieces and params), step
        assert all(pieces[k] == dp for k in param_pieces), (step, pieces)


def _rebalance_worker(cfg_d: dict, out: str) -> list[float]:
    from hybridpar.run.train import train

    cfg = Config.from_dict(cfg_d)
    cfg.run_dir = str(Path(out) / "run")
    res = train(cfg, log=False)
    if res.state is not None:
        torch.save(res.state, Path(out) / "state.pt")
    return res.losses


@pytest.mark.multiprocess
def test_zero3_live_rebalance_is_exact(world4: tuple[Path, list[dict]]) -> None:
    """pp2 x dp2 under ZeRO-3, rank 1 three times slower: the balancer keeps one partition for both
    replicas, each rank's parameter and state slices move with their layers (nothing gathered), and the
    optimizer and the gathers are rebuilt for the new stages. (ZeRO-1 and 2 moves: tests/test_rebalance.py.)"""
    cfg = _rebalance_config()
    out, ranks = world4
    tmp_path, losses = out / "rebalance", ranks[0]["rebalance"]
    assert len(losses) == REBALANCE_STEPS
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    moves = [e for r in rows for e in r.get("balance", []) if e["event"] == "rebalance" and e["applied"]]
    assert moves and moves[0]["move"], rows
    assert all(len({str(p) for p in m["new"]["parts"]}) == 1 for m in moves), moves  # one shared partition
    ref_losses, _, ref_state = ref_for(cfg)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    for name, ref in ref_state.items():
        assert (state[name] - ref).abs().max().item() <= TOL, name
