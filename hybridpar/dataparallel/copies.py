"""bf16 working copies (`--train.bf16_weights copies`, Megatron-LM's mixed-precision recipe): the stages'
parameters are bf16, AdamW steps fp32 masters of them, and under ZeRO-1 each dp rank keeps only its slice
of the masters beside its slice of the moments.

Per parameter a rank then holds 2 bytes of bf16 weight, 4 of fp32 gradient and 12/dp of masters and
moments, where autocast holds 4 + 4 + 2 (the step's cached bf16 cast) + 8/dp.

- The gradient stays fp32 without a second buffer: each parameter's `grad_dtype` is fp32, so autograd's
  AccumulateGrad widens every microbatch's bf16 weight gradient and adds it into the fp32 `.grad` (the
  role of Megatron's `main_grad` and its post-accumulate hook, done by torch itself). Everything that reads
  gradients — the data-parallel reduction and its overlap hooks, the tied-embedding sum, clipping — sees
  fp32 gradients as under autocast; the zero-bubble W pass widens its product the same way
  (pipeline/split_backward.py).
- `MasterAdamW` is ZeRO-1's ShardedAdamW (zero.py) whose stepped tensors are fp32 tensors of their own
  (also where a parameter is not sliced, and at dp 1, where the slice is the whole): it steps them, rounds
  them into its slice of the bf16 parameter and all-gathers the bf16 slices over dp (half the bytes of
  autocast's fp32 all-gather).
- Under ZeRO-3 (`own`, zero3.py) a rank keeps its slice of each parameter in bf16 (`kept`: what Zero3's
  gathers read, half autocast's bytes), rounded from the master slice by `refresh` with no all-gather; the
  parameters themselves are empty at rest and gathered in bf16 where they are used. After a layer move the
  master slices arrive as `given` (balance/migrate.py moves each rank's slices, never whole masters).
- Checkpoints write the masters in place of the parameters (resilience/checkpoint.py, as ZeRO-3 writes its
  slices): the same fp32 tensors under the same names as an autocast run's, so a run resumes across the
  two modes and across layouts; a resume loads the masters and then `refresh`es the bf16 parameters.
- Live layer moves (balance/migrate.py) carry what `gather_state` gives: each parameter's whole AdamW state
  and its whole fp32 master (MASTER_KEY); the optimizer rebuilt after the move takes its masters from that,
  never from the bf16 copies. At dp > 1 the replicas keep one partition (balance/live.py's one_partition).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Iterable

import torch
from torch import nn

from hybridpar.config import TrainConfig
from hybridpar.dataparallel.zero import ShardedAdamW, Slice, part, start_gather, summed_grad
from hybridpar.topology.mesh import Topology

MASTER = torch.float32
MASTER_KEY = "master"  # a layer move's carried state: the whole fp32 master beside the moments


class MasterAdamW(ShardedAdamW):
    """AdamW over fp32 masters of this dp rank's slices of `named` (stage-qualified name, parameter); the
    parameters become bf16 working copies (`working`) whose gradients accumulate in fp32."""

    def __init__(
        self,
        named: Iterable[tuple[str, nn.Parameter]],
        t: TrainConfig,
        topo: Topology,
        carry: dict[torch.Tensor, dict[str, torch.Tensor]] | None = None,
        own: bool = False,
        given: dict[torch.Tensor, torch.Tensor] | None = None,
        working: torch.dtype = torch.bfloat16,
    ) -> None:
        # The masters are taken from the parameters as built (fp32), after a layer move from `carry`'s
        # whole masters (gather_state's MASTER_KEY; the parameters are bf16 by then), or under ZeRO-3 from
        # `given`, the master slices that moved (the parameters are empty).
        self._masters = {p: st.pop(MASTER_KEY) for p, st in (carry or {}).items() if MASTER_KEY in st}
        super().__init__(named, t, topo, carry, own, given)
        # ZeRO-3 (`own`): what a rank keeps of a parameter at rest is the bf16 slice its gathers read
        # (zero3.Zero3: half autocast's bytes), rounded from the master slice; the parameter's own storage
        # is then only the gathers' destination, emptied by Zero3.
        self.kept = [q.detach().to(working) if own and s.dim is not None else p for p, s, q in self._triples()]
        for p in self.full:
            p.data = torch.empty(p.shape, dtype=working, device=p.device) if own else p.data.to(working)
            p.grad_dtype = MASTER  # AccumulateGrad widens each bf16 gradient into the fp32 .grad
        # Layers that arrived hold their bf16 bits; the others are refreshed alike. Under ZeRO-3 the parameters
        # were emptied above: the kept slices (and any 0-dimensional parameter, never sliced) take the masters' values.
        if self._masters or own:
            self.refresh()
        self._masters = {}

    def _triples(self) -> Iterable[tuple[nn.Parameter, Slice, nn.Parameter]]:
        return zip(self.full, self.slices, self.views)

    def _view(self, p: nn.Parameter, s: Slice, given: dict[torch.Tensor, torch.Tensor] | None) -> nn.Parameter:
        if given is not None:  # ZeRO-3 after a layer move: the master slices it carried (fp32 already)
            return nn.Parameter(given[p].detach())
        whole = self._masters.get(p, p.detach())
        return nn.Parameter(part(whole, s, self.r).to(MASTER, copy=True))

    def gather_state(self) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Collective over dp: ShardedAdamW's whole AdamW state of every parameter, with its whole fp32
        master under MASTER_KEY — what a layer move carries (balance/migrate.py sends it as one more
        tensor of the parameter's shape), so the masters travel with their layers, never rounded."""
        out = super().gather_state()
        pieces = []
        for p, s, q in self._triples():
            if s.dim is not None and self.dp > 1:  # gathered whole from every rank's slice
                out[p][MASTER_KEY] = torch.empty(p.shape, dtype=MASTER, device=q.device)
                pieces.append((out[p][MASTER_KEY], q.detach(), s))
            else:  # whole already
                out[p][MASTER_KEY] = q.detach().clone()
        if pieces:
            for work in start_gather(pieces, self.r, self.group):
                work.wait(timedelta(seconds=self.topo.timeout_s))
        return out

    def step(self, closure: Any = None) -> Any:
        for p, s, q in zip(self.full, self.slices, self.views):
            q.grad = summed_grad(p, s, self.r)  # fp32: this rank's summed slice
        out = torch.optim.AdamW.step(self, closure)
        self.refresh()
        return out

    @torch.no_grad()
    def refresh(self) -> None:
        """Round the masters into this rank's slices of the parameters and all-gather them over dp
        (collective): after each step, and after a checkpoint loaded the masters. Under ZeRO-3 into the
        kept bf16 slices, with no gather: Zero3 gathers each layer where it is used."""
        for k, (p, s, q) in zip(self.kept, self._triples()):
            (k if self.own and s.dim is not None else part(p.detach(), s, self.r)).copy_(q)
        if not self.own:
            self._gather()

    @torch.no_grad()
    def widen(self) -> None:
        """Make the parameters fp32 and equal to the masters (collective over dp): the end of a run, whose
        exported model is the masters, as an autocast run's is its fp32 parameters (under ZeRO-3 after
        Zero3.close, which leaves the parameters whole)."""
        for p, s, q in self._triples():
            p.data = torch.empty(p.shape, dtype=MASTER, device=p.device)
            part(p.detach(), s, self.r).copy_(q)
        self._gather()
