"""Context parallelism: each sample's sequence split over the cp ranks of a group, causal attention by
ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"), as Megatron-Core and
torchtitan run it.

Load balance. Causal attention gives a token at position t work proportional to t, so cutting the
sequence into cp consecutive pieces would leave the last rank with most of the work. Instead the
sequence is cut into 2 cp chunks and rank r holds chunks r and 2cp-1-r (one early, one late): every
rank then does the same work, two full chunk-by-chunk blocks per ring step and two causal diagonal
blocks at its own step (`relation` says which block is which).

The ring. Each rank computes its queries against its own keys/values, then passes keys and values (one
packed tensor of this rank's kv heads) to the next rank of the ring while receiving the previous rank's;
the transfer of the next block is posted before the current block's compute, so it overlaps it. Each
block's partial attention comes with its log-sum-exp; blocks merge exactly by rescaling (the
online-softmax rule of FlashAttention), so the result is softmax attention over the whole sequence.

The backward runs the ring again (FlashAttention-2's backward per block, with the forward's final
log-sum-exp): keys/values travel forward as before, and each block's dK/dV accumulator travels with
it, gathering every rank's contribution, and one last hop brings it home to the rank that owns it.

`RingContext` is handed to a stage's forward where a `DocumentMask` or a serving `KVStep` goes
(model/documents.py): the families read its per-token positions (the global positions of this rank's
chunks, so rotary tables and learned position embeddings see the true positions) and call its
`attend`, so model code has one path for all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

Block = tuple[torch.Tensor, torch.Tensor]  # (out (B, h, C, hd), lse (B, h, C)), fp32


def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions (2C,) held by cp rank `rank`: chunk r then chunk 2cp-1-r, C = seq_len / 2cp."""
    c = seq_len // (2 * cp)
    return torch.cat(
        [torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
    )


def shard_sequence(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This rank's tokens (B, 2C) of a batch x (B, T) (or targets: the loss is a sum per token)."""
    return x[:, chunk_positions(x.shape[1], cp, rank).to(x.device)]


def relation(q_chunk: int, k_chunk: int) -> str | None:
    """How queries of chunk q_chunk see keys of chunk k_chunk under the causal mask: all of them
    ('full'), the lower triangle ('causal') or none (None: the block is skipped)."""
    return "full" if k_chunk < q_chunk else "causal" if k_chunk == q_chunk else None


def _chunks(cp: int, rank: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """kv heads (B, kv, C, hd) -> (B, heads, C, hd): grouped-query attention shares each kv head."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(g: torch.Tensor, kv: int) -> torch.Tensor:
    """The gradient of _expand: each kv head's share summed over its query heads."""
    B, h, C, hd = g.shape
    return g if h == kv else g.view(B, kv, h // kv, C, hd).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, kind: str) -> torch.Tensor:
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, h, Cq, Ck)
    if kind == "causal":
        s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    return s


def _fused(q: torch.Tensor) -> bool:
    """Whether the blocks run torch's fused CPU attention kernels (which return each block's
    log-sum-exp and take the final one back in the backward): fp32 on the CPU; elsewhere op by op."""
    return q.device.type == "cpu" and q.dtype == torch.float32


def _merge(acc: Block | None, out: torch.Tensor, lse: torch.Tensor) -> Block:
    """Two partial attentions of the same queries over disjoint keys, merged by their log-sum-exps."""
    if acc is None:
        return out, lse
    a_out, a_lse = acc
    new = torch.logaddexp(a_lse, lse)
    return a_out * (a_lse - new).exp().unsqueeze(-1) + out * (lse - new).exp().unsqueeze(-1), new


def attend_block(q: torch.Tensor, kv: torch.Tensor, r: int, s: int, cp: int, acc: list[Block | None]) -> None:
    """Fold the block of source rank s's keys/values kv (2, B, kv, 2C, hd) into rank r's accumulators
    (one per query chunk) for q (B, h, 2C, hd), fp32."""
    h, C = q.shape[1], q.shape[2] // 2
    for i, cq in enumerate(_chunks(cp, r)):
        for j, ck in enumerate(_chunks(cp, s)):
            kind = relation(cq, ck)
            if kind is None:
                continue
            k, v = (_expand(t[:, :, j * C : (j + 1) * C].float(), h) for t in kv)
            qi = q[:, :, i * C : (i + 1) * C]
            if _fused(q):  # torch's fused kernel, which returns the block's log-sum-exp too
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qi, k, v, 0.0, kind == "causal")
            else:
                sc = _scores(qi, k, kind)
                lse = sc.logsumexp(-1)
                out = (sc - lse.unsqueeze(-1)).exp() @ v
            acc[i] = _merge(acc[i], out, lse)


def grad_block(
    q: torch.Tensor,
    kv: torch.Tensor,
    r: int,
    s: int,
    cp: int,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's contribution through source s's block: (dq (B, h, 2C, hd), dkv (2, B, kv, 2C, hd)), fp32.
    dout, out and lse (B, h, 2C) are the whole attention's: FlashAttention-2's backward of one block with
    the final output and log-sum-exp gives exactly that block's share of the gradients."""
    h, C, n_kv = q.shape[1], q.shape[2] // 2, kv.shape[2]
    delta = None if _fused(q) else (dout * out).sum(-1)  # (B, h, 2C)
    dq = torch.zeros_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    for i, cq in enumerate(_chunks(cp, r)):
        qi, rows = q[:, :, i * C : (i + 1) * C], slice(i * C, (i + 1) * C)
        for j, ck in enumerate(_chunks(cp, s)):
            kind = relation(cq, ck)
            if kind is None:
                continue
            cols = slice(j * C, (j + 1) * C)
            k, v = (_expand(t[:, :, cols].float(), h) for t in kv)
            if delta is None:
                dqi, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    dout[:, :, rows], qi, k, v, out[:, :, rows], lse[:, :, rows], 0.0, kind == "causal"
                )
            else:
                p = (_scores(qi, k, kind) - lse[:, :, rows].unsqueeze(-1)).exp()  # (B, h, Cq, Ck)
                dv = p.transpose(-1, -2) @ dout[:, :, rows]
                ds = p * (dout[:, :, rows] @ v.transpose(-1, -2) - delta[:, :, rows].unsqueeze(-1))
                dqi, dk = ds @ k * q.shape[-1] ** -0.5, ds.transpose(-1, -2) @ qi * q.shape[-1] ** -0.5
            dq[:, :, rows] += dqi
            dkv[0][:, :, cols] += _fold(dk, n_kv)
            dkv[1][:, :, cols] += _fold(dv, n_kv)
    return dq, dkv


@dataclass(frozen=True)
class Ring:
    """The cp group as a ring: this rank's place, its neighbours' global ranks, the wait bound."""

    group: dist.ProcessGroup
    cp: int
    rank: int
    timeout_s: float

    def exchange(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[dist.Work]:
        """Post, for each (send, recv), a send to the next rank and a receive from the previous one."""
        nxt = dist.get_global_rank(self.group, (self.rank + 1) % self.cp)
        prv = dist.get_global_rank(self.group, (self.rank - 1) % self.cp)
        ops = [
            op
            for a, b in pairs
            for op in (dist.P2POp(dist.isend, a, nxt, self.group), dist.P2POp(dist.irecv, b, prv, self.group))
        ]
        return dist.batch_isend_irecv(ops) if ops else []

    def wait(self, works: list[dist.Work]) -> None:
        for w in works:
            w.wait(timedelta(seconds=self.timeout_s))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:  # type: ignore[override]
        kv = torch.stack([k, v]).contiguous()  # one message per ring step: (2, B, kv, 2C, hd)
        qf, acc = q.float(), [None, None]
        for j in range(ring.cp):
            nxt = torch.empty_like(kv)
            works = ring.exchange([(kv, nxt)] if j < ring.cp - 1 else [])  # overlaps this block's compute
            attend_block(qf, kv, ring.rank, (ring.rank - j) % ring.cp, ring.cp, acc)
            ring.wait(works)
            kv = nxt
        # (B, h, 2C, hd) as a view of a (B, 2C, h, hd) tensor: the caller's transpose back to tokens-major
        # is then a view too, and the output projection saves the very storage kept here for backward.
        out = torch.cat([acc[0][0], acc[1][0]], dim=2).transpose(1, 2).contiguous().transpose(1, 2)
        lse = torch.cat([acc[0][1], acc[1][1]], dim=2)  # (B, h, 2C)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        qf, do = q.float(), dout.float()
        kv = torch.stack([k, v]).contiguous()
        dq, acc = torch.zeros_like(qf), None
        for j in range(ring.cp):
            nxt = torch.empty_like(kv)
            pairs = [(kv, nxt)] if j < ring.cp - 1 else []
            if acc is not None:  # the accumulator of the block now held arrives from the previous rank
                incoming = torch.empty_like(acc)
                pairs.append((acc, incoming))
            works = ring.exchange(pairs)
            dq_j, dkv = grad_block(qf, kv, ring.rank, (ring.rank - j) % ring.cp, ring.cp, do, out, lse)
            dq += dq_j
            ring.wait(works)
            acc = dkv if acc is None else dkv + incoming
            kv = nxt
        home = torch.empty_like(acc)  # one last hop: every block's accumulator back to its owner
        ring.wait(ring.exchange([(acc, home)]))
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None


class RingContext:
    """A stage forward's view of one microbatch under context parallelism: this rank's tokens' global
    positions and ring attention (the interface of model/documents.py's DocumentMask)."""

    def __init__(self, ring: Ring, seq_len: int, batch: int, device: torch.device) -> None:
        self.ring = ring
        self.positions = chunk_positions(seq_len, ring.cp, ring.rank).to(device).expand(batch, -1)  # (B, 2C)
        self.max_len = seq_len

    def layer(self, lid: str) -> RingContext:
        return self

    # Eager between compiled regions (train.compile, model/compiled.py): the ring's point-to-point transfers
    # (batch_isend_irecv) have no functional form that dynamo could put into the layer's graph.
    @torch.compiler.disable
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, saves: Any = None) -> torch.Tensor:
        """Causal attention of this rank's queries (B, h, 2C, hd) over the whole sequence's keys/values,
        of which this rank holds (B, kv, 2C, hd) (`saves`: nothing repeated to keep, the ring keeps the kv heads)."""
        with torch.autocast(q.device.type, enabled=False):  # blocks and their merge in fp32
            return _RingAttention.apply(q, k, v, self.ring)

    def last_tokens(self, h: torch.Tensor) -> torch.Tensor:
        return h  # training and evaluation need every position's logits
