"""ZeRO-3 over the data-parallel axis (`--parallel.zero 3`): parameters sharded at rest, gathered per layer
just before use, freed after.

Ours, as ZeRO-1 and 2 are, not torch's FSDP2 (`fully_shard`): FSDP2 turns parameters into DTensors and
runs its own reduce-scatter in its own post-backward hooks, while our pipeline runtime drives the
backward itself (split B/W passes of the zero-bubble schedules, recomputation, activations sent between
ranks), our tensor parallelism shards plain tensors (model/tp.py) and our data-parallel reduction is
bucketed and overlapped already (grads.py). ZeRO-3 here is ZeRO-2 (optimizer state and gradients cut by
zero.slice_of's rule) plus one thing: each dp rank keeps only its slice of every parameter (the tensor
AdamW steps, `ShardedAdamW(own=True)`) and the parameter's own storage is empty at rest.

How a parameter is freed and gathered (FSDP1's storage trick): the parameter keeps its shape; its storage
is resized to 0 bytes to free it and back to full size before an all-gather writes into it. Autograd's
saved tensors refer to the same storage, so a weight freed after the forward and gathered again before
the backward is the very tensor the backward reads. Writes go through `p.data`, whose version counter is
its own: refilling a saved weight with the same values is not an in-place change autograd must refuse.

When (per pipeline stage; a "unit" is one decoder layer's parameters, or the stage's others: embedding,
final norm, head):
- forward: the stage's pre-hook gathers its other parameters and starts layer 0's gather; each layer's
  pre-hook waits for its own gather and starts the next layer's (prefetch: the next layer's all-gather runs
  in gloo's/NCCL's thread while this layer computes).
- `regather="microbatch"`: a layer's parameters are freed by its forward hook; a hook on its output's
  gradient (fired just before its backward) gathers it again, frees the layer after it (whose backward is
  done) and starts the previous layer's gather. The runtime's end of each compute action frees what is left.
- `regather="step"`: parameters stay gathered from their first use in the step until the trainer calls
  `release()` after the backward: one gather per layer per step, a stage's whole parameters held meanwhile.

Every parameter is sliced (zero.slice_of cuts any tensor along its first dimension, rank 0 holding the
rows left over) and gathered in place into its own storage: the gathers hold no buffer of ours.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.dataparallel.zero import ShardedAdamW, Slice, start_gather
from hybridpar.model.stage import Stage
from hybridpar.pipeline.activation_meter import ActivationMeter
from hybridpar.topology.mesh import Topology

REGATHER = ("microbatch", "step")


def _compact(p: nn.Parameter) -> None:
    """Give `p` a storage of its own, exactly its size, so that resizing it frees `p` and nothing else.
    An empty storage is one a previous Zero3 freed (rebuilt after a layer move): its own already."""
    nbytes = p.untyped_storage().nbytes()
    if nbytes and (p.storage_offset() != 0 or nbytes != p.numel() * p.element_size()):
        p.data = p.data.clone()


class Zero3:
    """The gathers and frees of one rank's stages (see the module docstring). `opt` is the ShardedAdamW
    (own=True) holding the slices; `meter` is told which storages are parameters while they are gathered."""

    def __init__(
        self,
        topo: Topology,
        stages: dict[int, Stage],
        opt: ShardedAdamW,
        regather: str,
        meter: ActivationMeter | None = None,
    ) -> None:
        assert regather in REGATHER and opt.own, (regather, opt.own)
        self.topo, self.group, self.dp, self.r = topo, opt.group, opt.dp, opt.r
        self.regather, self.meter = regather, meter
        self.timeout = timedelta(seconds=topo.timeout_s)
        # id(parameter) -> (parameter, its slice rule, this rank's slice at rest: opt.kept, bf16 under working
        # copies): only parameters that are sliced.
        self.shards: dict[int, tuple[nn.Parameter, Slice, torch.Tensor]] = {
            id(p): (p, s, q) for p, s, q in zip(opt.full, opt.slices, opt.kept) if s.dim is not None
        }
        self.units: dict[int, list[list[nn.Parameter]]] = {}  # stage -> [others, layer 0, layer 1, ...]
        self.gathered: set[int] = set()
        self._pending: dict[int, list[dist.Work]] = {}  # id(param) -> the works of its gather under way
        self.gathers = 0  # parameter all-gathers started (per parameter), over the run
        self.held = 0  # bytes of whole parameters gathered now
        self.peak = 0  # most of them at once since the last `reset_peak()`
        self._hooks: list[Any] = []
        for p, _, _ in self.shards.values():
            _compact(p)
        for s, st in stages.items():
            self._install(s, st)
        for p, _, _ in self.shards.values():  # at rest from the start: the slices hold the values
            p.data.untyped_storage().resize_(0)

    # -- units and hooks ---------------------------------------------------------------------------------
    def _install(self, s: int, st: Stage) -> None:
        layers = list(st.layers.values())
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        others = [p for p in st.parameters() if id(p) not in in_layers]
        units = [others] + [list(layer.parameters()) for layer in layers]
        self.units[s] = [[p for p in u if id(p) in self.shards] for u in units]
        self._hooks.append(st.register_forward_pre_hook(lambda mod, args: self._stage_enter(s)))
        self._hooks.append(st.register_forward_hook(lambda mod, args, out: self._stage_exit(s, st, out)))
        for i, layer in enumerate(layers, start=1):
            self._hooks.append(layer.register_forward_pre_hook(self._layer_pre(s, st, i)))
            self._hooks.append(layer.register_forward_hook(self._layer_post(s, st, i)))

    def gather_all(self) -> None:
        """Every parameter whole (collective over dp), until the next `release()`."""
        for s in self.units:
            for u in range(len(self.units[s])):
                self.gather(s, u)

    def close(self) -> None:
        """Gather every parameter (whole again) and remove the hooks."""
        self.gather_all()
        self.unhook()

    def unhook(self) -> None:
        """Remove the hooks and forget the parameters, leaving them as they are (at rest: empty, their
        slices in the optimizer; a layer move then carries the slices, balance/migrate.py)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.units, self.shards = {}, {}  # nothing is freed from now on

    def _stage_enter(self, s: int) -> None:
        self.gather(s, 0)
        self.prefetch(s, 1)

    def _stage_exit(self, s: int, st: Stage, out: torch.Tensor) -> None:
        if self.regather != "microbatch":
            return
        if torch.is_grad_enabled() and out.requires_grad:
            # The backward starts with the head (last stage) or the last layer: gather them first.
            out.register_hook(lambda g: self._backward_enter(s))
        self.free(s, 0)

    def _backward_enter(self, s: int) -> None:
        self.gather(s, 0)
        self.prefetch(s, len(self.units[s]) - 1)

    def _layer_pre(self, s: int, st: Stage, u: int) -> Any:
        # Eager beside a compiled layer (train.compile): dynamo stops before the hook and compiles the
        # layer's forward on its own, whose graph takes the gathered parameters as inputs like any others.
        @torch.compiler.disable
        def hook(mod: nn.Module, args: tuple) -> None:
            self.gather(s, u)
            if st.recompute_phase != "recompute":  # a rerun inside the backward runs in reverse order
                self.prefetch(s, u + 1)

        return hook

    def _layer_post(self, s: int, st: Stage, u: int) -> Any:
        @torch.compiler.disable  # eager beside a compiled layer, as _layer_pre's
        def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if self.regather != "microbatch" or st.recompute_phase == "recompute":
                return
            if torch.is_grad_enabled() and out.requires_grad:
                out.register_hook(lambda g: self._before_layer_backward(s, u))
                if u == 1 and args and torch.is_tensor(args[0]) and args[0].requires_grad:
                    args[0].register_hook(lambda g: self.free(s, 1))  # layer 0's backward is done
            self.free(s, u)

        return hook

    def _before_layer_backward(self, s: int, u: int) -> None:
        if u + 1 < len(self.units[s]):
            self.free(s, u + 1)  # its backward produced this gradient: it is done
        self.gather(s, u)
        self.prefetch(s, u - 1 if u > 1 else 0)

    # -- gather and free ---------------------------------------------------------------------------------
    def prefetch(self, s: int, u: int) -> None:
        """Start unit u's all-gather (returns at once) unless it is gathered or on its way."""
        if 0 <= u < len(self.units.get(s, ())):
            self._start([p for p in self.units[s][u] if id(p) not in self.gathered and id(p) not in self._pending])

    def gather(self, s: int, u: int) -> None:
        """Unit u of stage s whole on this rank (waits for its prefetch, or gathers it now)."""
        if not 0 <= u < len(self.units.get(s, ())):
            return
        self.prefetch(s, u)
        for p in self.units[s][u]:
            if id(p) in self._pending:
                self._finish(p)

    @torch.no_grad()
    def _start(self, ps: list[nn.Parameter]) -> None:
        if not ps:
            return
        for p in ps:  # counted from here: the prefetched layer's storage is held while the current one computes
            p.data.untyped_storage().resize_(p.numel() * p.element_size())
            self.held += p.numel() * p.element_size()
        self.peak = max(self.peak, self.held)
        # In place into the parameters' storages (zero.start_gather): no buffer of ours.
        works = start_gather([(p.data, self.shards[id(p)][2], self.shards[id(p)][1]) for p in ps], self.r, self.group)
        for p in ps:
            self._pending[id(p)] = works
        self.gathers += len(ps)

    @torch.no_grad()
    def _finish(self, p: nn.Parameter) -> None:
        for w in self._pending.pop(id(p)):
            w.wait(self.timeout)
        self.gathered.add(id(p))
        if self.meter is not None:
            self.meter.exclude(p)

    def free(self, s: int, u: int) -> None:
        """Drop unit u's whole parameters (their slices stay); waits for a gather still under way."""
        if 0 <= u < len(self.units.get(s, ())):
            self._free(self.units[s][u])

    def _free(self, ps: list[nn.Parameter]) -> None:
        for p in ps:
            if id(p) in self._pending:
                self._finish(p)
            if id(p) in self.gathered:
                if self.meter is not None:
                    self.meter.include(p)
                self.gathered.discard(id(p))
                self.held -= p.numel() * p.element_size()
                p.data.untyped_storage().resize_(0)

    def release(self) -> None:
        """Free every gathered parameter (the end of a step's backward, of an evaluation)."""
        self._free([p for p, _, _ in self.shards.values()])

    def after_action(self, stage: int) -> None:
        """The runtime's end of a compute action of `stage`: under per-microbatch regathering, free the rest."""
        if self.regather == "microbatch":
            for u in range(len(self.units.get(stage, ()))):
                self.free(stage, u)
