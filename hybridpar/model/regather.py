"""What a block keeps for its backward, and what it rebuilds there instead: the one set of saved-tensor hooks
of a block (a module whose column-parallel layers read its input: attention, MLP).

Two kinds of rewrite, each bit for bit the forward's tensor, so the gradients are the saved path's exactly:

- **Re-gather** (`parallel.sp_backward = "regather"`; Korthikanti et al. 2022, Sec. 4.2.2; Megatron-LM's
  LinearWithGradAccumulationAndAsyncCommunication). Under sequence parallelism a column-parallel layer reads
  the whole gathered sequence (model/tp.py's f), and autograd keeps that input for the weight gradient: tp
  times the tokens of the norm region it came from, the largest activation of a layer. Here the block's
  column-parallel layers (q, k, v; gate, up; GPT-2's fused ones) keep only this rank's 1/tp slice of it, and
  the whole is all-gathered again in the backward, once per block and microbatch (an all-gather copies).
- **Rebuild** (`train.rebuild_saved`): tensors the backward can remake exactly and cheaply from tensors kept
  anyway, by the very ops that made them. The projections' input, when the block's input is a norm's output
  (behind tp's f, which marks its node `tp_f`) whose autograd node says how to remake it (`remake` in the
  node's metadata, called with the node: llama.RMSNorm from its fp32 input and 1/rms, gpt2.LayerNorm from
  its input), cast as
  the block cast it (llama.shared_casts), under re-gather the rank's slice (the norm's own output); a tensor
  the model hands to `rebuilt` with its recipe (llama's silu(gate) * up from gate and up, which SwiGLU keeps;
  GPT-2's gelu(fc) from fc, which gelu keeps);
  and k, v repeated to the query heads (`repeated`: only one head of each group is kept).

Every save of one tensor shares one rebuilt tensor: the first of the backwards to read it remakes it, the
others read the same, the last one lets it go.

How: saved-tensor hooks around the block's forward (`saving`, entered by the block's own forward: no module
hooks, which would make a compiled layer's guards differ from layer to layer). The block tells them which
tensors its projections read (`note`); pack sees every tensor autograd saves there; those it knows become
their recipe, the others are handed to the hooks that were active outside (the activation
meter, pipeline/activation_meter.py), so the meter counts what is kept (a slice, a head of each group) and
everything else as before; a recipe's inputs are held (and counted) by the ops that saved them. Not where a
layer is recomputed (torch.utils.checkpoint's own hooks must see its saves), compiled (train.compile: the
graph saves its own set) or its weight gradient deferred (a zero-bubble W keeps the inputs anyway), nor
without gradients (serving).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None


class _Kept:
    """One saved tensor as its recipe, shared by every saved view of it: `make` remakes the whole."""

    __slots__ = ("make", "left", "whole")

    def __init__(self, make: Callable[[], torch.Tensor]) -> None:
        self.make = make
        self.left = 0  # saves not yet unpacked: the remade tensor is dropped after the last
        self.whole: torch.Tensor | None = None

    def get(self, shape: torch.Size) -> torch.Tensor:
        if self.whole is None:
            self.whole = self.make()
        whole = self.whole
        self.left -= 1
        if self.left <= 0:
            self.whole = None
        return whole.view(shape)


def _low(x: torch.Tensor) -> torch.Tensor:
    """x as an autocast-ed op would read it: fp32 cast to autocast's dtype (the op's own cast, done here so
    that the saved tensor is one we know), anything else as it is."""
    dev = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        return x.to(torch.get_autocast_dtype(dev))
    return x


class BlockSaves:
    """The saved-tensor hooks of one block of `stage` (installed by tp.install_saves). `group`: the tp group
    for the re-gather (None: no tensor parallelism, nothing to re-gather)."""

    def __init__(self, stage: nn.Module) -> None:
        self.stage, self.group = stage, None
        self.rank, self.n = 0, 1
        self._ctx: torch.autograd.graph.saved_tensors_hooks | None = None
        self._outer: Hooks = None
        self._regather = self._rebuild = False  # what is in force during this forward
        self._source: Callable[[], torch.Tensor] | None = None  # remakes the norm's output (this rank's slice)
        # storage address -> (the (B, T, ...) shape the recipe makes, recipe: a _Kept's make, None to re-gather)
        self._known: dict[int, tuple[torch.Size, Callable[[], torch.Tensor] | None]] = {}
        self._kept: dict[int, _Kept] = {}

    def set_group(self, group: dist.ProcessGroup) -> None:
        self.group, self.rank, self.n = group, dist.get_rank(group), dist.get_world_size(group)

    @contextlib.contextmanager
    def saving(self, block: nn.Module, x: torch.Tensor) -> Iterator[None]:
        """Around the forward of `block`, whose input (as its forward reads it: after tp's f) is `x`."""
        if not self._enter(block, x):
            yield
            return
        try:
            yield
        finally:
            ctx, self._ctx = self._ctx, None
            assert ctx is not None
            ctx.__exit__(None, None, None)
            self._known.clear()
            self._kept.clear()
            self._source, self._outer = None, None

    def _enter(self, block: nn.Module, x: torch.Tensor) -> bool:
        s = self.stage
        if not torch.is_grad_enabled() or s.recompute_phase is not None or s.compiled is not None:
            return False
        self._regather = self.group is not None and getattr(s, "sp_regather", False)
        self._rebuild = getattr(s, "rebuild_now", False) and getattr(block, "rebuilds_saved", False)
        if not (self._regather or self._rebuild):
            return False
        node = x.grad_fn
        if getattr(node, "tp_f", False):  # tp's f (a copy, or the sequence's all-gather): the norm is behind it
            node = node.next_functions[0][0]
        remake = node.metadata.get("remake") if node is not None else None
        # the norm's output itself, or under SP re-gathered from its slices (not a gathered whole kept as it is)
        usable = self._rebuild and remake is not None and (self._regather or s.seq_shards == 1)
        self._source = (lambda: remake(node)) if usable else None
        # The hooks active outside (the meter's): torch applies only the innermost pair, so ours hand on to them
        # (torch has no public call that returns the pair in force; this private one is what torch's own
        # functorch reads).
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._outer = outer
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda p: self._unpack(outer, p))
        self._ctx.__enter__()
        return True

    def note(self, x: torch.Tensor) -> torch.Tensor:
        """`x`, the block's input as its column-parallel projections read it (tp's f applied, the block's cast
        if any): re-gathered or remade from the norm in the backward. Returned as the projections must read it
        (autocast's cast done here: the same op, so that the saved tensor is one we know)."""
        if self._ctx is None:
            return x
        x = _low(x)
        key = x.untyped_storage().data_ptr()
        if self._regather:
            self._known.setdefault(key, (x.shape, None))
        elif self._source is not None:
            src, dtype = self._source, x.dtype
            self._known.setdefault(key, (x.shape, lambda: src().to(dtype)))  # (B, T, d): the norm's output, cast
        return x

    def rebuilt(self, t: torch.Tensor, make: Callable[[], torch.Tensor]) -> None:
        """`t` (just made in this block's forward) is what `make()` returns, bit for bit, from tensors the
        backward keeps anyway: save the recipe instead of it."""
        if self._ctx is not None and self._rebuild:
            self._known.setdefault(t.untyped_storage().data_ptr(), (t.shape, make))

    def repeated(self, t: torch.Tensor, rep: int) -> torch.Tensor:
        """`t` (B, kv * rep, T, hd): each kv head repeated `rep` times for the query heads (kvcache.sdpa), as
        attention will read it (autocast's cast done here): saved, only the first head of each group is kept."""
        if self._ctx is None or not self._rebuild or rep == 1:
            return t
        t = _low(t)
        if t.is_contiguous():
            B, H, T, hd = t.shape
            one = t.detach().view(B, H // rep, rep, T, hd)[:, :, 0].clone()  # (B, kv, T, hd): a copy of its own
            held = self._outer[0](one) if self._outer else one
            outer = self._outer
            self._known[t.untyped_storage().data_ptr()] = (
                t.shape,
                lambda: (outer[1](held) if outer else held).repeat_interleave(rep, dim=1),
            )
        return t

    def _pack(self, t: torch.Tensor) -> Any:
        outer = self._outer
        key = t.untyped_storage().data_ptr() if t.layout == torch.strided else None
        got = self._known.get(key) if key is not None else None
        if got is None or not (t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()):
            return (outer[0](t) if outer else t), None
        kept = self._kept.get(key)
        if kept is None:
            shape, make = got
            kept = self._kept[key] = _Kept(make if make is not None else self._slice_of(t.detach().view(shape)))
        kept.left += 1
        return kept, t.shape

    def _slice_of(self, whole: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The re-gather of `whole` (B, T, ...): keep this rank's slice, or remake it from the norm."""
        from hybridpar.model.tp import gather_seq  # tp imports this module

        group, outer = self.group, self._outer
        assert group is not None
        if self._source is not None:  # the slice is the norm's output on this rank, cast as the block cast it
            src, dtype = self._source, whole.dtype
            return lambda: gather_seq(src().to(dtype), group)
        T = whole.shape[1] // self.n
        # A copy of its own: with one sample the slice is already contiguous, and a view would keep the whole.
        part = whole[:, self.rank * T : (self.rank + 1) * T].clone(memory_format=torch.contiguous_format)
        held = outer[0](part) if outer else part
        return lambda: gather_seq(outer[1](held) if outer else held, group)  # the forward's tensor, bit for bit

    @staticmethod
    def _unpack(outer: Hooks, packed: tuple) -> torch.Tensor:
        held, view = packed
        if view is None:
            return outer[1](held) if outer else held
        return held.get(view)


def block_saves(block: nn.Module) -> BlockSaves | None:
    """The saved-tensor hooks of `block` (installed by tp.install_saves), where they may act: not inside a
    compiled layer, whose graph saves its own set (and where reading a per-layer object would make dynamo
    compile a graph per layer)."""
    return None if torch.compiler.is_compiling() else getattr(block, "saves", None)


def saving(block: nn.Module, x: torch.Tensor) -> contextlib.AbstractContextManager:
    """`with saving(self, x):` around a block's forward (x: its input): its saved-tensor hooks, where in force."""
    saves = block_saves(block)
    return contextlib.nullcontext() if saves is None else saves.saving(block, x)
