"""Sequence parallelism's backward re-gather (`parallel.sp_backward = "regather"`; Korthikanti et al. 2022,
Sec. 4.2.2; Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication).

Under sequence parallelism a column-parallel layer reads the whole gathered sequence (model/tp.py's f), and
autograd keeps that input for the weight gradient: tp times the tokens of the norm region it came from, the
largest activation of a layer. Here a block's column-parallel layers (q, k, v; gate, up; GPT-2's fused
ones) keep only this rank's 1/tp slice of it, and the whole is all-gathered again in the backward, once per
block and microbatch: the first of the layers' backwards to read it gathers, the others read the same tensor,
the last one lets it go. The values are the forward's bit for bit (an all-gather copies), so the gradients
are the saved path's exactly.

How: saved-tensor hooks around the block's forward. Pack sees every tensor autograd saves there; those that
are (views of) the layers' gathered input become one shared slice, the others are handed to the hooks that
were active outside (the activation meter, pipeline/activation_meter.py), so the meter counts the slice and
everything else as before. Not where a layer is recomputed (torch.utils.checkpoint's own hooks must see its
saves), compiled (train.compile) or its weight gradient deferred (a zero-bubble W keeps the input anyway).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None


class _Slice:
    """This rank's slice of one gathered input, shared by every saved view of it."""

    __slots__ = ("packed", "outer", "group", "left", "whole")

    def __init__(self, packed: Any, outer: Hooks, group: dist.ProcessGroup) -> None:
        self.packed, self.outer, self.group = packed, outer, group
        self.left = 0  # saves not yet unpacked: the re-gathered tensor is dropped after the last
        self.whole: torch.Tensor | None = None

    def get(self, shape: torch.Size) -> torch.Tensor:
        from hybridpar.model.tp import gather_seq  # tp imports this module

        if self.whole is None:
            part = self.outer[1](self.packed) if self.outer else self.packed
            self.whole = gather_seq(part, self.group)  # (B, T, ...): the forward's tensor, bit for bit
        whole = self.whole
        self.left -= 1
        if self.left <= 0:
            self.whole = None
        return whole.view(shape)


class Regather:
    """The re-gather of one block (a module whose input model/tp.py gathers) over the tp `group`."""

    def __init__(self, stage: nn.Module, block: nn.Module, linears: list[nn.Module], group: dist.ProcessGroup) -> None:
        self.stage, self.group = stage, group
        self.rank, self.n = dist.get_rank(group), dist.get_world_size(group)
        self._ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        self._inputs: dict[int, tuple[torch.Size, _Slice | None]] = {}  # storage address -> (B, T, ...) shape, slice
        block.register_forward_pre_hook(self._enter)
        block.register_forward_hook(self._exit, always_call=True)
        for m in linears:
            m.register_forward_pre_hook(self._note)

    def _active(self) -> bool:
        s = self.stage
        return (
            torch.is_grad_enabled()
            and getattr(s, "sp_regather", False)
            and getattr(s, "recompute_phase", None) is None
            and getattr(s, "compiled", None) is None
        )

    def _enter(self, mod: nn.Module, args: tuple) -> None:
        if not self._active():
            return
        # The hooks active outside (the meter's): torch applies only the innermost pair, so ours hand on to them
        # (torch has no public call that returns the pair in force; this private one is what torch's own
        # functorch reads).
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._ctx = torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(outer, t), lambda p: self._unpack(outer, p)
        )
        self._ctx.__enter__()

    def _exit(self, mod: nn.Module, args: tuple, out: Any) -> None:
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)
        self._inputs.clear()

    def _note(self, mod: nn.Module, args: tuple) -> tuple | None:
        if self._ctx is None:
            return None
        x = args[0]
        dev = x.device.type
        if x.dtype == torch.float32 and torch.is_autocast_enabled(dev):
            # autocast would cast it inside the layer (a new tensor, the one saved): cast it here instead,
            # the same op on the same values, so the saved tensor is one we know.
            x = x.to(torch.get_autocast_dtype(dev))
        self._inputs.setdefault(x.untyped_storage().data_ptr(), (x.shape, None))
        return (x, *args[1:])

    def _pack(self, outer: Hooks, t: torch.Tensor) -> Any:
        got = self._inputs.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
        whole_view = (
            got is not None and t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()
        )
        if not whole_view:
            return (outer[0](t) if outer else t), None
        shape, sl = got
        if sl is None:
            T = shape[1] // self.n
            # A copy of its own: with one sample the slice is already contiguous, and a view would keep the whole.
            part = t.detach().view(shape)[:, self.rank * T : (self.rank + 1) * T]
            part = part.clone(memory_format=torch.contiguous_format)
            sl = _Slice(outer[0](part) if outer else part, outer, self.group)
            self._inputs[t.untyped_storage().data_ptr()] = (shape, sl)
        sl.left += 1
        return sl, t.shape

    @staticmethod
    def _unpack(outer: Hooks, packed: tuple) -> torch.Tensor:
        held, view = packed
        if view is None:
            return outer[1](held) if outer else held
        return held.get(view)
