"""Stage modules for the pipeline benchmark: emulated stages (fixed compute durations, real tensors on
the wire) and, for compute mode, one busy-time instrumentation applied identically to every stage
module, ours or torch's (`Timed`).

Emulation is labelled (see DESIGN.md): a stage's forward and backward last fixed durations, their few
tensor operations done inside the window and the rest of it slept, so that 4 ranks on 2 cores do
not contend for the CPU and the measured step time is the schedule's own (bubble + communication +
runtime overhead), not the machine's. A window ends on time: it sleeps to `TAIL_S` before its end
and works the rest out on the CPU, by default with tiny autograd work that leaves the caches as real
compute would (`sleep_until`, `TAILS`). On the last stage the loss runs inside the windows too
(`loss_in_window`, `windowed_loss`): both runtimes get the same loss function. Every window is logged
(`SleepLog`: requested vs. actual seconds): the emulated ranks' busy time is the windows' actual
length, and the overshoot is one of the measured per-action costs the simulator is fed with
(latency.py).

Split backward (zero-bubble schedules): with `w_s > 0` a stage's backward is two windows, `b_s` on the
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

from hybridpar.pipeline.runtime import LossFn


class SleepLog:
    """The emulated compute of one rank: every compute window as (op "F" | "B" | "W", requested s,
    start, end), times from `time.perf_counter` (comparable with the runtime's timeline)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, float, float, float]] = []

    def clear(self) -> None:
        self.entries.clear()

    def busy_s(self) -> float:
        return sum(end - start for _, _, start, end in self.entries)


# time.sleep wakes up late here, by 0.17-0.19 ms at the median and up to 0.8 ms (the VM's timer
# wake-up), which would lengthen every "fixed" window. So a window sleeps until this much before its
# end and works the rest out on the CPU (its tail).
TAIL_S = 0.001

# What a window's tail runs. "autograd" (default): tiny autograd forwards and backwards, as the end
# of a real stage computation would. A process that slept leaves the runtime's code paths cold on
# this VM: a small op and its backward take 62 us warm, 340-550 us right after a 20 ms sleep, ~270 us
# after a 20 ms Python spin, but 84-89 us after 20 ms of real Linear forward+backward and ~120-150 us
# after a sleep whose last ms ran tiny backwards. So with that tail the runtime's work after a window
# (its sends, the next action) runs as warm as after real compute, for both runtimes alike (measured,
# 20/40 ms pp=2: per-action overhead F/B 253/678 -> 161/375 us). "spin": a bare busy-wait.
TAILS = ("autograd", "spin")


def sleep_until(deadline: float, tail: str = "autograd") -> None:
    """Return at `deadline` (time.perf_counter): sleep, then run the tail up to it. The first tail
    iteration after the sleep runs cold and may end the window some tens of us late (SleepLog has it)."""
    left = deadline - TAIL_S - time.perf_counter()
    if left > 0:
        time.sleep(left)
    if tail == "spin":
        while time.perf_counter() < deadline:
            pass
        return
    w = torch.ones(8, requires_grad=True)
    with torch.enable_grad():
        while time.perf_counter() < deadline:
            # autograd.grad, not backward: it touches no .grad, and runs inside a running backward.
            torch.autograd.grad((w * 2.0).sum(), w)


class Clock:
    """Closes one rank's compute windows on time (`tail`: see TAILS) and logs them into `log`."""

    def __init__(self, log: SleepLog | None = None, tail: str = "autograd") -> None:
        if tail not in TAILS:
            raise ValueError(f"window tail must be one of {TAILS}, got {tail!r}")
        self.log, self.tail = log, tail

    def until(self, op: str, seconds: float, start: float) -> None:
        """Close the window of `seconds` opened at `start`: sleep for what is left of it."""
        if seconds <= 0:
            return
        sleep_until(start + seconds, self.tail)
        if self.log is not None:
            self.log.entries.append((op, seconds, start, time.perf_counter()))


class _Window:
    """The open backward window of one forward call: set when the gradient reaches the stage output."""

    __slots__ = ("start", "closed")

    def __init__(self) -> None:
        self.start, self.closed = 0.0, False


class WindowClose(torch.autograd.Function):
    """On the stage output: the backward window opens when the gradient reaches it. (The forward
    window closes after this node is built, in the stage's forward: building an autograd node right
    after a sleep costs ~0.14 ms of cold caches here, and that is emulation work, not the runtime's.)"""

    @staticmethod
    def forward(ctx, y: torch.Tensor, win: _Window) -> torch.Tensor:
        ctx.win = win
        # A copy, not a view: torch's split backward (stage_backward_input) detaches every stage
        # output in place, which a view does not allow. It runs inside the window.
        return y.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.win.start = time.perf_counter()
        return g, None


class WindowOpen(torch.autograd.Function):
    """On the stage input (after the embedding on the first stage): the last backward node of the
    activation path, where the backward window of `b_s` closes (logged as `op`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, win: _Window, b_s: float, op: str, clock: Clock) -> torch.Tensor:
        ctx.win, ctx.b_s, ctx.op, ctx.clock = win, b_s, op, clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        ctx.clock.until(ctx.op, ctx.b_s, ctx.win.start)
        ctx.win.closed = True
        return g, None, None, None, None


class WeightPath(torch.autograd.Function):
    """Identity on the stage's weight whose backward is a window of `w_s` (W). Run inside a full
    backward before the activation path's window closed, it moves that window's start later by its own
    length, so that the whole backward lasts b_s + w_s whichever order autograd runs the two paths in."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, win: _Window, w_s: float, clock: Clock) -> torch.Tensor:
        ctx.win, ctx.w_s, ctx.clock = win, w_s, clock
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        t0 = time.perf_counter()
        ctx.clock.until("W", ctx.w_s, t0)
        if not ctx.win.closed:
            ctx.win.start += time.perf_counter() - t0
        return g, None, None, None


class EmulatedStage(nn.Module):
    """One pipeline stage of the emulated model.

    Input: token ids (b, T) on the first stage, activations (b, T, hidden) elsewhere.
    Output: logits (b, T, vocab) on the last stage, activations (b, T, hidden) elsewhere.
    The forward lasts `f_s` and the backward `b_s` (or, with `w_s > 0`, `b_s` for its input-gradient
    share B beside `w_s` for the weight share W), the stage's few tensor operations included: they run
    inside these windows, which sleep for what is left. Sleeping first and computing after would add the
    tensor work's time to every window, and on a shared VM that time is not small: the first tensor
    operations after a sleep of tens of milliseconds run on cold caches (measured here: an op that takes
    7 us warm takes ~185 us after a 20 ms sleep), so the "fixed" durations would not be fixed.

    With `loss_in_window` (last stage only) the forward window stays open until `close_window(loss)`
    closes it on the loss, so that the loss, part of the last stage's compute in any pipeline, runs
    inside the F window and its backward inside the B window (see `windowed_loss`).
    """

    def __init__(
        self,
        first: bool,
        last: bool,
        vocab: int,
        hidden: int,
        f_s: float,
        b_s: float,
        seed: int,
        *,
        w_s: float = 0.0,
        log: SleepLog | None = None,
        loss_in_window: bool = False,
        tail: str = "autograd",
    ) -> None:
        super().__init__()
        if loss_in_window and not last:
            raise ValueError("loss_in_window is for the last stage, the one whose output is the loss's input")
        self.first, self.last, self.f_s, self.b_s, self.w_s = first, last, f_s, b_s, w_s
        self.clock = Clock(log, tail)
        self.loss_in_window = loss_in_window
        self._open: tuple[_Window, float] | None = None  # loss_in_window: the latest forward's window
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(vocab, hidden, generator=g)) if first else None
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(1, generator=g))
        self.proj = nn.Parameter(torch.randn(vocab, hidden, generator=g) / hidden**0.5) if last else None
        self._defer: Hashable | None = None  # key of the next forward whose W our runtime defers
        self._deferred: dict[Hashable, list] = {}  # key -> [stage activation h, gradient of h * scale]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start, win = time.perf_counter(), _Window()
        h = F.embedding(x, self.embed) if self.first else x  # (b, T, hidden)
        h = WindowOpen.apply(h, win, self.b_s, "B", self.clock)
        if self.w_s <= 0:
            h = h * self.scale
        else:
            key, self._defer = self._defer, None
            if key is None:  # full backward, or torch's graph-based split: W is the path to `scale`
                h = h * WeightPath.apply(self.scale, win, self.w_s, self.clock)
            else:  # our runtime's split: keep `scale` out of B's graph, weight_grad(key) is its W
                entry: list = [h.detach(), None]
                self._deferred[key] = entry
                h = h * self.scale.detach()
                h.register_hook(_keep(entry))
        y = F.linear(h, self.proj) if self.last else h  # (b, T, vocab) | (b, T, hidden)
        if self.loss_in_window:
            self._open = (win, start)
            return y
        return self._close(y, win, start)

    def _close(self, y: torch.Tensor, win: _Window, start: float) -> torch.Tensor:
        y = WindowClose.apply(y, win)
        self.clock.until("F", self.f_s, start)
        return y

    def close_window(self, loss: torch.Tensor) -> torch.Tensor:
        """loss_in_window: close the latest forward's window on its loss (both runtimes compute the
        loss right after the last stage's forward)."""
        if self._open is None:
            raise RuntimeError("close_window: no forward window is open (a loss without its forward?)")
        (win, start), self._open = self._open, None
        return self._close(loss, win, start)

    # The WeightGradDeferral hooks (split_backward.py).
    def defer_weight_grad(self, key: Hashable) -> None:
        if self.w_s > 0:
            self._defer = key

    def weight_grad(self, key: Hashable) -> None:
        if key not in self._deferred:
            return
        h, g = self._deferred.pop(key)
        assert g is not None, "W before its B: the output gradient was never computed"
        self.clock.until("W", self.w_s, time.perf_counter())
        d = (g * h).sum().reshape(self.scale.shape)
        self.scale.grad = d if self.scale.grad is None else self.scale.grad + d


def windowed_loss(stage: EmulatedStage, loss_fn: LossFn) -> LossFn:
    """loss_fn, computed inside the forward window of `stage` (built with loss_in_window)."""
    return lambda out, target, scale: stage.close_window(loss_fn(out, target, scale))


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
