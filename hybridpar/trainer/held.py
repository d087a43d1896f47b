"""What one rank holds at its step's peak, counted from its tensors: the measured side of the analytic
memory model (plan/memory_model.py), reported per rank in metrics.jsonl (`monitor.memory`) and by
`hybridpar bench memory_accuracy`.

Each component is counted where it is largest in the step, the same definition the model uses:
gradients after the backward and the data-parallel sum (before the optimizer clears them) — under
ZeRO-2 the whole gradients as the reduction found them, before it kept only this rank's slices, which
are counted apart as `grads_at_rest` (what the rank holds from the reduction through the optimizer
step; without ZeRO-2 the same as `grads`); optimizer
state inside the optimizer step (AdamW's moments and step counts; under ZeRO-1 the slices it steps are
views of the parameters and their gradients, counted there); activations as the meter's peak (what autograd saves
for backward, pipeline/activation_meter.py); communication buffers as the most that was allocated for messages
at once — the receive buffers and shared-memory rings (persistent), plus the largest of the step's
transient ones: the data-parallel gradient buckets, the tied-embedding sum and ZeRO's all-gather.
"""

from __future__ import annotations

from typing import Iterable

import torch

COMPONENTS = ("params", "grads", "optimizer", "activations", "buffers")


def tensor_bytes(tensors: Iterable[torch.Tensor | None], counted: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (a tied head and its embedding are one), leaving
    out storages in `counted` (already counted elsewhere) and adding the new ones to it."""
    counted = set() if counted is None else counted
    total = 0
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            if s.data_ptr() not in counted:
                counted.add(s.data_ptr())
                total += s.nbytes()
    return total


def optimizer_bytes(opt: torch.optim.Optimizer, counted: set[int]) -> int:
    """AdamW's state tensors, plus the tensors it steps and their gradients where they are not the
    parameters' own storages (counted in `counted` already; ZeRO-1's slices are views of them)."""
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    stepped = [q for g in opt.param_groups for q in g["params"]]
    return tensor_bytes([*state, *stepped, *(q.grad for q in stepped)], counted)


def held_bytes(
    params: list[torch.nn.Parameter],
    opt: torch.optim.Optimizer,
    activation_peak: int,
    persistent_buffers: int,
    transient_buffers: Iterable[int],
    whole_grads: int = 0,
    gathered_params: int = 0,
) -> dict[str, int]:
    """The components of one rank, counted inside the optimizer step (gradients still set). `whole_grads`:
    under ZeRO-2 the bytes of the whole gradients the reduction freed (grads.DataParallelGrads.whole_bytes),
    counted from its tensors before it freed them. Under ZeRO-3 `params` are this rank's slices (at rest) and
    `gathered_params` the most bytes of whole parameters it had gathered at once in the step (zero3.Zero3.peak)."""
    counted: set[int] = set()
    params_bytes = tensor_bytes(params, counted)
    rest = tensor_bytes((g for p in params for g in (p.grad, getattr(p, "grad_slice", None))), counted)
    return {
        "params": params_bytes + gathered_params,
        "params_at_rest": params_bytes,
        "grads": max(rest, whole_grads),
        "grads_at_rest": rest,
        "optimizer": optimizer_bytes(opt, counted),
        "activations": int(activation_peak),
        "buffers": persistent_buffers + max(transient_buffers, default=0),
    }
