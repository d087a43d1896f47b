"""Context parallelism (parallel.cp): the ring's arithmetic, without processes — every rank's blocks,
visited in ring order and merged by log-sum-exp, give causal attention over the whole sequence, and the
ring backward's per-block gradients (dK/dV summed as they travel) give its gradients; the causal work is
balanced; bad layouts are refused in one line before launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridpar import cli
from hybridpar.config import parse_args
from hybridpar.model.ring_attention import attend_block, chunk_positions, grad_block, relation, shard_sequence
from hybridpar.pipeline.schedules.config_rules import validate_config


def _ring_by_hand(q, k, v, dout, cp):
    """Each of cp ranks' forward and backward as the ring runs them, in one process."""
    T = q.shape[2]
    pos = [chunk_positions(T, cp, r) for r in range(cp)]
    kvs = [torch.stack([k[:, :, p], v[:, :, p]]) for p in pos]
    out, dq, dk, dv = (torch.zeros_like(t) for t in (q, q, k, v))
    dkv = [torch.zeros_like(kv) for kv in kvs]
    for r in range(cp):
        acc = [None, None]
        for j in range(cp):
            attend_block(q[:, :, pos[r]], kvs[(r - j) % cp], r, (r - j) % cp, cp, acc)
        o, lse = torch.cat([acc[0][0], acc[1][0]], 2), torch.cat([acc[0][1], acc[1][1]], 2)
        out[:, :, pos[r]] = o
        do = dout[:, :, pos[r]]
        for j in range(cp):
            s = (r - j) % cp
            g_q, g_kv = grad_block(q[:, :, pos[r]], kvs[s], r, s, cp, do, o, lse)
            dq[:, :, pos[r]] += g_q
            dkv[s] += g_kv
    for s in range(cp):
        dk[:, :, pos[s]], dv[:, :, pos[s]] = dkv[s][0], dkv[s][1]
    return out, dq, dk, dv


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-kernels", "op-by-op"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_ring_gives_causal_attention_and_its_gradients(cp: int, fused: bool, monkeypatch) -> None:
    """Both ways a block is computed: torch's fused CPU kernels, and op by op (CUDA, bf16)."""
    import hybridpar.model.ring_attention as ring

    monkeypatch.setattr(ring, "_fused", lambda q: fused)
    g = torch.Generator().manual_seed(cp)
    B, h, kv, T, hd = 2, 4, 2, 16, 8  # grouped-query: 2 query heads per kv head
    q, k, v = (torch.randn(B, n, T, hd, generator=g, requires_grad=True) for n in (h, kv, kv))
    dout = torch.randn(B, h, T, hd, generator=g)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    ref.backward(dout)
    with torch.no_grad():
        out, dq, dk, dv = _ring_by_hand(q, k, v, dout, cp)
    for name, a, b in (("out", out, ref), ("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        assert (a - b).abs().max().item() <= 2e-6, f"cp={cp} {name}"


def test_chunks_cover_the_sequence_and_balance_the_causal_work() -> None:
    for cp in (2, 3, 4):
        held = torch.cat([chunk_positions(24, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(24))
        # causal work of a rank: the keys each of its queries sees, i.e. position + 1 summed
        work = [int((chunk_positions(24, cp, r) + 1).sum()) for r in range(cp)]
        assert len(set(work)) == 1, work
        assert chunk_positions(24, cp, 0)[:3].tolist() == [0, 1, 2] if cp == 4 else True
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert shard_sequence(torch.arange(8).view(1, 8), 2, 0).tolist() == [[0, 1, 6, 7]]
    assert [relation(2, c) for c in (1, 2, 3)] == ["full", "causal", None]


def _refused(flags: list[str], run: Path, capsys: pytest.CaptureFixture) -> str:
    capsys.readouterr()
    rc = cli.main(["train", "--parallel.tp", "1", "--parallel.pp", "1", *flags, "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and not run.exists(), err
    return err


def test_what_cp_does_not_support_is_refused_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    err = _refused(["--parallel.cp", "2", "--train.seq_len", "30"], tmp_path / "r", capsys)
    assert "train.seq_len=30 does not split into 2 × parallel.cp = 4 equal chunks" in err and "32" in err
    for flags, what in (
        (["--data.document_mask", "true"], "data.document_mask=true"),
        (["--balance.mode", "auto"], "balance.mode=auto"),
        (["--parallel.cpu_bind", "cores"], "parallel.cpu_bind=cores"),
        (["--parallel.grad_sum", "tree"], "parallel.grad_sum=tree"),
        (["--parallel.dp", "2", "--parallel.zero", "3"], "parallel.zero=3"),
        (["--parallel.auto", "true", "--nproc-per-node", "2"], "parallel.auto=true"),
    ):
        err = _refused(["--parallel.cp", "2", "--train.seq_len", "64", *flags], tmp_path / "r", capsys)
        assert f"parallel.cp=2 does not support {what} yet" in err, err
    # Sequence parallelism cuts each of a rank's two chunks over tp: 36 splits into 4 chunks, not into 8 slices.
    sp = ["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"]
    err = _refused([*sp, "--train.seq_len", "36"], tmp_path / "r", capsys)
    assert "train.seq_len=36 does not split into 2 × parallel.cp × parallel.tp = 8 equal slices" in err, err
    assert "use a multiple of 8 (e.g. 40)" in err, err
    validate_config(parse_args(["--parallel.pp", "1", *sp, "--train.seq_len", "32"]), world_size=4)
    cfg = parse_args(["--parallel.tp", "1", "--parallel.pp", "1", "--parallel.cp", "2", "--train.seq_len", "64"])
    with pytest.raises(ValueError, match=r"parallel.dp × parallel.cp = 1 × 1 × 1 × 2 = 2, but 3 processes"):
        validate_config(cfg, world_size=3)  # the world the launcher starts must be tp x pp x dp x cp


def test_an_elastic_replan_keeps_cp_where_it_divides_the_world() -> None:
    from hybridpar.model.reference import tiny_config
    from hybridpar.resilience.elastic import replan

    cfg = tiny_config(parallel=dict(tp=1, pp=1, dp=1, cp=2))  # seq_len 16: cp 2, 4 and 8 split it
    got = [(q.tp, q.pp, q.dp, q.cp) for q in (replan(cfg, w).parallel for w in (4, 3, 6))]
    assert got == [(1, 1, 2, 2), (1, 1, 3, 1), (1, 1, 3, 2)]
    cfg.train.seq_len = 12  # 2 cp = 8 does not divide 12: cp 4 falls back to 2
    cfg.parallel.cp = 4
    assert replan(cfg, 8).parallel.cp == 2
    # With sequence parallelism tp must cut each cp rank's chunks: at seq_len 24 and cp 2 (chunks of 6),
    # 2 cp tp = 16 does not divide 24 and 8 does, so 8 ranks take cp 2 x tp 2, not tp 4.
    sp = tiny_config(parallel=dict(tp=4, pp=1, dp=1, cp=2, sequence_parallel=True), train=dict(seq_len=24))
    assert (lambda q: (q.cp, q.tp))(replan(sp, 8).parallel) == (2, 2)
