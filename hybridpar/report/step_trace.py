"""Measured pipeline traces: the runtime's per-action timeline of a few steps, from every rank, as one
Chrome/Perfetto trace (one track per rank; compute, message posting and waits as separate slices), so a
user can set the schedule they ran beside the one the simulator predicts.

Each rank writes its slices to `<file>.parts/rank<r>.json`; rank 0 merges them after a barrier. The
ranks' clocks are `time.perf_counter` (CLOCK_MONOTONIC), comparable between processes of one machine.
`TraceDuty` collects and writes them as a duty of the training loop (trainer/duty.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Protocol

import torch.distributed as dist

from hybridpar.config import Config, step_range
from hybridpar.pipeline.runtime import PipelineRuntime, StepOutput
from hybridpar.pipeline.schedules import Op
from hybridpar.pipeline.trace import Slice, chrome_trace, write_trace
from hybridpar.topology.mesh import Topology


class StepView(Protocol):
    """What the report's duties read of the trainer (trainer/step.py's `Trainer` has it). A protocol, so
    that report/ stays a layer below the trainer that it reports on."""

    cfg: Config
    topo: Topology
    runtime: PipelineRuntime
    last_output: StepOutput


_COMPUTE = {Op.FORWARD, Op.BACKWARD, Op.WEIGHT}


def step_slices(out: StepOutput, rank: int, step: int) -> list[dict]:
    rows = []
    for t in out.timeline:
        cat = "compute" if t.action.op in _COMPUTE else "comm"
        rows.append(
            {
                "track": rank,
                "name": str(t.action),
                "start_s": t.start,
                "end_s": t.end,
                "cat": cat,
                "args": {"step": step},
            }
        )
    for w in out.waits:
        rows.append(
            {
                "track": rank,
                "name": f"wait {w.action}",
                "start_s": w.start,
                "end_s": w.end,
                "cat": "wait",
                "args": {"step": step},
            }
        )
    return rows


def write_run_trace(path: str, rank: int, world: int, rows: list[dict], barrier: Callable[[], None]) -> None:
    parts = Path(path + ".parts")
    parts.mkdir(parents=True, exist_ok=True)
    (parts / f"rank{rank}.json").write_text(json.dumps(rows))
    barrier()
    if rank == 0:
        slices = [Slice(**r) for p in sorted(parts.glob("rank*.json")) for r in json.loads(p.read_text())]
        write_trace(chrome_trace(slices, process_name="measured"), path)
        shutil.rmtree(parts, ignore_errors=True)


class TraceDuty:
    """Every rank, with --trace FILE: the slices of the steps of profile.trace_steps, kept in memory and
    written at the end (collective: rank 0 merges every rank's file after a barrier)."""

    def __init__(self, trainer: StepView) -> None:
        cfg = trainer.cfg
        self.trainer, self.path, self.steps = trainer, cfg.trace, step_range(cfg.profile.trace_steps)
        self.rows: list[dict] = []

    def begin(self, step: int) -> None:
        pass

    def after_step(self, step: int, rec: dict[str, Any]) -> bool:
        if self.path and step in self.steps:
            self.rows += step_slices(self.trainer.last_output, self.trainer.topo.rank, step)
        return False

    def finish(self) -> None:
        if self.path:
            topo = self.trainer.topo
            write_run_trace(self.path, topo.rank, topo.dims.world_size, self.rows, dist.barrier)
