"""Preemption: SIGTERM (what schedulers and torch's elastic agent send before killing) asks the run to stop
cleanly. The handler only sets a flag; after the step in flight completes, every rank agrees on the flag
(one all-reduce of a byte: any rank's SIGTERM stops them all at the same step), checkpoints and exits 0,
so that the elastic agent does not restart it; rank 0 records the preemption in run.json, from which the
launcher exits 143 (launcher.py). A second SIGTERM restores the default action, so a stuck run can still
be terminated."""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

import torch
import torch.distributed as dist


class Preemption:
    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def install(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread
            self._previous = signal.signal(signal.SIGTERM, self._on_term)
        return self

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # the second one: stop now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
            return
        self.requested = True
        print(
            "hybridpar: SIGTERM: finishing this step, then checkpointing and exiting (send again to stop now)",
            file=sys.stderr,
            flush=True,
        )

    def agreed(self, device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
        """Collective: True on every rank if any rank was asked to stop."""
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
