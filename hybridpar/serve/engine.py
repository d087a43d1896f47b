"""The inference engine of one replica: its tp × pp ranks each hold one stage (sharded over tp) and
run *ticks*. A tick is one forward step of one micro-batch of sequences: a prefill of new prompts or
a decode of one token per row, each row over its own blocks of the stage's paged KV cache
(`model/kvcache.py`). The replica's driver (pp=0, tp=0, see `driver.py`) issues ticks; each stage
computes its slice and passes the tick on, and the last stage returns the logits to the driver. A
stage is done with a tick as soon as it has sent it on, so while stage 1 works on micro-batch A's
step, stage 0 already runs B's: up to pp micro-batches are in flight, one per stage, an asynchronous
pipeline with real messages (`pipeline/p2p.py`). Weights, KV cache and hidden states are in the stage's
dtype (fp32, or bf16 with `hybridpar serve --dtype bf16`); logits are fp32 in every case. The stages
only read block tables: which blocks are free, and whose, is the driver's business.

Wire format of a tick (all on the P2P links of the training runtime, same tp coordinate):
header int64 (8,) = [op, 0, B, T, seq, NB, R, 0]; then, for a step of R sequences, meta int64 (2 + NB, R)
= (start position, new tokens, NB block-table entries) per sequence, and the payload: their new tokens
packed into one row (B = 1, T = their sum): token ids (B, T) broadcast from
the driver to stage 0's tp peers, hidden states (B, T, d) between stages, logits (R, V) back to the
driver (fp32, on their own link). An idle driver sends NOOP ticks so that every wait stays bounded by the timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridpar.model.stage import Stage
from hybridpar.pipeline.p2p import P2P
from hybridpar.topology.mesh import Topology

OP_NOOP, OP_STEP, OP_STOP = range(3)
HEADER = 8


@dataclass
class Tick:
    op: int
    seq: int = 0
    meta: torch.Tensor | None = None  # (2 + NB, R) int64: start position, new tokens, block table per sequence
    x: torch.Tensor | None = None  # ids (B, T) or hidden (B, T, d)

    def header(self, device: torch.device) -> torch.Tensor:
        B, T = (self.x.shape[0], self.x.shape[1]) if self.x is not None else (0, 0)
        NB, R = (self.meta.shape[0] - 2, self.meta.shape[1]) if self.meta is not None else (0, 0)
        return torch.tensor([self.op, 0, B, T, self.seq, NB, R, 0], dtype=torch.int64, device=device)


class StageRunner:
    """This rank's stage: receives ticks, runs them over its paged KV cache, passes them on."""

    def __init__(
        self, stage: Stage, topo: Topology, slowdown: float = 1.0, kv_blocks: int = 256, block_size: int = 16
    ) -> None:
        self.stage, self.topo = stage, topo
        self.device = topo.device
        self.dtype = next(stage.parameters()).dtype
        self.cache = stage.new_cache(kv_blocks, block_size, self.device, self.dtype)
        self.pp, self.pp_rank, self.tp_rank = topo.dims.pp, topo.pp_rank, topo.tp_rank
        self.tp_group = topo.group("tp") if topo.dims.tp > 1 else None
        self.driver_rank = topo.dims.moved(topo.rank, pp=0, tp=0)
        # Two message streams to the same peers: distinct tags, since each posts from its own thread.
        self.ctl = P2P(self.device, torch.int64, topo.timeout_s, tag=1)
        self.act = P2P(self.device, self.dtype, topo.timeout_s, tag=2)
        # Logits go back to the driver in fp32 whatever the stage computes in: sampling reads them whole.
        fp32 = self.dtype == torch.float32
        self.logits = self.act if fp32 else P2P(self.device, torch.float32, topo.timeout_s, tag=3)
        # EMULATION MODE (benchmarks only, off by default): a factor f > 1 sleeps (f - 1) times each
        # tick's measured compute, so this rank behaves like a device f times slower.
        self.slowdown = slowdown
        self.compute_s = 0.0
        self._recv_seq = 0

    @property
    def is_driver(self) -> bool:
        return self.pp_rank == 0 and self.tp_rank == 0

    def kv_bytes(self) -> int:
        return self.cache.nbytes()

    # -- messages --------------------------------------------------------------------------------
    def _recv(self, p2p: P2P, shape: tuple[int, ...], peer: int) -> torch.Tensor:
        self._recv_seq += 1
        key = ("serve", self._recv_seq)
        p2p.queue_recv(key, shape, peer)
        buf = p2p.wait_recv(key)
        out = buf.clone()
        p2p.release(buf)
        return out

    def broadcast_tick(self, tick: Tick) -> None:
        """Driver side: hand the tick to stage 0's other tp ranks (they need the same token ids)."""
        if self.tp_group is None:
            return
        dist.broadcast(tick.header(self.device), src=self.driver_rank, group=self.tp_group)
        if tick.op == OP_STEP:
            dist.broadcast(tick.meta.contiguous(), src=self.driver_rank, group=self.tp_group)
            dist.broadcast(tick.x.contiguous(), src=self.driver_rank, group=self.tp_group)

    def receive(self) -> Tick:
        """Non-driver ranks: the next tick, from the driver (stage 0) or the previous stage."""
        if self.pp_rank == 0:
            h = torch.empty(HEADER, dtype=torch.int64, device=self.device)
            dist.broadcast(h, src=self.driver_rank, group=self.tp_group)
        else:
            prev = self.topo.pp_peer(self.pp_rank - 1)
            h = self._recv(self.ctl, (HEADER,), prev)
        op, _, B, T, seq, NB, R = (int(v) for v in h[:7].tolist())
        tick = Tick(op, seq)
        if op == OP_STEP:
            if self.pp_rank == 0:
                tick.meta = torch.empty(2 + NB, R, dtype=torch.int64, device=self.device)
                tick.x = torch.empty(B, T, dtype=torch.int64, device=self.device)
                dist.broadcast(tick.meta, src=self.driver_rank, group=self.tp_group)
                dist.broadcast(tick.x, src=self.driver_rank, group=self.tp_group)
            else:
                tick.meta = self._recv(self.ctl, (2 + NB, R), prev)
                tick.x = self._recv(self.act, (B, T, self.stage.cfg.dim), prev)
        return tick

    def post_logits_recv(self, seq: int, batch: int) -> None:
        """Driver side (pp > 1): post the receive of a tick's logits from the last stage."""
        last = self.topo.pp_peer(self.pp - 1)
        self.logits.queue_recv(("logits", seq), (batch, self.stage.cfg.vocab_size), last)
        self.logits.flush()

    def wait_logits(self, seq: int) -> torch.Tensor:
        buf = self.logits.wait_recv(("logits", seq))
        out = buf.clone()
        self.logits.release(buf)
        return out

    # -- compute ---------------------------------------------------------------------------------
    def run(self, tick: Tick) -> torch.Tensor | None:
        """Execute `tick` on this stage and pass it on. Returns the logits on the last stage."""
        out = None
        if tick.op == OP_STEP:
            t0 = time.perf_counter()
            out = self.stage.forward_cached(tick.x, self.cache, tick.meta[0], tick.meta[1], tick.meta[2:].T)
            dt = time.perf_counter() - t0
            if self.slowdown > 1.0:
                time.sleep((self.slowdown - 1.0) * dt)
            self.compute_s += dt
        if self.pp_rank < self.pp - 1:
            nxt = self.topo.pp_peer(self.pp_rank + 1)
            fwd = Tick(tick.op, tick.seq, tick.meta, out)
            self.ctl.queue_send(fwd.header(self.device), nxt)
            if out is not None:
                self.ctl.queue_send(tick.meta, nxt)
                self.act.queue_send(out, nxt)
            self.ctl.flush()
            self.act.flush()
            return None
        if out is not None and self.pp > 1 and self.tp_rank == 0:
            self.logits.queue_send(out, self.driver_rank)  # (R, V) fp32: forward_cached widened them
            self.logits.flush()
        return out

    def drain(self) -> None:
        for p2p in {id(p): p for p in (self.ctl, self.act, self.logits)}.values():
            p2p.wait_sends()

    def serve_forever(self) -> None:
        """Loop of every rank except the driver: run ticks until STOP has passed through."""
        while True:
            tick = self.receive()
            self.run(tick)
            if tick.op == OP_STOP:
                break
            if max(p.pending() for p in (self.ctl, self.act, self.logits)) > 64:  # sends finish in order: few in flight
                self.drain()
        self.drain()
