"""The trainer's phase probe: one call per phase change feeds the watchdog (progress, phase, step) and the
fault injector (testing mode, emulate/faults.py, given by the run entry). `install` attaches it to a
trainer's current pieces with hooks — module forward pre-hooks, wrappers on the P2P and gradient-reduction
objects, an optimizer step pre-hook — so the pipeline runtime and the layers below need no knowledge of it,
and returns the function that takes them off again: when a live rebalance replaces the gradient reduction
and the optimizer, the trainer detaches and installs on the new ones (`Trainer.attach`)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator, Protocol

from torch import nn
from torch.optim import Optimizer

from hybridpar.resilience.watchdog import Watchdog


class FaultHook(Protocol):
    """What the probe fires faults through: emulate/faults.py's `Injector` in the testing mode. A protocol,
    so that resilience needs no emulation code; without one (the default) no fault is ever fired."""

    before_fault: Callable[[], None]  # set by the probe: called just before a fault acts

    def check(self, phase: str, step: int) -> None: ...


class Probe:
    def __init__(self, watchdog: Watchdog | None = None, injector: FaultHook | None = None) -> None:
        self.watchdog, self.injector = watchdog, injector
        if watchdog is not None and injector is not None:
            injector.before_fault = watchdog.publish
        self.step = -1
        self._slow: str | None = None  # inside a slow section (validation): inner phases count as progress

    def __call__(self, phase: str, step: int | None = None) -> None:
        """Main thread: entering `phase` (of `step`, default the current one)."""
        if step is not None:
            self.step = step
        if self._slow is not None and phase == "forward":
            phase = self._slow
        if self.watchdog is not None:
            slow = self._slow is not None or phase.startswith("ckpt-")
            self.watchdog.mark(phase, self.step, slow=slow)
        self.inject(phase)

    def inject(self, phase: str, step: int | None = None) -> None:
        """Any thread: fire a fault planned for `phase` at `step` (default the current one); no watchdog mark."""
        if self.injector is not None:
            self.injector.check(phase, self.step if step is None else step)

    @contextlib.contextmanager
    def slow(self, phase: str) -> Iterator[None]:
        """A section that may take long while progressing (validation): watched with slow_phase_timeout_s."""
        self._slow = phase
        self(phase)
        try:
            yield
        finally:
            self._slow = None

    def stop(self, finished: bool = True) -> None:
        if self.watchdog is not None:
            self.watchdog.stop(finished)


def _wrap(obj: Any, name: str, probe: Probe, phase: str) -> Callable[[], None]:
    method = getattr(obj, name)

    @functools.wraps(method)
    def probed(*args: Any, **kwargs: Any) -> Any:
        probe(phase)
        return method(*args, **kwargs)

    setattr(obj, name, probed)  # on this instance only: deleting it uncovers the class's method
    return lambda: delattr(obj, name)


def install(probe: Probe, stages: Iterable[nn.Module], p2p: Any, grads: Any, opt: Optimizer) -> Callable[[], None]:
    """Attach `probe` to the stages (forward), P2P (p2p), gradient reduction (all-reduce) and optimizer;
    returns the function that detaches all of it."""
    handles = [stage.register_forward_pre_hook(lambda module, args: probe("forward")) for stage in stages]
    undo = [
        _wrap(p2p, "flush", probe, "p2p"),
        _wrap(p2p, "wait_recv", probe, "p2p"),
        _wrap(grads, "finish", probe, "all-reduce"),
    ]
    handles.append(opt.register_step_pre_hook(lambda opt, args, kwargs: probe("optimizer")))

    def detach() -> None:
        for h in handles:
            h.remove()
        for u in undo:
            u()

    return detach
