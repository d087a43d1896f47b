"""Stage modules for the pipeline benchmark: emulated stages (fixed compute durations, real tensors on
the wire) and, for compute mode, one busy-time instrumentation applied identically to every stage
module, ours or torch's (`Timed`).

Emulation is labelled (see DESIGN.md): a stage's forward and backward *sleep* for fixed durations
instead of computing, so that 4 ranks on 2 cores do not contend for the CPU and the measured step time
is the schedule's own (bubble + communication + runtime overhead), not the machine's. Every sleep is
logged (`SleepLog`: requested vs. actual seconds): the emulated ranks' busy time is the time they
actually slept, and the overshoot (wake-up latency) is one of the measured per-action costs the
simulator is fed with (latency.py).

Split backward (zero-bubble schedules): with `w_s > 0` a stage's backward is two sleeps, `b_s` on the
activation path (B: what the previous stage waits for) and `w_s` on the path to the stage's weight
(`scale`, W). Under a full backward both run (b_s + w_s); torch's split backward
(`stage_backward_input` / `stage_backward_weight`) separates them through the autograd graph; our
runtime's split (`split_backward.WeightGradDeferral`) calls `defer_weight_grad(key)` before the
forward of microbatch `key` and `weight_grad(key)` at its W, the stage's hooks for weights that are
not `nn.Linear`.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn


class SleepLog:
    """The emulated compute of one rank: every sleep as (op "F" | "B" | "W", requested s, start, end),
    times from `time.perf_counter` (comparable with the runtime's timeline)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, float, float, float]] = []

    def sleep(self, op: str, seconds: float) -> None:
        if seconds <= 0:
            return
        t0 = time.perf_counter()
        time.sleep(seconds)
        self.entries.append((op, seconds, t0, time.perf_counter()))

    def clear(self) -> None:
        self.entries.clear()

    def busy_s(self) -> float:
        return sum(end - start for _, _, start, end in self.entries)


def _sleep(log: SleepLog | None, op: str, seconds: float) -> None:
    if log is not None:
        log.sleep(op, seconds)
    elif seconds > 0:
        time.sleep(seconds)


class SleepScale(torch.autograd.Function):
    """y = x * scale, sleeping `f_s` seconds in forward and `b_s` in backward. `scale` is a 1-element
    learnable parameter, so the stage has a real parameter with a real gradient: d scale = sum(g * x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor, f_s: float, b_s: float,
                log: SleepLog | None = None) -> torch.Tensor:
        _sleep(log, "F", f_s)
        ctx.save_for_backward(x, scale)
        ctx.b_s, ctx.log = b_s, log
        return x * scale

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        _sleep(ctx.log, "B", ctx.b_s)
        x, scale = ctx.saved_tensors
        return g * scale, (g * x).sum().reshape(scale.shape), None, None, None


class SleepPath(torch.autograd.Function):
    """Identity that sleeps `f_s` in forward and `b_s` (logged as `op`) in backward: one path of a
    split backward (the activation path: B; the weight path: W)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, f_s: float, b_s: float, op: str, log: SleepLog | None) -> torch.Tensor:
        _sleep(log, "F", f_s)
        ctx.b_s, ctx.op, ctx.log = b_s, op, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        _sleep(ctx.log, ctx.op, ctx.b_s)
        return g, None, None, None, None


class EmulatedStage(nn.Module):
    """One pipeline stage of the emulated model.

    Input: token ids (b, T) on the first stage, activations (b, T, hidden) elsewhere.
    Output: logits (b, T, vocab) on the last stage, activations (b, T, hidden) elsewhere.
    `b_s` is the whole backward, or with `w_s > 0` its input-gradient share (B) beside the weight
    share `w_s` (W).
    """

    def __init__(self, first: bool, last: bool, vocab: int, hidden: int, f_s: float, b_s: float,
                 seed: int, *, w_s: float = 0.0, log: SleepLog | None = None) -> None:
        super().__init__()
        self.first, self.last, self.f_s, self.b_s, self.w_s, self.log = first, last, f_s, b_s, w_s, log
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(vocab, hidden, generator=g)) if first else None
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(1, generator=g))
        self.proj = nn.Parameter(torch.randn(vocab, hidden, generator=g) / hidden**0.5) if last else None
        self._defer: Hashable | None = None  # key of the next forward whose W our runtime defers
        self._deferred: dict[Hashable, list] = {}  # key -> [stage activation h, gradient of h * scale]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.embedding(x, self.embed) if self.first else x  # (b, T, hidden)
        if self.w_s <= 0:
            h = SleepScale.apply(h, self.scale, self.f_s, self.b_s, self.log)
        else:
            h = SleepPath.apply(h, self.f_s, self.b_s, "B", self.log)
            key, self._defer = self._defer, None
            if key is None:  # full backward, or torch's graph-based split: W is the path to `scale`
                h = h * SleepPath.apply(self.scale, 0.0, self.w_s, "W", self.log)
            else:  # our runtime's split: keep `scale` out of B's graph, weight_grad(key) is its W
                entry: list = [h.detach(), None]
                self._deferred[key] = entry
                h = h * self.scale.detach()
                h.register_hook(_keep(entry))
        return F.linear(h, self.proj) if self.last else h  # (b, T, vocab) | (b, T, hidden)

    # The WeightGradDeferral hooks (split_backward.py).
    def defer_weight_grad(self, key: Hashable) -> None:
        if self.w_s > 0:
            self._defer = key

    def weight_grad(self, key: Hashable) -> None:
        if key not in self._deferred:
            return
        h, g = self._deferred.pop(key)
        assert g is not None, "W before its B: the output gradient was never computed"
        _sleep(self.log, "W", self.w_s)
        d = (g * h).sum().reshape(self.scale.shape)
        self.scale.grad = d if self.scale.grad is None else self.scale.grad + d


def _keep(entry: list) -> Callable[[torch.Tensor], None]:
    def hook(g: torch.Tensor) -> None:
        entry[1] = g

    return hook


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


class _Mark(torch.autograd.Function):
    """Identity whose backward calls `event` on the timer: marks where a stage's backward begins (on
    its output) and where it ends (on its input)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, timer: BusyTimer, event: str) -> torch.Tensor:
        ctx.timer, ctx.event = timer, event
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        getattr(ctx.timer, ctx.event)()
        return g, None, None


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
            x = _Mark.apply(x, t, "backward_event")
        y = self.inner(x)
        if y.requires_grad:
            y = _Mark.apply(y, t, "backward_begins")
        t.busy += time.perf_counter() - t0
        return y
