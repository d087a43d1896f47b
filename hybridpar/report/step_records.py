"""What the run loop adds to each step's record beyond the trainer's own: MFU against the devices' peak
(report/mfu.py), the attempt (restart count) the step ran in, the peak itself on the attempt's first
record, and once per attempt every rank's action timeline of one step (`<run_dir>/step_timeline.json`),
which `hybridpar report` draws as the per-rank timeline. `RecordsDuty` does both as a duty of the
training loop (trainer/duty.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hybridpar.config import Config
from hybridpar.pipeline.runtime import StepOutput
from hybridpar.report.mfu import device_peak, mfu, model_flops_per_token
from hybridpar.report.rundata import TIMELINE_FILE
from hybridpar.report.step_trace import StepView, step_slices
from hybridpar.resilience.rundir import write_text_atomic
from hybridpar.topology.collectives import all_gather_json
from hybridpar.topology.mesh import Topology

WARMUP_STEPS = 2  # the timeline step comes after these: the first steps allocate and initialise lazily


class StepRecords:
    def __init__(self, cfg: Config, topo: Topology, start_step: int, attempt: int, dtype: torch.dtype) -> None:
        """Collective (the device peak is agreed by every rank). `dtype`: what the matmuls compute in."""
        self.topo, self.run_dir, self.attempt = topo, Path(cfg.run_dir), attempt
        t = cfg.train
        self.tokens = t.global_batch * t.seq_len
        self.flops_per_token = model_flops_per_token(cfg.model, t.seq_len)
        self.details = cfg.sinks.step_details
        probe = cfg.sinks.peak_probe_s
        self.peak = device_peak(topo.device, dtype, self.run_dir, topo.rank, probe) if self.details else None
        self.first = True
        # -1: never (no details asked for)
        self.timeline_step = min(start_step + WARMUP_STEPS, t.steps - 1) if self.details else -1

    def add(self, rec: dict[str, Any]) -> dict[str, Any]:
        """`rec` (the trainer's record of one step) with MFU and the attempt added."""
        rec["attempt"] = self.attempt
        if self.peak is None:
            return rec
        rec["mfu"] = mfu(self.flops_per_token, self.tokens, rec["step_time_s"], self.peak["flops_per_s"])
        if self.first:
            rec["device_peak"] = self.peak
            rec["model_flops_per_token"] = self.flops_per_token
            self.first = False
        return rec

    def timeline(self, step: int, out: StepOutput) -> None:
        """Collective at the timeline step (a no-op at any other): every rank's slices to rank 0's file."""
        if step != self.timeline_step:
            return
        rows = all_gather_json(step_slices(out, self.topo.rank, step), self.topo.device)
        if self.topo.rank == 0:
            doc = {"step": step, "attempt": self.attempt, "slices": [r for rank in rows for r in rank]}
            write_text_atomic(self.run_dir / TIMELINE_FILE, json.dumps(doc))  # a kill mid-write: the old file stays


class RecordsDuty:
    """Every rank (collective at set-up and at the timeline step): MFU and the attempt added to each step's
    record, and the timeline of one step written."""

    def __init__(self, trainer: StepView, start_step: int, attempt: int) -> None:
        dtype = torch.bfloat16 if trainer.cfg.train.precision == "bf16" else torch.float32
        self.trainer = trainer
        self.records = StepRecords(trainer.cfg, trainer.topo, start_step, attempt, dtype)

    def begin(self, step: int) -> None:
        pass

    def after_step(self, step: int, rec: dict[str, Any]) -> bool:
        self.records.add(rec)
        self.records.timeline(step, self.trainer.last_output)
        return False

    def finish(self) -> None:
        pass
