"""The trainer's resilience session: one object that train() holds for a run, owning the watchdog, the
SIGTERM handler, checkpoint saving (synchronous or asynchronous) and the sample ledger, and firing the fault
injector its caller gives it (testing mode, emulate/faults.py; none by default).

The sample ledger records which steps' samples have been applied to the model, as runs of step numbers
(`[[0, 40], [40, 57]]`), carried in each checkpoint's trainer state and restored with it — so after any
number of restarts the final record says exactly which samples the surviving model saw: a step missing is
lost samples, a step listed twice is samples applied twice. Events (start, resumed, first step of an
attempt) go to `<run_dir>/resilience.jsonl` (rank 0) with wall times, for the chaos benchmark.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from hybridpar.config import Config
from hybridpar.resilience.async_save import AsyncCheckpointer
from hybridpar.resilience.checkpoint import save_checkpoint
from hybridpar.resilience.preempt import Preemption
from hybridpar.resilience.probe import FaultHook, Probe
from hybridpar.resilience.watchdog import start_watchdog
from hybridpar.topology.collectives import all_gather_json
from hybridpar.topology.mesh import Topology


def add_step(runs: list[list[int]], step: int) -> list[list[int]]:
    """Record `step` as applied: extend the last run [lo, hi) if it ends at `step`, else start a new one."""
    if runs and runs[-1][1] == step:
        runs[-1][1] = step + 1
    else:
        runs.append([step, step + 1])
    return runs


def ledger_stats(runs: list[list[int]], steps: int, global_batch: int) -> dict[str, int]:
    """Samples lost (steps in [0, steps) never applied) and duplicated (applied more than once)."""
    seen: dict[int, int] = {}
    for lo, hi in runs:
        for s in range(lo, hi):
            seen[s] = seen.get(s, 0) + 1
    lost = sum(1 for s in range(steps) if s not in seen)
    dup = sum(n - 1 for n in seen.values()) + sum(1 for s in seen if s >= steps)
    return {"lost_samples": lost * global_batch, "duplicated_samples": dup * global_batch}


class Session:
    def __init__(
        self,
        cfg: Config,
        topo: Topology,
        ck_dir: Path,
        restart_count: int = 0,
        run_id: str | None = None,
        owner_check: Callable[[], str | None] = lambda: None,
        injector: FaultHook | None = None,
    ) -> None:
        """`run_id` goes into every checkpoint; `owner_check()` is asked before each commit whether this
        run still owns its directory (resilience/rundir.py); `injector` is fired at every phase the probe
        hears (the fault-injection testing mode; the run entry makes it, emulate/attach.py)."""
        self.cfg, self.topo, self.ck_dir = cfg, topo, ck_dir
        self.run_id, self.owner_check = run_id, owner_check
        self.run_dir = Path(cfg.run_dir)
        self.applied: list[list[int]] = []
        # One id per run attempt, agreed by every rank: the watchdog's keys never meet an earlier attempt's.
        run_id = all_gather_json(secrets.token_hex(6) if topo.rank == 0 else None, topo.device)[0]
        master = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
        watchdog = None
        if master[0] and master[1]:  # where torchrun / the spawn helper host the store
            watchdog = start_watchdog(
                topo.rank, topo.dims.world_size, run_id, cfg.resilience, self.run_dir, (master[0], int(master[1]))
            )
        # Attached to the trainer's pieces by the caller (train.py), who re-attaches it when they change.
        self.probe = Probe(watchdog, injector)
        # Installed when the step loop starts (`resumed`): SIGTERM during setup keeps its default action, so
        # the agent can stop a worker group that never got going without waiting out its grace period.
        self.preemption = Preemption()
        self.writer = AsyncCheckpointer(topo, cfg.parallel.timeout_s) if cfg.checkpoint.async_save else None
        self._first_step_logged = False
        d = topo.dims  # the mesh this start runs (an elastic restart may change it): the report shows it
        self.event("start", restart=restart_count, world=d.world_size, mesh=dict(tp=d.tp, cp=d.cp, pp=d.pp, dp=d.dp))

    def event(self, name: str, **fields: Any) -> None:
        if self.topo.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with (self.run_dir / "resilience.jsonl").open("a", encoding="utf-8") as fh:
                fh.write(json.dumps({"event": name, "time": time.time(), **fields}) + "\n")

    def resumed(self, saved: dict[str, Any] | None) -> None:
        """Called once setup (and resume) is done, before the first step."""
        self.preemption.install()
        if saved is not None:
            self.applied = [list(r) for r in saved.get("samples", {}).get("applied", [[0, saved["step"]]])]
            self.event("resumed", step=saved["step"])

    def step_done(self, step: int) -> None:
        add_step(self.applied, step)
        self.probe("step-end", step)
        if not self._first_step_logged:
            self._first_step_logged = True
            self.event("first_step", step=step)

    def state(self, base: dict[str, Any]) -> dict[str, Any]:
        return {
            **base,
            "run_id": self.run_id,
            "samples": {"applied": [list(r) for r in self.applied], "global_batch": self.cfg.train.global_batch},
        }

    def save(
        self,
        step: int,
        stages: dict[int, nn.Module],
        opt: Optimizer,
        trainer_state: dict[str, Any],
        wait: bool = False,
    ) -> None:
        """Checkpoint `stages` and `opt` after `step` steps (async if configured; `wait` makes it durable
        before returning)."""
        ck = self.cfg.checkpoint
        state = self.state(trainer_state)
        t0 = time.perf_counter()
        if self.writer is not None:
            at = self.probe.step  # the background write's phases belong to this step, however far training gets
            self.writer.save(
                stages,
                opt,
                self.ck_dir,
                step,
                state,
                ck.keep,
                lambda phase: self.probe.inject(phase, at),
                self.owner_check,
            )
            if wait:
                self.writer.wait()
        else:
            save_checkpoint(self.topo, stages, opt, self.ck_dir, step, state, ck.keep, self.probe, self.owner_check)
        # Seconds the training loop stood still for this save (async: the snapshot, plus waiting for the
        # previous write if it was still running).
        self.event(
            "checkpoint",
            step=step,
            mode="async" if self.writer else "sync",
            stall_s=time.perf_counter() - t0,
            last_write_s=self.writer.write_s[-1] if self.writer and self.writer.write_s else None,
        )

    def should_stop(self) -> bool:
        """Collective, after each step: did any rank get SIGTERM?"""
        return self.preemption.agreed(self.topo.device)

    def close(self, ok: bool = True) -> None:
        """Stop the watchdog and restore SIGTERM; when `ok`, first wait (collectively) for a checkpoint in
        flight. After a failure nothing collective is attempted: the peers may be gone."""
        try:
            if ok and self.writer is not None:
                self.writer.wait()
                dist.barrier()
        finally:
            self.probe.stop(finished=ok)
            self.preemption.uninstall()
