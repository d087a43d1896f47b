"""Live rebalance keeps the training math: a run whose layers (with their AdamW state) move between
running pipeline ranks, and whose batch is re-split among replicas, ends with the same per-step losses
and parameters as the same run without the moves and as one device (<= 1e-5). Under ZeRO-3 the layers'
dp slices move (nothing gathered): the parameters stay empty at rest after the moves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridpar.balance.migrate import layer_moves
from hybridpar.balance.repartition import Layout
from hybridpar.config import Config
from hybridpar.model.reference import U_BF16
from hybridpar.topology.spawn import run_ranks
from tests.references import check_fp64, ref_for
from tests.test_equivalence import TOL, tiny_config

pytestmark = pytest.mark.multiprocess  # every test here starts processes


def R(*sizes: int) -> tuple[range, ...]:
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return tuple(out)


def test_layer_moves() -> None:
    assert layer_moves(R(4, 4), R(6, 2)) == [(4, 1, 0), (5, 1, 0)]
    assert layer_moves(R(2, 3, 3), R(1, 3, 4)) == [(1, 0, 1), (4, 1, 2)]
    assert layer_moves(R(3, 3), R(3, 3)) == []
    with pytest.raises(ValueError, match="different numbers of layers"):
        layer_moves(R(3, 3), R(3, 4))


def _worker(cfg_dict: dict, moves: dict[int, dict], out_dir: str) -> dict:
    """Train twice in one world: without moves, then applying `moves[step]` (a Layout record) after
    those steps. Rank 0 returns both loss series; both full states are saved."""
    from hybridpar.dataparallel.copies import MasterAdamW
    from hybridpar.topology.mesh import build_topology
    from hybridpar.trainer import Trainer
    from hybridpar.trainer.export import gather_full_state

    cfg = Config.from_dict(cfg_dict)
    p = cfg.parallel
    topo = build_topology(p.dp, p.pp, p.tp, "gloo", 60.0)
    result: dict = {}
    for label, plan in (("static", {}), ("moved", moves)):
        tr = Trainer(cfg, topo)
        losses, moved = [], []
        for step in range(cfg.train.steps):
            losses.append(tr.step(step)["loss"])
            if str(step) in plan:
                info = tr.apply_layout(Layout.from_record(plan[str(step)]))
                moved.append(info.get("layers_sent", 0) + info.get("layers_received", 0))
        # ZeRO-3: bytes in the parameters' own storages at rest (0: only slices held), then whole again.
        rest = sum(q.untyped_storage().nbytes() for _, q in tr.mp.parameters())
        if tr.zero3 is not None:
            tr.zero3.close()
        if isinstance(tr.opt, MasterAdamW):  # working copies: the trained model is the fp32 masters
            tr.opt.widen()
        state = gather_full_state(topo, tr.stages, tr.parts, cfg.model, tr.stage_ranks)
        if state is not None:
            torch.save(state, Path(out_dir) / f"{label}.pt")
        result[label] = {
            "losses": losses,
            "moved": moved,
            "parts": [[r.start, r.stop] for r in tr.parts],
            "split": [sum(s) for s in tr.plan.sizes],
            "rest": rest,
        }
    return result


CASES = {
    # pp=2: layers move forward, then most of them back the other way.
    "pp2": (dict(tp=1, pp=2, dp=1), {}, {1: Layout.uniform(R(6, 2), [11]), 3: Layout.uniform(R(1, 7), [11])}),
    # tp=2 x pp=2: every tp rank moves its own shards to the same tp rank of the other stage.
    # (3 steps: tp's per-layer all-reduces make this the slowest case on shared cores)
    "tp2-pp2": (dict(tp=2, pp=2, dp=1), dict(steps=3), {1: Layout.uniform(R(2, 6), [11])}),
    # ... and with sequence parallelism: the moved layers are built with their re-gathers (sp_backward), which
    # then follow their new stage (tp.rebind_regather)
    "sp-tp2-pp2": (dict(tp=2, pp=2, dp=1, sequence_parallel=True), dict(steps=3), {1: Layout.uniform(R(2, 6), [11])}),
    # pp=2 x dp=2: replica 0 alone re-partitions (reduced over the dp x pp plane) and the batch is
    # re-split 7/4; later both replicas share a new partition again (back to the dp group).
    "pp2-dp2": (
        dict(tp=1, pp=2, dp=2),
        {},
        {1: Layout((R(6, 2), R(4, 4)), (7, 4)), 3: Layout((R(3, 5), R(3, 5)), (4, 7))},
    ),
    # dp=2 alone: the batch of 11 re-split 10/1 (a 1-sample replica), then 3/8.
    "dp2": (
        dict(tp=1, pp=1, dp=2),
        dict(microbatches=1),
        {1: Layout.uniform(R(8), [10, 1]), 3: Layout.uniform(R(8), [3, 8])},
    ),
    # Interleaved, two chunks per rank (stages 0, 2 on rank 0; 1, 3 on rank 1): layers cross both ways, then
    # two pairs of stages (1 -> 2 and 3 -> 2) send from rank 1 to rank 0 in one exchange.
    "interleaved-pp2": (
        dict(tp=1, pp=2, dp=1, schedule="interleaved-1f1b", virtual_stages=2),
        {},
        {1: Layout.uniform(R(3, 1, 1, 3), [11]), 3: Layout.uniform(R(1, 2, 4, 1), [11])},
    ),
    # ZB-H1: the split backward's W hooks follow the layers that moved.
    "zb-h1-pp2": (dict(tp=1, pp=2, dp=1, schedule="zb-h1"), {}, {1: Layout.uniform(R(6, 2), [11])}),
    # ZB-V (stages 0, 3 on rank 0; 1, 2 on rank 1: the V's turn is local) with ZeRO-1, replica 0 alone
    # re-partitioned and the batch re-split, then both replicas on one new partition again.
    "zb-v-pp2-dp2": (
        dict(tp=1, pp=2, dp=2, schedule="zb-v", virtual_stages=2, zero=1),
        {},
        {1: Layout((R(1, 2, 4, 1), R(2, 2, 2, 2)), (7, 4)), 3: Layout((R(3, 1, 1, 3), R(3, 1, 1, 3)), (4, 7))},
    ),
    # ZeRO-2: replica 0 alone re-partitioned (whole state per rank meanwhile, as ZeRO-1), then one shared
    # partition again: the kept gradient slices and the state are re-cut for the new stages.
    "zero2-pp2-dp2": (
        dict(tp=1, pp=2, dp=2, zero=2),
        {},
        {1: Layout((R(6, 2), R(4, 4)), (7, 4)), 3: Layout((R(3, 5), R(3, 5)), (4, 7))},
    ),
    # ZeRO-3 under ZB-V: each dp rank's parameter and state slices move (the balancer keeps one
    # partition for all replicas), across ranks and between a rank's own two stages; the batch re-split.
    "zero3-zb-v-pp2-dp2": (
        dict(tp=1, pp=2, dp=2, schedule="zb-v", virtual_stages=2, zero=3),
        {},
        {1: Layout.uniform(R(1, 2, 4, 1), (7, 4)), 3: Layout.uniform(R(3, 1, 1, 3), (4, 7))},
    ),
    # bf16 with ZeRO-1: layers move with their fp32 masters and sharded AdamW state, replica 0 alone
    # re-partitioned and the batch re-split (check_rebalance holds it to bf16's criterion). Its model and
    # train settings are test_precision.py's world-4 ones, so the suite computes the bf16 yardstick once.
    "pp2-dp2-zero1-bf16": (
        dict(tp=1, pp=2, dp=2, zero=1),
        dict(steps=3, precision="bf16"),
        {1: Layout((R(6, 2), R(4, 4)), (7, 4))},
    ),
    # bf16 working copies with ZeRO-1: layers move with their fp32 masters (whole, gathered over dp) and
    # AdamW state, the replicas on one new partition (each steps its dp slice of the same masters) and the
    # batch re-split. The 4-layer model of test_precision.py's working-copies layouts, whose yardstick it shares.
    "pp2-dp2-zero1-copies": (
        dict(tp=1, pp=2, dp=2, zero=1),
        dict(steps=3, precision="bf16", bf16_weights="copies"),
        {1: Layout.uniform(R(3, 1), (7, 4))},
    ),
}


def _case(case: str) -> tuple[Config, dict[int, Layout]]:
    if case == "gpt2-tp2-pp2":  # GPT-2's layers move with their biases, row-parallel ones included
        cfg = tiny_config(
            model=dict(family="gpt2", n_kv_heads=None, n_positions=16),
            parallel=dict(schedule="1f1b", tp=2, pp=2, dp=1),
            train={"steps": 3},
        )
        return cfg, {1: Layout.uniform(R(2, 6), [11])}
    par, train, moves = CASES[case]
    model = dict(n_layers=4) if "bf16_weights" in train else {}
    return tiny_config(parallel={"schedule": "1f1b", **par}, train={"steps": 5, **train}, model=model), moves


def _cases_worker(cases: list[tuple[dict, dict, str]]) -> list[dict]:
    """_worker for each case in turn: each builds its own topology and trainers from scratch."""
    return [_worker(*case) for case in cases]


@pytest.fixture(scope="module")
def rebalanced(tmp_path_factory: pytest.TempPathFactory):
    """run(case): (its config, moves, rank 0's result, its directory). The cases of one world size run in
    one launch (started by the first test that asks): a launch costs 2-5 s of interpreters importing
    torch before their first step, more than most of these runs. A failed launch fails each of its tests."""
    launched: dict[int, tuple[dict, dict] | BaseException] = {}

    def run(case: str) -> tuple[Config, dict[int, Layout], dict, Path]:
        cfg, moves = _case(case)
        world = cfg.parallel.world_size
        if world not in launched:
            group = [c for c in [*CASES, "gpt2-tp2-pp2"] if _case(c)[0].parallel.world_size == world]
            dirs = {c: tmp_path_factory.mktemp(c) for c in group}
            args = [(_case(c)[0].to_dict(), _plan(_case(c)[1]), str(dirs[c])) for c in group]
            try:
                launched[world] = (dirs, dict(zip(group, run_ranks(_cases_worker, world, args, timeout_s=400)[0])))
            except Exception as e:
                launched[world] = e
        if isinstance(launched[world], BaseException):
            raise launched[world]
        dirs, results = launched[world]
        return cfg, moves, results[case], dirs[case]

    return run


def _plan(moves: dict[int, Layout]) -> dict[str, dict]:
    return {str(k): v.to_record() for k, v in moves.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_rebalance_is_exact(case: str, rebalanced) -> None:
    check_rebalance(case, *rebalanced(case))


def test_gpt2_rebalance_is_exact(rebalanced) -> None:
    """GPT-2's layers move with their biases, row-parallel ones included (built by the registry)."""
    check_rebalance("gpt2-tp2-pp2", *rebalanced("gpt2-tp2-pp2"))


def check_rebalance(case: str, cfg: Config, moves: dict[int, Layout], res: dict, tmp_path: Path) -> None:
    ref_losses, _, ref_state = ref_for(cfg)
    static, moved = res["static"], res["moved"]
    if cfg.parallel.pp > 1:
        assert all(n > 0 for n in moved["moved"]), f"{case}: rank 0 took part in no move: {moved['moved']}"
        assert moved["parts"] != static["parts"]
    if cfg.parallel.dp > 1:
        assert tuple(moved["split"]) == list(moves.values())[-1].split != tuple(static["split"])
    if cfg.parallel.shards_parameters:  # only the slices moved: no parameter is whole at rest
        assert moved["rest"] == static["rest"] == 0, (moved["rest"], static["rest"])
    if cfg.train.precision == "bf16":
        check_bf16(case, cfg, res, ref_losses, tmp_path)
        return
    for s, (a, b, r) in enumerate(zip(moved["losses"], static["losses"], ref_losses)):
        assert abs(a - b) <= TOL and abs(a - r) <= TOL, f"{case} step {s}: {a} vs static {b}, one device {r}"
    a, b = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("moved", "static"))
    assert list(a) == list(ref_state)
    for name, ref in ref_state.items():
        assert (a[name] - b[name]).abs().max().item() <= TOL, f"{case}: {name} differs from the static run"
        assert (a[name] - ref).abs().max().item() <= TOL, f"{case}: {name} differs from one device"


def check_bf16(case: str, cfg: Config, res: dict, ref_losses: list[float], tmp_path: Path) -> None:
    """bf16 is not bit-reproducible across layouts (a move shifts where the residual stream is rounded to
    bf16 for a message), so the moved run is held to bf16's criterion (tests/test_precision.py): every loss
    within u x |loss| of the unmoved run and of one-device bf16, the parameters of both runs no farther
    from an fp64 run than one-device bf16 training is."""
    for s, (a, b, r) in enumerate(zip(res["moved"]["losses"], res["static"]["losses"], ref_losses, strict=True)):
        assert abs(a - b) <= U_BF16 * abs(b) and abs(a - r) <= U_BF16 * abs(r), f"{case} step {s}: {a}, {b}, {r}"
    for label in ("moved", "static"):  # working copies' yardstick, computed here if test_precision.py's did not
        check_fp64(f"{case} {label}", torch.load(tmp_path / f"{label}.pt", weights_only=True), cfg)
