"""Asynchronous checkpoints (`--checkpoint.async_save true`): the step's tensors are copied synchronously
(`snapshot`: parameters and AdamW state cloned before the next step can touch them — so a checkpoint can
never hold values of a later step), then a background thread writes and commits them exactly as a
synchronous save does (fresh directory, DCP, barrier, manifest, rename), while training goes on.

The background thread talks over a gloo process group of its own (created once, collectively), so its
collectives never interleave with the training step's on the default group. At most one write is in
flight: the next save, preemption and the end of training first wait for it (`wait`), and a failure in
the background is raised there, on every rank. A kill during a write leaves only an uncommitted
`.tmp-step-*` directory, which resume ignores and the next commit prunes.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybridpar.resilience.checkpoint import as_dcp_state, snapshot, write_committed
from hybridpar.topology.mesh import Topology


class AsyncCheckpointer:
    def __init__(self, topo: Topology, timeout_s: float) -> None:
        self.topo = topo
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stall_s: list[float] = []  # main-thread seconds per save (snapshot + waiting for the previous)
        self.write_s: list[float] = []  # background seconds per save (write + commit)

    def save(
        self,
        stages: dict,
        opt: torch.optim.Optimizer,
        root: Path,
        step: int,
        trainer_state: dict[str, Any],
        keep: int,
        on_phase: Callable[[str], None] = lambda phase: None,
        owner_check: Callable[[], str | None] = lambda: None,
    ) -> None:
        t0 = time.perf_counter()
        self.wait()
        snap = snapshot(stages, opt)
        if self.topo.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # the copies are complete before the step goes on

        def write() -> None:
            t1 = time.perf_counter()
            try:
                state, index = as_dcp_state(self.topo, snap)
                write_committed(
                    self.topo,
                    state,
                    root,
                    step,
                    trainer_state,
                    keep,
                    on_phase,
                    self.group,
                    owner_check,
                    index,
                )
            except BaseException as e:  # re-raised on the main thread by wait()
                self._error = e
            self.write_s.append(time.perf_counter() - t1)

        self._thread = threading.Thread(target=write, name=f"hybridpar-ckpt-{step}", daemon=True)
        self._thread.start()
        self.stall_s.append(time.perf_counter() - t0)

    def wait(self) -> None:
        """Block until the write in flight (if any) is committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"asynchronous checkpoint failed: {err}") from err
