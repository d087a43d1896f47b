"""The training loop's duties: everything run/train.py does around the trainer's steps besides the step
itself — records, reports, validation, checkpoints, the final model — is one small object with three
hooks, kept in the folder that owns the job (report/, balance/, resilience/, trainer/).

The loop nests its duties around each step like with-blocks, the first of its list innermost: `begin`
runs from the last duty to the first, `after_step` and `finish` from the first to the last. So the
profiler sits closest to the step, a record is complete (records, monitor, validation) before the duty
that writes it sees it, and checkpoints follow the written record. A duty may add fields to the step's
record for the duties after it.

A duty that returns True from `after_step` ends the run after that step (preemption): the duties after
it see no more of the step, and no duty finishes — the one that stopped the run closes what it must.

Implementers need not import this module (the protocol is structural): duties in report/ stay off the
trainer's imports, which `hybridpar report` and the launcher do not need.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

from hybridpar.config import Config

if TYPE_CHECKING:
    from hybridpar.resilience.probe import Probe
    from hybridpar.trainer.step import Trainer


class StepDuty(Protocol):
    def begin(self, step: int) -> None:
        """Before step `step` runs."""

    def after_step(self, step: int, rec: dict[str, Any]) -> bool:
        """After step `step`, with its record (metrics.jsonl's line, still open to additions). True: stop
        the run here."""

    def finish(self) -> None:
        """After the run's last step (not after a stop)."""


class LossDuty:
    """Each step's loss, kept for train()'s caller; a loss that is not finite fails the run before the
    step counts as applied (a permanent failure: a restart from the same checkpoint would repeat it)."""

    def __init__(self, cfg: Config, losses: list[float]) -> None:
        self.lr, self.losses = cfg.train.lr, losses

    def begin(self, step: int) -> None:
        pass

    def after_step(self, step: int, rec: dict[str, Any]) -> bool:
        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(f"loss became {rec['loss']} at step {step}: lower train.lr (now {self.lr})")
        self.losses.append(rec["loss"])
        return False

    def finish(self) -> None:
        pass


class ValidationDuty:
    """Collective: the validation loss every train.val_every steps, after the first and after the last,
    into the step's record (so it is written with it) and into `val_losses` as (step, loss)."""

    def __init__(self, trainer: Trainer, probe: Probe, val_losses: list[tuple[int, float]]) -> None:
        self.trainer, self.probe, self.val_losses = trainer, probe, val_losses
        self.every, self.last = trainer.cfg.train.val_every, trainer.cfg.train.steps - 1

    def begin(self, step: int) -> None:
        pass

    def after_step(self, step: int, rec: dict[str, Any]) -> bool:
        if self.every and ((step + 1) % self.every == 0 or step == 0 or step == self.last):
            with self.probe.slow("validate"):  # the watchdog allows validation its slow-phase timeout
                rec["val_loss"] = self.trainer.evaluate()
                if sources := self.trainer.val_sources:  # a mixture: each source's own loss too
                    rec["val_loss_by_source"] = {n: self.trainer.evaluate(v) for n, v in sources.items()}
            self.val_losses.append((step, rec["val_loss"]))
        return False

    def finish(self) -> None:
        pass
