"""Where step records go besides `metrics.jsonl`, which stays the canonical record: TensorBoard event
files under `<run_dir>/tb` (`sinks.tensorboard`, on by default when the package is installed) and
Weights & Biases (`sinks.wandb`, off unless asked; the package is imported only then). Rank 0 only.

Scalars are written in double precision (TensorBoard's tensor summaries, not the float32 `simple_value`),
so what TensorBoard's reader returns equals metrics.jsonl exactly. A resumed run drops TensorBoard's
events from its restart step on, as metrics.jsonl is cut back (report/metrics.py)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Protocol

from hybridpar.config import SinksConfig

TB_DIR = "tb"
# Step-record fields written as scalars (tag = field); per-rank lists become "ranks/<field>/<rank>".
SCALARS = ("loss", "val_loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu", "bubble")
RANK_FIELDS = ("compute_s", "wait_s", "comm_s")


class Sink(Protocol):
    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars_of(rec: dict[str, Any]) -> dict[str, float]:
    """The scalars a step record carries (None and missing fields left out)."""
    out = {k: float(rec[k]) for k in SCALARS if isinstance(rec.get(k), (int, float))}
    for f in RANK_FIELDS:
        for r, v in enumerate((rec.get("ranks") or {}).get(f, [])):
            out[f"ranks/{f}/{r}"] = float(v)
    return out


def missing_packages(cfg: SinksConfig) -> str | None:
    """Why the asked sinks cannot run here (a package missing), or None."""
    if cfg.tensorboard == "on" and importlib.util.find_spec("tensorboard") is None:
        return (
            "sinks.tensorboard=on needs the tensorboard package: pip install 'hybridpar[tensorboard]', "
            "or set sinks.tensorboard to auto or off"
        )
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        return "sinks.wandb=true needs the wandb package: pip install wandb, or leave sinks.wandb off"
    return None


class TensorBoard:
    def __init__(self, run_dir: Path, resume_step: int) -> None:
        """Event files under `<run_dir>/tb` holding the steps before `resume_step` (none on a fresh start)."""
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from torch.utils.tensorboard.writer import FileWriter  # needs the tensorboard package

        tb = run_dir / TB_DIR
        old = sorted(tb.glob("events.out.tfevents.*")) if tb.is_dir() else []
        # The queue holds a few steps' events; the writer's thread flushes them periodically.
        self._file = FileWriter(str(tb), max_queue=64)
        # TensorBoard's readers do not purge tensor summaries at a restart marker, so a resumed run copies
        # the steps before its restart step into its own file and then drops the old files, as
        # metrics.jsonl is cut back. A crash in between leaves duplicates of equal values, never a gap.
        for path in old:
            for event in EventFileLoader(str(path)).Load():  # protobuf records: reading runs no code
                if event.HasField("summary") and event.step < resume_step:
                    self._file.add_event(event)
        self._file.flush()
        for path in old:
            path.unlink()

    def write(self, step: int, scalars: dict[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import scalar

        # One event per step holding every value, not one per scalar: with ~20 scalars a step, per-scalar
        # events filled the writer's queue every step and each put then waited for its thread (2.8 ms a
        # step on 2 cores, against 0.5 ms so).
        values = [v for tag, x in scalars.items() for v in scalar(tag, x, new_style=True, double_precision=True).value]
        self._file.add_summary(Summary(value=values), step)

    def close(self) -> None:
        self._file.close()


class WandB:
    def __init__(self, project: str, run_dir: Path, run_id: str) -> None:
        wandb = importlib.import_module("wandb")
        # The run id keeps a restarted attempt in the same W&B run.
        self._run = wandb.init(project=project, dir=str(run_dir), id=run_id, resume="allow")

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


def open_sinks(cfg: SinksConfig, run_dir: Path, resume_step: int, run_id: str) -> list[Sink]:
    if (why := missing_packages(cfg)) is not None:
        raise ValueError(why)
    sinks: list[Sink] = []
    if cfg.tensorboard == "on" or (cfg.tensorboard == "auto" and importlib.util.find_spec("tensorboard")):
        sinks.append(TensorBoard(run_dir, resume_step))
    if cfg.wandb:
        sinks.append(WandB(cfg.wandb_project, run_dir, run_id))
    return sinks
