"""`--profile.steps 5-7`: torch.profiler over those steps on every rank, one Chrome trace per rank
(`<run_dir>/profile/rank<r>.json`, open it at ui.perfetto.dev). While it runs, the pipeline runtime names
each action as a `record_function` range (`F0.1`, `SEND_B1.3`, ... as in --trace), so the operators sit
under the schedule's actions; outside the profiled steps the runtime adds nothing.

`--profile.memory` (CUDA): over the same steps the caching allocator records every allocation and free
with its stack, and each rank writes the snapshot as JSON (`profile/memory_rank<r>.json`: the dict
`torch.cuda.memory._snapshot()` returns — segments, blocks, per-device traces). JSON and not torch's own
pickle dump, because no file a run writes may run code when read back.

`ProfileDuty` is the training loop's duty (trainer/duty.py): the profiler around the steps asked for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from hybridpar.config import step_range
from hybridpar.pipeline.runtime import PipelineRuntime
from hybridpar.report.step_trace import StepView

PROFILE_DIR = "profile"
MEMORY_EVENTS = 200_000  # allocator events kept (a ring): a few steps of a large model fit


class StepProfiler:
    def __init__(self, steps: range, run_dir: Path, rank: int, device: torch.device, memory: bool = False) -> None:
        assert len(steps) > 0, "profile no steps: build no profiler"
        assert not memory or device.type == "cuda", "preflight refuses profile.memory off CUDA"
        self.steps, self.rank, self.memory = steps, rank, memory
        self.path = run_dir / PROFILE_DIR / f"rank{rank}.json"
        self.memory_path = run_dir / PROFILE_DIR / f"memory_rank{rank}.json"
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._prof: profile | None = None

    def before(self, step: int, runtime: PipelineRuntime) -> None:
        if self._prof is None and step in self.steps:  # the first step of the range (or of a resume inside it)
            self._prof = profile(activities=self.activities)
            self._prof.__enter__()
            if self.memory:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)
        runtime.profiling = self._prof is not None

    def after(self, step: int, runtime: PipelineRuntime) -> None:
        """After the step: at the range's last step, stop and write this rank's trace."""
        if self._prof is not None and step == self.steps[-1]:
            self._prof.__exit__(None, None, None)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._prof.export_chrome_trace(str(self.path))
            self._prof = None
            if self.memory:
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                self.memory_path.write_text(json.dumps(snap, default=str), encoding="utf-8")
            runtime.profiling = False


class ProfileDuty:
    """Every rank: the profiler started before and stopped after the steps of --profile.steps (none: no
    profiler at all). The runtime is read from the trainer at each step: a layout change may rebuild it."""

    def __init__(self, trainer: StepView) -> None:
        cfg, topo = trainer.cfg, trainer.topo
        steps = step_range(cfg.profile.steps)
        self.trainer = trainer
        self.profiler = (
            StepProfiler(steps, Path(cfg.run_dir), topo.rank, topo.device, cfg.profile.memory) if steps else None
        )

    def begin(self, step: int) -> None:
        if self.profiler:
            self.profiler.before(step, self.trainer.runtime)

    def after_step(self, step: int, rec: dict[str, Any]) -> bool:
        if self.profiler:
            self.profiler.after(step, self.trainer.runtime)
        return False

    def finish(self) -> None:
        pass
