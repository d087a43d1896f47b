"""The one pipeline runtime: executes a rank's action list (see schedules.py) for one step.

Every stage boundary cuts the autograd graph: a stage's input is a fresh leaf, its backward is driven
by the gradient its successor sent back. Boundaries between stages on the same rank (interleaved
chunks with pp=1, or pp=1 itself) hand tensors over through a local mailbox instead of P2P, so the
same code runs every layout. Microbatches may have different sizes; each message's shape comes from
its microbatch, which every rank knows from the step's split.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.pipeline.p2p import P2P
from hybridpar.pipeline.schedules import Action, Op


@dataclass
class ActionTime:
    action: Action
    start: float
    end: float


@dataclass
class StepOutput:
    loss: torch.Tensor | None  # sum over this rank's microbatches of scaled token losses (last stage only)
    timeline: list[ActionTime] = field(default_factory=list)


class PipelineRuntime:
    """Runs actions for the stages this rank holds. `stage_peer(s)` is the global rank holding stage s
    (same dp and tp coordinates as us)."""

    def __init__(self, stages: dict[int, nn.Module], n_stages: int, stage_peer: Callable[[int], int],
                 p2p: P2P, hidden: int) -> None:
        self.stages, self.n_stages = stages, n_stages
        self.stage_peer, self.p2p, self.hidden = stage_peer, p2p, hidden

    def _remote(self, a: int, b: int) -> bool:
        return self.stage_peer(a) != self.stage_peer(b)

    def run(self, actions: Sequence[Action], inputs: Sequence[torch.Tensor | None],
            targets: Sequence[torch.Tensor | None], loss_scale: float, *, train: bool = True,
            on_stage_done: Callable[[int], None] | None = None) -> StepOutput:
        """Execute one step. inputs[m]/targets[m]: token ids (b_m, T) of microbatch m (needed on the
        first/last stage). The loss of microbatch m is sum(token CE) * loss_scale, so that with
        loss_scale = 1 / tokens-in-global-batch the gradients summed over every replica and microbatch
        are exactly those of the global token mean. `on_stage_done(s)` fires after stage s's last
        backward on this rank (the data-parallel reduction of its gradients can start there)."""
        T = next(t for t in list(inputs) + list(targets) if t is not None).shape[1]
        shape = [(t.shape[0], T, self.hidden) for t in (inputs if inputs[0] is not None else targets)]
        last_b = {a.stage: i for i, a in enumerate(actions) if a.op == Op.BACKWARD}
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]] = {}
        local_act: dict[tuple[int, int], torch.Tensor] = {}
        local_grad: dict[tuple[int, int], torch.Tensor] = {}
        to_send: dict[tuple[int, int], torch.Tensor] = {}  # outputs waiting for their SEND_F
        loss_sum: torch.Tensor | None = None
        timeline: list[ActionTime] = []
        p2p = self.p2p
        for i, a in enumerate(actions):
            s, m, op = a.stage, a.microbatch, a.op
            t0 = time.perf_counter()
            if op == Op.RECV_F:
                p2p.queue_recv(("F", s, m), shape[m], self.stage_peer(s - 1))
            elif op == Op.RECV_B:
                p2p.queue_recv(("B", s, m), shape[m], self.stage_peer(s + 1))
            elif op == Op.SEND_F:
                p2p.queue_send(to_send.pop((s, m)), self.stage_peer(s + 1))
            elif op == Op.SEND_B:
                p2p.queue_send(saved.pop((s, m))[0].grad, self.stage_peer(s - 1))
            elif op == Op.FORWARD:
                p2p.flush()  # put queued sends and early receives on the wire before computing
                buf = None
                if s == 0:
                    x = inputs[m]
                else:
                    if self._remote(s - 1, s):
                        buf = p2p.wait_recv(("F", s, m))
                        x = buf.detach()
                    else:
                        x = local_act.pop((s, m))
                    x.requires_grad_(train)
                with torch.set_grad_enabled(train):
                    y = self.stages[s](x)
                    if s == self.n_stages - 1:
                        tgt = targets[m]
                        y = F.cross_entropy(y.flatten(0, 1).float(), tgt.flatten(), reduction="sum") * loss_scale
                        loss_sum = y.detach() if loss_sum is None else loss_sum + y.detach()
                    elif self._remote(s, s + 1):
                        to_send[(s, m)] = y.detach()
                    else:
                        local_act[(s + 1, m)] = y.detach()
                if train:
                    saved[(s, m)] = (x if s > 0 else None, y, buf)
                elif buf is not None:
                    p2p.release(buf)
            elif op == Op.BACKWARD:
                p2p.flush()
                x, y, buf = saved[(s, m)]
                if s == self.n_stages - 1:
                    torch.autograd.backward(y)
                elif self._remote(s, s + 1):
                    g = p2p.wait_recv(("B", s, m))
                    torch.autograd.backward(y, g)
                    p2p.release(g)
                else:
                    torch.autograd.backward(y, local_grad.pop((s, m)))
                if buf is not None:
                    p2p.release(buf)  # the graph that saved this input is gone
                if s > 0 and not self._remote(s - 1, s):
                    local_grad[(s - 1, m)] = x.grad
                # keep x (its .grad) only until SEND_B posts it
                if s > 0 and self._remote(s - 1, s):
                    saved[(s, m)] = (x, y.detach(), None)
                else:
                    del saved[(s, m)]
                if on_stage_done is not None and last_b[s] == i:
                    on_stage_done(s)
            else:
                raise ValueError(f"runtime cannot execute {a}")
            timeline.append(ActionTime(a, t0, time.perf_counter()))
        p2p.wait_sends()
        assert not saved or not train or all(v[2] is None for v in saved.values()), "unfinished microbatches"
        return StepOutput(loss=loss_sum, timeline=timeline)


def forward_actions(actions: Sequence[Action]) -> list[Action]:
    """The forward-only part of a schedule (evaluation): drop backward work and gradient messages."""
    return [a for a in actions if a.op in (Op.FORWARD, Op.SEND_F, Op.RECV_F)]
