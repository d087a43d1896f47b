"""Split backward for zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism").

B computes only what the previous stage is waiting for — the input gradient — plus the gradients of
parameters outside linear layers (norm gains, embedding). W, scheduled later into what would be pipeline
bubble, computes each linear weight's gradient dW = g^T x from the layer input x and output gradient g
captured during F and B. Nothing is computed twice: autograd skips the dW matmuls in B because the
weights are not among the requested inputs.

A module of the stage that is not a linear layer may take part by defining two methods:
`defer_weight_grad(key)`, called before each of its forwards that runs under microbatch `key` (it then
keeps its deferred weights out of the graph B differentiates), and `weight_grad(key)`, called at W to
accumulate those weights' gradients. The benchmark's emulated stage uses them (bench/emulated.py); a
stage without such modules (every model family's) is unaffected. Nothing here knows a family: linear
layers (biases included: theirs are computed in B with the other non-linear parameters) are found by
type, a tied head by its weight being another module's too.

Activation recomputation (model/recompute.py): a layer recomputed in backward must not keep its linear
layers' inputs from F to W — that is the memory recomputation exists to save. Its stage says which
run of the layer is under way (`recompute_phase`): the first ("forward") records the output-gradient
hook only; the rerun inside B ("recompute", while `key` names the microbatch being differentiated)
hands each linear its recomputed input, bit-identical to the first. Between B and W the inputs are
held, as without recomputation.
"""

from __future__ import annotations

from typing import Hashable

import torch
from torch import nn

from hybridpar.pipeline.activation_meter import ActivationMeter


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    """Add g into p.grad as autograd's AccumulateGrad would: widened to the gradient's dtype where that is
    not the parameter's (bf16 working copies keep fp32 gradients: dataparallel/copies.py)."""
    if p.grad is not None:
        p.grad.add_(g)  # a bf16 g into an fp32 gradient: widened elementwise, then added in fp32
        return
    wide = getattr(p, "grad_dtype", None) or g.dtype
    p.grad = g.to(wide) if wide != g.dtype else g.clone()


class WeightGradDeferral:
    def __init__(self, stage: nn.Module) -> None:
        # A linear weight that another module uses too (a head tied to the embedding in the same stage)
        # is one leaf with two uses: B differentiates it through both, as autograd does.
        shared = {id(p) for m in stage.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
        self.linears = [m for m in stage.modules() if isinstance(m, nn.Linear) and id(m.weight) not in shared]
        deferred = {id(m.weight) for m in self.linears}
        self.others = [p for p in stage.parameters() if id(p) not in deferred]
        self.stage = stage
        # Counts what the captures keep from F and B until W (pipeline/activation_meter.py); set by the runtime.
        self.meter: ActivationMeter | None = None
        self.key: Hashable | None = None
        self.captured: dict[Hashable, list[list]] = {}
        self._pending: dict[tuple[Hashable, int], list] = {}  # (key, id(linear)) -> entry awaiting its input
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        for m in self.linears:
            # prepend: see the raw linear output, before any tensor-parallel hook reduces or gathers it.
            self._hooks.append(m.register_forward_hook(self._capture, prepend=True))
            # Before the linear runs: a recomputation may stop right after its last saved tensor, inside
            # the last linear (torch.utils.checkpoint's early stop), so its forward hook would not fire.
            self._hooks.append(m.register_forward_pre_hook(self._recomputed_input))
        self.custom = [
            m
            for m in stage.modules()
            if callable(getattr(m, "defer_weight_grad", None)) and callable(getattr(m, "weight_grad", None))
        ]
        for m in self.custom:
            self._hooks.append(m.register_forward_pre_hook(self._announce))
        # train.compile (model/compiled.py): a compiled backward computes every gradient of its graph at once,
        # so a linear layer inside it would have its dW computed in B and again in W. Its product runs
        # eagerly between compiled regions instead (measured: 29 matmuls in a tiny model's B, 15 with this).
        self._eager = self.linears if getattr(stage, "compiled", None) is not None else []
        for m in self._eager:
            m.forward = torch.compiler.disable(m.forward)

    def detach(self) -> None:
        """Take every hook off the stage's modules and forget the captures (its layers are changing)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for m in self._eager:
            del m.forward  # the class's own again
        self._eager = []
        self.clear()

    def clear(self) -> None:
        """Forget every microbatch's captures (a failed step)."""
        self.captured.clear()
        self._pending.clear()

    def _phase(self) -> str | None:
        return getattr(self.stage, "recompute_phase", None)

    @torch.compiler.disable  # Python state per microbatch: eager beside compiled layers
    def _announce(self, mod: nn.Module, args: tuple) -> None:
        if self.key is not None and torch.is_grad_enabled() and self._phase() != "recompute":
            mod.defer_weight_grad(self.key)

    @torch.compiler.disable  # Python state per microbatch: eager beside compiled layers
    def _recomputed_input(self, mod: nn.Linear, args: tuple) -> None:
        if self.key is not None and torch.is_grad_enabled() and self._phase() == "recompute":
            entry = self._pending.pop((self.key, id(mod)))
            entry[1] = args[0].detach()
            self._hold(entry, entry[1])

    @torch.compiler.disable  # Python state per microbatch: eager beside compiled layers
    def _capture(self, mod: nn.Linear, args: tuple, out: torch.Tensor) -> None:
        phase = self._phase()
        if self.key is None or not torch.is_grad_enabled() or phase == "recompute":
            return
        entry = [mod, args[0].detach() if phase is None else None, None, []]  # [..., meter handles]
        if phase == "forward":  # recomputed in B: the input arrives then
            self._pending[(self.key, id(mod))] = entry
        else:
            self._hold(entry, entry[1])
        self.captured.setdefault(self.key, []).append(entry)

        def keep_grad(g: torch.Tensor) -> None:
            entry[2] = g
            self._hold(entry, g)

        out.register_hook(keep_grad)

    def _hold(self, entry: list, t: torch.Tensor) -> None:
        if self.meter is not None:
            entry[3].append(self.meter.hold(t))  # released with the entry, at W

    def backward_input(
        self, y: torch.Tensor, grad_y: torch.Tensor | None, x: torch.Tensor | None, key: Hashable = None
    ) -> torch.Tensor | None:
        """B of microbatch `key`: gradient of the stage input (returned) and of non-linear parameters
        (accumulated)."""
        inputs = ([x] if x is not None else []) + self.others
        self.key = key  # layers recomputed during this B hand their linears' inputs to `key`'s W
        try:
            grads = torch.autograd.grad(y, inputs, grad_outputs=grad_y, allow_unused=True)
        finally:
            self.key = None
        for p, g in zip(self.others, grads[1:] if x is not None else grads):
            if g is not None:
                _accumulate(p, g)
        return grads[0] if x is not None else None

    def weight(self, key: Hashable) -> None:
        """W: accumulate dW = g^T x for every linear used by microbatch `key`."""
        for mod, x, g, _ in self.captured.pop(key, []):  # a stage without linear layers defers nothing
            assert g is not None and x is not None, "W before its B: the output gradient or input is missing"
            g2 = g.flatten(0, -2)
            # Under bf16 autocast g is bf16 and the forward multiplied bf16 copies: the same product
            # autograd's backward forms, widened into the fp32 gradient as its AccumulateGrad would.
            _accumulate(mod.weight, (g2.t() @ x.flatten(0, -2).to(g2.dtype)).to(mod.weight.dtype))
        for mod in self.custom:
            mod.weight_grad(key)
