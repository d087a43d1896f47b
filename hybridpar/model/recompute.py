"""Activation recomputation of decoder layers (`train.recompute`, per stage): trade compute for the
activations a layer keeps between its forward and its backward.

- `none`: autograd keeps everything the layer's backward reads.
- `full`: the layer keeps only its input; its whole forward runs again in backward (Chen et al. 2016,
  "Training Deep Nets with Sublinear Memory Cost"; Megatron-LM's full recomputation), collectives of
  tensor parallelism included. About one extra forward per layer: step time x ~1.3.
- `selective`: the layer keeps the outputs of its matrix multiplications (q/k/v, o, gate/up, down
  projections: aten mm/addmm) and recomputes everything between them in backward: the norms, the
  rotary embedding, the attention core (softmax(QK^T)V in scaled_dot_product_attention), the
  activation function and gating, the residual adds, and the tensor-parallel all-reduces (a
  torch.utils.checkpoint selective policy). The expensive part, the matmuls, does not run twice
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", keep
  the matmuls and recompute the cheap parts).

Both recompute deterministically the very operations of the forward on the very inputs, so gradients
and parameters are bit-identical to `none` (tests/test_recompute.py). Non-reentrant checkpointing
works with `torch.autograd.grad` on chosen inputs, which the zero-bubble B step needs.

Memory accounting: what a recomputed layer keeps must stay visible to whoever counts saved tensors
(pipeline/activation_meter.py's meter, through saved_tensors_hooks). Full recomputation's input goes through
autograd's saved tensors; selective's kept matmul outputs live in the checkpoint's own cache, so they
are also saved, by `_Keep`, on an identity node behind the layer (same storages: counted, not copied).

Zero-bubble split (pipeline/split_backward.py) needs each linear layer's input at W. A layer being
recomputed says so in `Stage.recompute_phase` ("forward" in its first run, "recompute" in the rerun
during backward): the first run keeps the output gradient's hook only, the rerun hands over the input.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from hybridpar.config.sections import RECOMPUTE_MODES

# What selective recomputation keeps: the matrix multiplications (F.linear on (B, T, d) reaches the
# dispatcher as mm, or addmm with a bias).
_KEEP_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


class _Keep(torch.autograd.Function):
    """Identity on `y` that saves `kept` for backward, so the saved-tensor hooks outside the checkpoint
    see (and count) what selective recomputation holds in its cache."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, *kept: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*kept)
        ctx.n = len(kept)
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (g,) + (None,) * ctx.n


class _Record(TorchDispatchMode):
    """Appends the output of every kept op to `kept` (the first run only). Entered above the selective
    checkpoint's caching mode, so each op passes through here, then through the cache: for the torch
    versions pyproject.toml allows whose policy does not see the output."""

    def __init__(self, kept: list[torch.Tensor]) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _KEEP_OPS:
            self.kept.append(out)
        return out


def _keep_policy(kept: list[torch.Tensor] | None, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op not in _KEEP_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if kept is not None and not ctx.is_recompute:
        kept.append(ctx.op_output)
    return CheckpointPolicy.MUST_SAVE


@contextlib.contextmanager
def _recording(cache: Any, kept: list[torch.Tensor]) -> Iterator[None]:
    with cache, _Record(kept):
        yield


# Whether the policy sees each op's output (torch >= 2.13); else a second dispatch mode records it, at the
# cost of one more Python call per op in the first run (on a GPU that CPU time can show in the step).
_POLICY_SEES_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext).parameters


def _selective_contexts(kept: list[torch.Tensor]) -> tuple[Any, Any]:
    if _POLICY_SEES_OUTPUT:
        return create_selective_checkpoint_contexts(functools.partial(_keep_policy, kept))
    first, rerun = create_selective_checkpoint_contexts(functools.partial(_keep_policy, None))
    return _recording(first, kept), rerun


def run_layer(stage: Any, layer: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """`layer(*args)` under `stage.recompute`, telling `stage.recompute_phase` which run it is, through
    the stage's compiled callable under train.compile; plain and eager when nothing will be
    differentiated (evaluation, serving)."""
    mode = stage.recompute
    if not torch.is_grad_enabled():
        return layer(*args)
    compiled = getattr(stage, "compiled", None)  # train.compile (model/compiled.py)
    if compiled is not None:
        layer = functools.partial(compiled, layer)
    if mode == "none":
        return layer(*args)
    calls = 0

    def body(*a: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        before, stage.recompute_phase = stage.recompute_phase, "forward" if calls == 1 else "recompute"
        try:
            return layer(*a)
        finally:
            stage.recompute_phase = before

    # No randomness in the layers (no dropout): nothing to replay, so the RNG state is not stashed.
    if mode == "full":
        return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=False)
    if mode != "selective":
        raise ValueError(f"recompute mode {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    kept: list[torch.Tensor] = []
    y = checkpoint(
        body,
        *args,
        use_reentrant=False,
        preserve_rng_state=False,
        context_fn=functools.partial(_selective_contexts, kept),
    )
    return _Keep.apply(y, *kept)
