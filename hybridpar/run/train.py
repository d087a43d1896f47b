"""One process of a training run: `python -m hybridpar.run.train` under torchrun, or `hybridpar train`,
which launches it through torch's elastic agent. `train` runs the steps of a `Trainer` (trainer/step.py)
with validation, checkpoints, preemption and traces, each a duty of the loop (trainer/duty.py). Rank 0
writes `config.toml` (the run's config, which `--config` reads back) and `metrics.jsonl`, reports progress
and, at the end, writes the model as a Hugging Face directory (`final/`) and a sample from it; every rank
logs to `train.log`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridpar.balance.monitor import MonitorDuty
from hybridpar.config import Config, parse_args, to_toml
from hybridpar.emulate.attach import emulated_devices, fault_injector
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.report.log import run_log
from hybridpar.report.metrics import MetricsDuty, ProgressDuty, redo_note
from hybridpar.report.profile import ProfileDuty
from hybridpar.report.step_records import RecordsDuty
from hybridpar.report.step_trace import TraceDuty
from hybridpar.resilience import rundir
from hybridpar.resilience.checkpoint import _on_rank0
from hybridpar.resilience.duties import CheckpointDuty, SessionDuty, resume_run
from hybridpar.resilience.probe import Probe, install
from hybridpar.resilience.session import Session
from hybridpar.run.preflight import checkpoint_dir, preflight, resolve_init_from
from hybridpar.topology.collectives import all_gather_json
from hybridpar.topology.cpus import bind_local_rank
from hybridpar.topology.lifetime import die_with_launcher, release_groups
from hybridpar.topology.mesh import Topology, build_topology
from hybridpar.topology.rendezvous import job_restarts
from hybridpar.trainer import Trainer
from hybridpar.trainer.duty import LossDuty, StepDuty, ValidationDuty
from hybridpar.trainer.final import FinalModelDuty
from hybridpar.trainer.paths import FastPathsDuty


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    digest: str | None = None  # rank 0 only
    start_step: int = 0  # > 0 when resumed from a checkpoint: `losses` then start at this step
    preempted_at: int | None = None  # steps done when a SIGTERM stopped the run (checkpointed there)
    run_id: str | None = None
    state: dict[str, torch.Tensor] | None = None  # rank 0 only: the full trained model


def train(cfg: Config, topo: Topology | None = None, *, log: bool = True, restart_count: int = 0) -> TrainResult:
    """Train per `cfg` on the current world (created from torchrun's environment if needed).
    `restart_count`: restarts by the elastic agent so far (TORCHELASTIC_RESTART_COUNT), for the record."""
    sessions: list[Session] = []
    held: list[rundir.RunClaim] = []
    try:
        return _train(cfg, topo, log, restart_count, sessions, held)
    except BaseException as e:
        for s in sessions:  # stop the watchdog: a caller may go on (tests), this run's silence is no hang
            s.close(ok=False)
        if is_permanent(e) and (token := os.environ.get(rundir.TOKEN_ENV) or (held[0].token if held else None)):
            rundir.record_state(Path(cfg.run_dir), token, state="failed", permanent=True, error=str(e))
        raise
    finally:
        for c in held:
            c.release()


def is_permanent(e: BaseException) -> bool:
    """A failure that a restart would repeat: our configuration, data and shape errors are ValueErrors,
    and a loss that turned non-finite does so again from the same checkpoint."""
    return isinstance(e, (ValueError, FloatingPointError))


def own_run(cfg: Config, topo: Topology, held: list[rundir.RunClaim]) -> tuple[str, str]:
    """Collective: this run's (run id, launch token). Under our launcher the token comes with the
    environment and rank 0 checks that the launcher still holds the run directory; under plain torchrun
    rank 0 claims the directory itself, for as long as this process lives (see resilience/rundir.py)."""
    token = os.environ.get(rundir.TOKEN_ENV)
    run_dir = Path(cfg.run_dir)

    def pick() -> list[str]:
        if token:
            if (why := rundir.lock_holder_ok(run_dir, token)) is not None:
                raise ValueError(f"run_dir={str(run_dir)!r}: {why}")
            return [rundir.read_run(run_dir)["run_id"], token]
        c = rundir.claim(run_dir, checkpoint_dir(cfg), cfg.checkpoint.resume, overwrite=False)
        held.append(c)
        return [c.run_id, c.token]

    run_id, tok = _on_rank0(topo, pick, ValueError)
    if topo.nodes is not None and topo.nodes.n_nodes > 1:
        shared_dirs_check(cfg, topo, run_id)
        if topo.rank == 0:
            print(f"hybridpar: {topo.nodes.describe(topo.dims)}", flush=True)
    return run_id, tok


def shared_dirs_check(cfg: Config, topo: Topology, run_id: str) -> None:
    """Collective, for runs of several nodes: every rank sees the run directory and the checkpoint
    directory rank 0 sees. Checkpoints live on a filesystem every node mounts: each rank writes its own
    shards into one directory and rank 0 commits them with a manifest of every file (checkpoint.py), which
    only works if rank 0 can read them all; a node-local directory is refused here, before any step."""
    ck_dir = checkpoint_dir(cfg)
    probe = ck_dir / f".shared-{run_id}-{all_gather_json(secrets.token_hex(4), topo.device)[0]}"
    if topo.rank == 0:
        ck_dir.mkdir(parents=True, exist_ok=True)
        probe.touch()
    dist.barrier()
    try:
        rec = rundir.read_run(Path(cfg.run_dir))
    except ValueError:
        rec = None
    mine = {"run": (rec or {}).get("run_id") == run_id, "ckpt": probe.exists(), "node": topo.nodes.node_of[topo.rank]}
    seen = all_gather_json(mine, topo.device)
    if topo.rank == 0:
        probe.unlink()
    blind = sorted({s["node"] for s in seen if not (s["run"] and s["ckpt"])})
    if blind:
        raise ValueError(
            f"node(s) {blind} do not see run_dir={cfg.run_dir!r} or checkpoint.dir={str(ck_dir)!r} as node 0 "
            f"does: a run of several nodes needs both on a filesystem every node mounts (NFS, Lustre, …)"
        )


def _train(
    cfg: Config,
    topo: Topology | None,
    log: bool,
    restart_count: int,
    sessions: list[Session],
    held: list[rundir.RunClaim],
) -> TrainResult:
    resolve_init_from(cfg)  # (train() called directly, without the pre-flight)
    p = cfg.parallel
    if topo is None:
        topo = build_topology(p.dp, p.pp, p.tp, p.backend, p.timeout_s, p.cp)
    validate_config(cfg, world_size=topo.dims.world_size)
    run_id, token = own_run(cfg, topo, held)
    if topo.rank == 0:  # the run as it runs (layout re-planned, defaults filled in): --config reads it back
        rundir.write_text_atomic(Path(cfg.run_dir) / "config.toml", to_toml(cfg))
    with run_log(Path(cfg.run_dir), topo.rank, console=log) as logger:
        try:
            return _steps(cfg, topo, logger, log, restart_count, sessions, run_id, token)
        except Exception as e:
            logger.error(f"hybridpar: error: {type(e).__name__}: {e}")
            raise


def _steps(
    cfg: Config,
    topo: Topology,
    logger: logging.Logger,
    log: bool,
    restart_count: int,
    sessions: list[Session],
    run_id: str,
    token: str,
) -> TrainResult:
    t = cfg.train
    run_dir = Path(cfg.run_dir)
    trainer = Trainer(cfg, topo)
    logger.info(
        f"run {run_id}: rank {topo.rank} of {topo.dims.world_size} (dp {topo.dp_rank}, pp {topo.pp_rank}, "
        + (f"cp {topo.cp_rank}, " if topo.dims.cp > 1 else "")
        + f"tp {topo.tp_rank}) holds "
        + ", ".join(f"stage {s} (layers {trainer.parts[s].start}-{trainer.parts[s].stop - 1})" for s in trainer.stages)
    )
    rank0 = topo.rank == 0
    ck_dir = checkpoint_dir(cfg)
    # The [emulate] testing and benchmark modes (emulate/attach.py), which do nothing when off.
    trainer.attach(emulated_devices(cfg, topo))
    injector = fault_injector(cfg, topo, ck_dir)
    session = Session(cfg, topo, ck_dir, restart_count, run_id, lambda: rundir.lock_holder_ok(run_dir, token), injector)
    trainer.attach(lambda tr: install(session.probe, tr.stages.values(), tr.p2p, tr.dp.grads, tr.opt))
    sessions.append(session)
    saved = resume_run(cfg, trainer, session, logger)
    res = TrainResult(run_id=run_id, start_step=saved["step"] if saved else 0)
    if saved is not None:  # a restart keeps its balance where the recorded layout still applies
        restored = trainer.restore_layout(saved)
        session.event("layout", step=res.start_step, **restored.to_record())
        if rank0:
            logger.info(f"hybridpar: resumed layout: {restored.reason}")
    # Rank 0's outputs, opened (metrics.jsonl cut back to the resumed step) before the records' collective set-up.
    metrics = MetricsDuty(cfg, run_id, res.start_step) if rank0 else None
    if metrics is not None and (note := redo_note(metrics.writer.redone, res.start_step, cfg.checkpoint.every)):
        logger.info(note)
    progress = ProgressDuty(cfg, logger, res.start_step) if rank0 else None
    checkpoints = CheckpointDuty(trainer, session, token, logger, metrics)
    final = FinalModelDuty(trainer, session, token, logger, metrics, sample=log)
    # In the order they see each step (trainer/duty.py): the record is complete before it is written, and
    # written before the checkpoint of its step.
    duties: list[StepDuty] = [
        ProfileDuty(trainer),
        FastPathsDuty(trainer, logger, rank0),
        RecordsDuty(trainer, res.start_step, restart_count),
        MonitorDuty(trainer),
        TraceDuty(trainer),
        LossDuty(cfg, res.losses),
        SessionDuty(session),
        ValidationDuty(trainer, session.probe, res.val_losses),
        *([metrics, progress] if rank0 else []),
        checkpoints,
        final,
    ]
    for step in range(res.start_step, t.steps):
        for duty in reversed(duties):  # nested around the step: the first duty innermost
            duty.begin(step)
        rec = run_step(trainer, session.probe, step, res.start_step)
        if any(duty.after_step(step, rec) for duty in duties):  # preempted, checkpointed and recorded
            res.preempted_at = checkpoints.preempted_at
            return res
    for duty in duties:
        duty.finish()
    res.state, res.digest = final.state, final.digest
    return res


def run_step(trainer: Trainer, probe: Probe, step: int, first: int) -> dict[str, Any]:
    """One step. The first of a compiled run (each restart's first too) compiles the layers' graphs: up to
    tens of seconds per process, minutes on a busy CPU, while the other ranks wait on the compiling one. The
    watchdog allows it resilience.slow_phase_timeout_s, as it does validation, instead of calling the run
    hung after hang_timeout_s (which killed the compilers mid-write)."""
    compiling = trainer.mp.compiled is not None and step == first
    with probe.slow("compile") if compiling else contextlib.nullcontext():
        return trainer.step(step)


def enter_worker(cfg: Config) -> tuple[Config, list[str]]:
    """The start of every worker process (torchrun's and launch()'s): die with the launcher, stop at once
    if this launch already failed in a way a restart repeats, then the pre-flight check (ValueError), which
    resumes a job that started before (`job_restarts`: the job's count, not this node's agent's)."""
    token = os.environ.get(rundir.TOKEN_ENV)
    run_dir = Path(cfg.run_dir)
    if token:  # started by our launcher, which holds the run directory
        launcher = os.environ.get(rundir.LAUNCHER_ENV) or rundir.lock_info(run_dir).get("pid")
        if not die_with_launcher(int(launcher) if launcher else None):
            raise SystemExit("hybridpar: worker exits: its launcher is gone")
        rec = rundir.read_run(run_dir)
        if rec and rec.get("launch") == token and rec.get("state") == "failed" and rec.get("permanent"):
            raise SystemExit(2)  # restarted after a failure that would repeat: end now, said once already
    try:
        local = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return preflight(cfg, world, job_restarts(), verify=False, local_ranks=local)
    except ValueError as e:
        if token:
            rundir.record_state(run_dir, token, state="failed", permanent=True, error=str(e))
        raise


def notes_to_print(notes: list[str], restarts: int) -> list[str]:
    """The pre-flight's lines (an elastic re-plan) that rank 0 prints: `hybridpar train`'s launcher printed
    those of the first attempt already; a restart's (another world) and plain torchrun's are news."""
    if os.environ.get("RANK", "0") != "0" or (restarts == 0 and os.environ.get(rundir.LAUNCHER_ENV)):
        return []
    return notes


def main(argv: list[str] | None = None) -> int:
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # set by torch's elastic agent
    try:
        cfg, notes = enter_worker(parse_args(sys.argv[1:] if argv is None else argv))
    except ValueError as e:
        print(f"hybridpar: error: {e}", file=sys.stderr)
        return 2
    for note in notes_to_print(notes, restarts):
        print(note, flush=True)
    bind_local_rank(cfg.parallel.cpu_bind, layout=cfg.parallel.layout)  # before any thread starts
    try:
        train(cfg, restart_count=restarts)
    finally:
        release_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
