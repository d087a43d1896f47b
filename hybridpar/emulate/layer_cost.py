"""Emulated layer cost (`--emulate.layer_ms`): a named benchmark mode, off by default.

Every decoder layer of a stage costs a fixed duration per sample: after the stage's real forward
it sleeps `layers x samples x layer_ms`, and its backward sleeps twice that (the usual B = 2F).
With a tiny model the real compute is then negligible, so 4 ranks sharing 2 cores measure the
speeds the balancer is meant to see, not the CPU contention; `--emulate.slowdown` still stretches
a rank on top (it scales the action's whole measured time, sleep included). The real tensors still
flow and the math is untouched: the sleep sits in an identity autograd node. The duration is read
from the stage's current layer count at each forward, so it follows layers that move. The run entry
attaches it to the trainer's stages (attach.py), never the trainer itself.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f_s: float, b_s: float) -> torch.Tensor:
        time.sleep(f_s)
        ctx.b_s = b_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.b_s)
        return g, None, None


def attach_layer_cost(stage: nn.Module, layer_ms: float) -> Callable[[], None]:
    """Make `stage` (a model Stage) cost `layer_ms` per layer and sample forward, twice that backward;
    returns the function that takes the cost off again (nothing to take off at `layer_ms` 0)."""
    if layer_ms <= 0:
        return lambda: None

    def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        f_s = len(mod.layer_ids) * args[0].shape[0] * layer_ms / 1000.0
        return _Sleep.apply(out, f_s, 2.0 * f_s) if torch.is_grad_enabled() else _sleep_eval(out, f_s)

    return stage.register_forward_hook(hook).remove


def _sleep_eval(out: torch.Tensor, f_s: float) -> torch.Tensor:
    time.sleep(f_s)
    return out
