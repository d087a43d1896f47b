"""Message memory of the analytic memory model (plan/memory_model.py): receive buffers and shared-memory send rings,
replayed from the simulated schedule.

The replay (`replay`) depends on the schedule's action lists only, not on the layout's tp, dp, ZeRO,
precision or microbatch sizes, so the planner replays each schedule shape once and prices its messages per
layout from it (`message_buffers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridpar.config import Config
from hybridpar.pipeline import shm
from hybridpar.pipeline.schedules import Op
from hybridpar.pipeline.sim_program import Program
from hybridpar.pipeline.simulate import Costs, SimEvent, simulate

F32 = 4


@dataclass(frozen=True)
class Replay:
    """A schedule run under unit costs (F 1, B 2; B 1 and W 1 where it splits): its sends in event order and
    every event by (op, stage, microbatch)."""

    split: bool
    sends: tuple[SimEvent, ...]
    at: dict[tuple[Op, int, int], SimEvent]


def replay(actions: list[list], pp: int, ranks: tuple[int, ...], program: Program | None = None) -> Replay:
    """`program`: the same lists already lowered (compile_program), to be simulated as they are."""
    split = any(a.op == Op.WEIGHT for acts in actions for a in acts)
    costs = Costs(1.0, 1.0 if split else 2.0, 1.0 if split else 0.0)
    sim = simulate(actions if program is None else program, pp, len(ranks), costs, ranks=ranks)
    at = {(e.action.op, e.action.stage, e.action.microbatch): e for e in sim.events}
    return Replay(split, tuple(e for e in sim.events if e.action.op in (Op.SEND_F, Op.SEND_B)), at)


def transport(cfg: Config) -> str:
    """The P2P transport a run of `cfg` gets on this machine (pipeline/shm.py's `auto` rule, for CPU ranks
    on one host; CUDA runs go through the process group)."""
    p = cfg.parallel.p2p
    if p != "auto":
        return p
    cuda = cfg.parallel.backend == "nccl" or (cfg.parallel.backend == "auto" and torch.cuda.is_available())
    return "process_group" if cuda else "shared_memory"


def message_bytes(cfg: Config, b: int) -> int:
    """Bytes of one message between stages, microbatch of b samples: sequence parallelism sends the tp rank's
    slice of the sequence (model/tp.py), context parallelism the rank's 1/cp of it."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    tokens = t.seq_len // p.cp // (p.tp if p.sequence_parallel and p.tp > 1 else 1)
    return b * tokens * m.dim * (2 if t.precision == "bf16" else F32)


def in_place(cfg: Config) -> bool:
    """Whether a stage reads the messages it receives in place (pipeline/runtime.py): in its own dtype, fp32 or
    bf16 under working copies; under autocast a bf16 message is widened into an fp32 copy first."""
    t = cfg.train
    return not (t.precision == "bf16" and t.bf16_weights != "copies")


def buffered(cfg: Config, split: bool) -> bool:
    """Whether received messages land in receive buffers of the receiver's own (counted in its `buffers`):
    through the process group always; over shared memory where the backward splits (W may read them after
    their ring space would go back), otherwise lent where they lie in the sender's ring."""
    return transport(cfg) != "shared_memory" or split


def message_buffers(
    cfg: Config, sizes: list[int], actions: list[list], ranks: tuple[int, ...], rep: Replay | None = None
) -> list[int]:
    """Per pipeline rank, bytes allocated for messages at their most, replaying the schedule under unit
    costs (`replay`, given or run here): receive buffers from their posting to their last reader, and
    (shared memory) each send link's ring, which grows when a message does not fit behind those the
    receiver still holds."""
    pp = cfg.parallel.pp
    rep = rep or replay(actions, pp, ranks)
    split, at = rep.split, rep.at
    lent = not buffered(cfg, split)  # read in place in the ring until the backward
    msg = [message_bytes(cfg, b) for b in sizes]
    # A message in the stage's own dtype is read in place (pipeline/runtime.py): an fp32 one, or a bf16 one
    # under working copies, whose stages compute in bf16. A gradient read in place is the one its W keeps
    # (the last layer's output gradient); a bf16 one under autocast is widened to fp32 first, and goes with
    # its B; likewise an activation under autocast is read through its fp32 copy, back after the forward.
    widened = not in_place(cfg)
    release = Op.WEIGHT if split and not widened else Op.BACKWARD
    sends: dict[tuple[int, int], list[tuple[float, float, int]]] = {}  # link -> (sent, freed, bytes)
    live: list[list[tuple[float, int]]] = [[] for _ in range(pp)]  # receive buffers: (time, +-bytes)
    for e in rep.sends:
        a = e.action
        to = a.stage + 1 if a.op == Op.SEND_F else a.stage - 1
        reader = at[(Op.FORWARD if a.op == Op.SEND_F else Op.BACKWARD, to, a.microbatch)]
        # Its last reader: the backward that saved it; with a split backward W keeps the gradient.
        done = at[(release if a.op == Op.SEND_B else Op.BACKWARD, to, a.microbatch)]
        if a.op == Op.SEND_F and widened:
            done = reader
        freed = done.end if lent else reader.start
        sends.setdefault((e.rank, ranks[to]), []).append((e.end, freed, msg[a.microbatch]))
        if not lent:
            kind = Op.RECV_F if a.op == Op.SEND_F else Op.RECV_B
            posted = at[(kind, to, a.microbatch)].end
            live[ranks[to]] += [(posted, msg[a.microbatch]), (done.end, -msg[a.microbatch])]
    shared = transport(cfg) == "shared_memory"
    out = []
    for r in range(pp):
        running = peak = 0
        for _, n in sorted(live[r]):
            running += n
            peak = max(peak, running)
        rings = sum(_ring_peak(v) for (src, _), v in sends.items() if src == r) if shared else 0
        out.append(peak + rings)
    return out


def _ring_peak(msgs: list[tuple[float, float, int]]) -> int:
    """Bytes of ring a send link holds at its most (shm.SendLink's rule), messages given as (sent,
    freed, bytes) in send order; the receiver frees in arrival order, so the tail only passes a freed prefix."""
    cap = shm.first_capacity(msgs[0][2])
    head, pending, peak, rings = 0, [], shm._CTL + cap, [cap]
    for sent, freed, n in msgs:
        while pending and pending[0][0] <= sent:  # (freed time, end position, bytes)
            pending.pop(0)
        tail = pending[0][1] - pending[0][2] if pending else head
        rec = shm.record_bytes(n)
        skip = cap - head % cap if head % cap + rec > cap else 0
        if head + skip + rec + shm._RESERVE - tail > cap:
            cap = shm.grown_capacity(cap, rec)
            rings.append(cap)
            peak = max(peak, sum(shm._CTL + c for c in rings[-2:]))
            head, pending, skip = 0, [], 0
        start = head + skip
        head = start + rec
        pending.append((freed, head, rec))
    return peak
