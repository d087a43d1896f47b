"""Stage modules for the pipeline benchmark: emulated stages (fixed compute durations, real tensors on
the wire) and one busy-time instrumentation applied identically to every stage module, ours or torch's.

Emulation is labelled (see DESIGN.md): a stage's forward and backward *sleep* for fixed durations
instead of computing, so that 4 ranks on 2 cores do not contend for the CPU and the measured step time
is the schedule's own (bubble + communication + runtime overhead), not the machine's.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn


class SleepScale(torch.autograd.Function):
    """y = x * scale, sleeping `f_s` seconds in forward and `b_s` in backward. `scale` is a 1-element
    learnable parameter, so the stage has a real parameter with a real gradient: d scale = sum(g * x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, f_s: float, b_s: float) -> torch.Tensor:
        if f_s > 0:
            time.sleep(f_s)
        ctx.save_for_backward(x, scale)
        ctx.b_s = b_s
        return x * scale

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if ctx.b_s > 0:
            time.sleep(ctx.b_s)
        x, scale = ctx.saved_tensors
        return g * scale, (g * x).sum().reshape(scale.shape), None, None


class EmulatedStage(nn.Module):
    """One pipeline stage of the emulated model.

    Input: token ids (b, T) on the first stage, activations (b, T, hidden) elsewhere.
    Output: logits (b, T, vocab) on the last stage, activations (b, T, hidden) elsewhere.
    """

    def __init__(self, first: bool, last: bool, vocab: int, hidden: int, f_s: float, b_s: float,
                 seed: int) -> None:
        super().__init__()
        self.first, self.last, self.f_s, self.b_s = first, last, f_s, b_s
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(vocab, hidden, generator=g)) if first else None
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(1, generator=g))
        self.proj = nn.Parameter(torch.randn(vocab, hidden, generator=g) / hidden**0.5) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.embedding(x, self.embed) if self.first else x  # (b, T, hidden)
        h = SleepScale.apply(h, self.scale, self.f_s, self.b_s)
        return F.linear(h, self.proj) if self.last else h  # (b, T, vocab) | (b, T, hidden)


class BusyTimer:
    """Seconds this rank spent inside stage forward and backward computations.

    A forward is timed directly. A backward runs inside one `torch.autograd.backward` call (both
    runtimes call it synchronously): it starts when the gradient reaches the stage output and ends at
    the last of the events "gradient reached the stage input" / "a parameter's gradient was
    computed". The interval is closed lazily (at the next forward/backward or at `close()`), so time
    spent waiting for messages after a backward is never counted."""

    def __init__(self) -> None:
        self.busy = 0.0
        self._start: float | None = None
        self._last = 0.0

    def reset(self) -> None:
        self.close()
        self.busy = 0.0

    def close(self) -> None:
        if self._start is not None:
            self.busy += self._last - self._start
            self._start = None

    def backward_begins(self) -> None:
        self.close()
        self._start = self._last = time.perf_counter()

    def backward_event(self) -> None:
        if self._start is not None:
            self._last = time.perf_counter()


class _OutputMark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, timer: BusyTimer) -> torch.Tensor:
        ctx.timer = timer
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.timer.backward_begins()
        return g, None


class _InputMark(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, timer: BusyTimer) -> torch.Tensor:
        ctx.timer = timer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.timer.backward_event()
        return g, None


class Timed(nn.Module):
    """Wraps a stage module; adds its forward and backward time to `timer`. Numerically the identity."""

    def __init__(self, inner: nn.Module, timer: BusyTimer) -> None:
        super().__init__()
        self.inner, self.timer = inner, timer
        for p in inner.parameters():
            # A tensor hook (not a post-accumulate one) also fires under torch.autograd.grad, which
            # our runtime's split backward (B of zero-bubble schedules) uses.
            p.register_hook(lambda _g: timer.backward_event())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.timer
        t.close()
        t0 = time.perf_counter()
        if x.requires_grad:
            x = _InputMark.apply(x, t)
        y = self.inner(x)
        if y.requires_grad:
            y = _OutputMark.apply(y, t)
        t.busy += time.perf_counter() - t0
        return y
