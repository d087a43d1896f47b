"""The resilience session in the training loop (duties, see trainer/duty.py): resuming before the first
step, each step marked for the watchdog, the fault injector and the sample ledger (`SessionDuty`), and
checkpoints with preemption (`CheckpointDuty`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hybridpar.balance.restore import recorded_layout
from hybridpar.config import Config
from hybridpar.model.optim import lr_at
from hybridpar.pipeline.schedules import stages_per_rank
from hybridpar.resilience import rundir
from hybridpar.resilience.checkpoint import resume
from hybridpar.resilience.session import Session
from hybridpar.topology.mesh import Topology

if TYPE_CHECKING:
    from hybridpar.report.metrics import MetricsDuty


class CheckpointedTrainer(Protocol):
    """What checkpoints and resume read and restore of the trainer (trainer/step.py's `Trainer` has it): a
    protocol, so that resilience/ stays a layer below the trainer."""

    cfg: Config
    topo: Topology
    stages: dict[int, torch.nn.Module]
    opt: Any  # the optimizer over this rank's stages (model/optim.py)
    parts: list[range]
    layout: Any  # the load balancer's layout (balance/repartition.py): every replica's partition and share
    plan: Any  # batching's per-replica microbatch plan: its sizes
    policy: Any  # the microbatch policy: its state_dict()


def trainer_state(cfg: Config, trainer: CheckpointedTrainer, done: int) -> dict:
    """What a checkpoint records besides tensors (JSON). The data cursor is `done` itself: sample order
    depends only on (seed, step)."""
    p = cfg.parallel
    return {
        "step": done,
        "config": cfg.to_dict(),
        "partition": [[r.start, r.stop] for r in trainer.parts],
        "batch_plan": [list(s) for s in trainer.plan.sizes],
        # Every replica's partition and batch share (the balancer's, if it moved any): a resumed run starts
        # from it where it still applies (balance/restore.py).
        "balance_layout": recorded_layout(trainer.layout, p.pp, p.dp, stages_per_rank(p)),
        "layout": {
            "tp": p.tp,
            "pp": p.pp,
            "dp": p.dp,
            "virtual_stages": stages_per_rank(p),
            "world_size": trainer.topo.dims.world_size,
        },
        "lr": {"last": lr_at(done - 1, cfg.train), "next": lr_at(done, cfg.train)},
        # The adaptive microbatch policy's measurements: a resumed run goes on from them instead of
        # scanning every split again (the same on every rank, see batching/policy.py).
        "batching_policy": trainer.policy.state_dict(),
    }


def resume_run(
    cfg: Config, trainer: CheckpointedTrainer, session: Session, logger: logging.Logger
) -> dict[str, Any] | None:
    """Collective: load the checkpoint checkpoint.resume names (if any) into the trainer, then start the
    session's step loop (its ledger, the SIGTERM handler). Returns the checkpoint's trainer state (None:
    not resumed); its "step" is the steps already done."""
    ck, topo = cfg.checkpoint, trainer.topo
    saved = None
    if ck.resume != "off":
        saved = resume(topo, trainer.stages, trainer.opt, ck.resume, session.ck_dir, cfg.to_dict(), session.run_id)
        if saved and saved.get("batching_policy"):
            try:
                trainer.policy.load_state_dict(saved["batching_policy"])
            except ValueError as e:  # another batch or schedule: measurements of other splits
                if topo.rank == 0:
                    logger.info(f"hybridpar: microbatch policy starts afresh: {e}")
    session.resumed(saved)
    return saved


class SessionDuty:
    """Every rank: the step's begin and end marked for the watchdog and the fault injector, and the step,
    once its loss proved finite (a duty before this one), entered in the sample ledger."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def begin(self, step: int) -> None:
        self.session.probe("step-begin", step)

    def after_step(self, step: int, rec: dict[str, Any]) -> bool:
        self.session.step_done(step)
        return False

    def finish(self) -> None:
        pass


class CheckpointDuty:
    """Collective: a checkpoint every checkpoint.every steps; after each step, whether any rank got SIGTERM
    (preemption), and if so a checkpoint of that step (unless just taken), the session closed, and on rank
    0 the run recorded as preempted (run.json, then metrics.jsonl's last record, then the log) — then the
    run stops, exit 0. At a normal end: the session closed (waiting for a checkpoint still being written).
    `metrics`: rank 0's metrics file (None on the other ranks)."""

    def __init__(
        self,
        trainer: CheckpointedTrainer,
        session: Session,
        token: str,
        logger: logging.Logger,
        metrics: MetricsDuty | None,
    ) -> None:
        self.trainer, self.session, self.token, self.logger, self.metrics = trainer, session, token, logger, metrics
        self.every = trainer.cfg.checkpoint.every
        self.preempted_at: int | None = None  # steps done when the run stopped on SIGTERM

    def begin(self, step: int) -> None:
        pass

    def _save(self, done: int, wait: bool = False) -> None:
        tr = self.trainer
        self.session.save(done, tr.stages, tr.opt, trainer_state(tr.cfg, tr, done), wait=wait)

    def after_step(self, step: int, rec: dict[str, Any]) -> bool:
        done = step + 1
        saved_now = bool(self.every and done % self.every == 0)
        if saved_now:
            self._save(done)
        if not self.session.should_stop():  # SIGTERM on any rank: checkpoint this step, exit cleanly
            return False
        if not saved_now:
            self._save(done, wait=True)
        self.session.close()
        self.preempted_at = done
        if self.trainer.topo.rank == 0:
            s = self.session
            rundir.record_state(s.run_dir, self.token, state="preempted", step=done)
            self.metrics.end({"preempted": True, "step": done, "run_id": s.run_id})
            self.logger.info(
                f"hybridpar: preempted: checkpointed after step {done} in {s.ck_dir}; resume with --resume auto"
            )
        return True

    def finish(self) -> None:
        self.session.close()
