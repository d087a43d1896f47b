"""One process of a training run: `python -m hybridpar.run.train` under torchrun, or `hybridpar train`,
which launches it through torch's elastic agent. `train` runs the steps of a `Trainer` (trainer/step.py)
with validation, checkpoints, preemption and traces. Rank 0 writes `config.toml` (the run's config,
which `--config` reads back) and `metrics.jsonl`, reports progress and, at the end, writes the model as
a Hugging Face directory (`final/`) and a sample from it; every rank logs to `train.log`.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar.balance.monitor import aggregate
from hybridpar.config import Config, parse_args, step_range, to_toml
from hybridpar.data.corpus import decode, encode
from hybridpar.data.tokenizer import Tokenizer
from hybridpar.emulate.attach import emulated_devices, fault_injector
from hybridpar.model.hf import StateSource
from hybridpar.model.optim import lr_at
from hybridpar.model.registry import empty_stage, load_stage_
from hybridpar.model.stage import generate
from hybridpar.pipeline.schedules import stages_per_rank
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.report.log import run_log
from hybridpar.report.metrics import MetricsWriter, Progress
from hybridpar.report.profile import StepProfiler
from hybridpar.report.sinks import open_sinks
from hybridpar.report.step_records import StepRecords
from hybridpar.report.step_trace import step_slices, write_run_trace
from hybridpar.resilience import rundir
from hybridpar.resilience.checkpoint import _on_rank0, resume
from hybridpar.resilience.probe import install
from hybridpar.resilience.rundir import write_text_atomic
from hybridpar.resilience.session import Session, ledger_stats
from hybridpar.run.preflight import checkpoint_dir, preflight, resolve_init_from
from hybridpar.topology.collectives import all_gather_json
from hybridpar.topology.cpus import bind_local_rank
from hybridpar.topology.lifetime import die_with_parent, release_groups
from hybridpar.topology.mesh import Topology, build_topology
from hybridpar.trainer import Trainer
from hybridpar.trainer.export import FINAL_DIR, gather_full_state, params_digest, write_model_dir


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    digest: str | None = None  # rank 0 only
    start_step: int = 0  # > 0 when resumed from a checkpoint: `losses` then start at this step
    preempted_at: int | None = None  # steps done when a SIGTERM stopped the run (checkpointed there)
    run_id: str | None = None
    state: dict[str, torch.Tensor] | None = None  # rank 0 only: the full trained model


def trainer_state(cfg: Config, trainer: Trainer, done: int) -> dict:
    """What a checkpoint records besides tensors (JSON). The data cursor is `done` itself: sample order
    depends only on (seed, step)."""
    p = cfg.parallel
    return {
        "step": done,
        "config": cfg.to_dict(),
        "partition": [[r.start, r.stop] for r in trainer.parts],
        "batch_plan": [list(s) for s in trainer.plan.sizes],
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


def summary_line(stats: dict, oom_retries: int) -> str:
    """End-of-run microbatching summary (the full statistics are in the final metrics record)."""
    thr = stats["mean_throughput"]
    line = (
        f"microbatching: {stats['policy']}, split {stats['current_split']}, mean {stats['mean_latency_s']:.3f} s/step"
        f" ({thr:,.0f} tok/s)"
        if thr
        else f"microbatching: {stats['policy']}, split {stats['current_split']}"
    )
    if stats["policy"] == "adaptive":
        done = stats["steps_to_converge"]
        line += f"; {len(stats['history'])} splits measured, " + (
            f"converged after {done} steps" if done is not None else "still exploring"
        )
    return line + (f"; {oom_retries} step(s) redone after running out of memory" if oom_retries else "")


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
        topo = build_topology(p.dp, p.pp, p.tp, p.backend, p.timeout_s)
    validate_config(cfg, world_size=topo.dims.world_size)
    run_id, token = own_run(cfg, topo, held)
    if topo.rank == 0:  # the run as it runs (layout re-planned, defaults filled in): --config reads it back
        write_text_atomic(Path(cfg.run_dir) / "config.toml", to_toml(cfg))
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
        f"run {run_id}: rank {topo.rank} of {topo.dims.world_size} (dp {topo.dp_rank}, pp {topo.pp_rank}, tp "
        f"{topo.tp_rank}) holds "
        + ", ".join(f"stage {s} (layers {trainer.parts[s].start}-{trainer.parts[s].stop - 1})" for s in trainer.stages)
    )
    res = TrainResult(run_id=run_id)
    rank0 = topo.rank == 0
    ck = cfg.checkpoint
    ck_dir = checkpoint_dir(cfg)
    # The [emulate] testing and benchmark modes (emulate/attach.py), which do nothing when off.
    trainer.attach(emulated_devices(cfg, topo))
    injector = fault_injector(cfg, topo, ck_dir)
    session = Session(cfg, topo, ck_dir, restart_count, run_id, lambda: rundir.lock_holder_ok(run_dir, token), injector)
    trainer.attach(lambda tr: install(session.probe, tr.stages.values(), tr.p2p, tr.dp.grads, tr.opt))
    sessions.append(session)
    saved = None
    if ck.resume != "off":
        saved = resume(topo, trainer.stages, trainer.opt, ck.resume, ck_dir, cfg.to_dict(), run_id)
        res.start_step = saved["step"] if saved else 0
        if saved and saved.get("batching_policy"):
            try:
                trainer.policy.load_state_dict(saved["batching_policy"])
            except ValueError as e:  # another batch or schedule: measurements of other splits
                if topo.rank == 0:
                    logger.info(f"hybridpar: microbatch policy starts afresh: {e}")
    session.resumed(saved)
    writer = None
    if rank0:
        sinks = open_sinks(cfg.sinks, run_dir, res.start_step, run_id)
        writer = MetricsWriter(run_dir / "metrics.jsonl", resume_step=res.start_step, sinks=sinks)
    progress = Progress(t.steps, logger, every=t.progress_every, start_step=res.start_step) if rank0 else None
    records = StepRecords(
        cfg, topo, res.start_step, restart_count, torch.bfloat16 if t.precision == "bf16" else torch.float32
    )
    trace_rows: list[dict] = []
    trace_steps, profile_steps = step_range(cfg.profile.trace_steps), step_range(cfg.profile.steps)
    profiler = (
        StepProfiler(profile_steps, run_dir, topo.rank, topo.device, cfg.profile.memory) if profile_steps else None
    )
    for step in range(res.start_step, t.steps):
        session.probe("step-begin", step)
        if profiler:
            profiler.before(step, trainer.runtime)
        rec = records.add(trainer.step(step))
        if profiler:
            profiler.after(step, trainer.runtime)
        records.timeline(step, trainer.last_output)
        if t.monitor_every and (step + 1) % t.monitor_every == 0:
            mine = trainer.monitor.record(trainer.last_output, trainer.p2p)
            mine["activation_peak_bytes"] = trainer.runtime.meter.peak  # this rank's, for this step
            mine["memory"] = trainer.memory  # bytes per component at the step's peak (trainer/held.py)
            ranks = all_gather_json(mine, topo.device)
            rec["monitor"] = aggregate(ranks)
            rec["batching"] = trainer.policy.statistics()
            trainer.monitor.reset_peak()
        if cfg.trace and step in trace_steps:
            trace_rows += step_slices(trainer.last_output, topo.rank, step)
        if not math.isfinite(rec["loss"]):
            raise FloatingPointError(f"loss became {rec['loss']} at step {step}: lower train.lr (now {t.lr})")
        res.losses.append(rec["loss"])
        session.step_done(step)
        last = step == t.steps - 1
        if t.val_every and ((step + 1) % t.val_every == 0 or step == 0 or last):
            with session.probe.slow("validate"):
                rec["val_loss"] = trainer.evaluate()
            res.val_losses.append((step, rec["val_loss"]))
        if writer:
            writer.write(rec)
        if progress:
            extra = f"  val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
            progress.update(step, rec["loss"], rec["tokens_per_s"], rec["step_time_s"], extra)
        saved_now = bool(ck.every and (step + 1) % ck.every == 0)
        if saved_now:
            session.save(step + 1, trainer.stages, trainer.opt, trainer_state(cfg, trainer, step + 1))
        if session.should_stop():  # SIGTERM on any rank: checkpoint this step, exit cleanly
            if not saved_now:
                session.save(step + 1, trainer.stages, trainer.opt, trainer_state(cfg, trainer, step + 1), wait=True)
            session.close()
            res.preempted_at = step + 1
            if rank0:
                rundir.record_state(run_dir, token, state="preempted", step=step + 1)
                writer.write({"preempted": True, "step": step + 1, "run_id": run_id})
                writer.close()
                logger.info(
                    f"hybridpar: preempted: checkpointed after step {step + 1} in {ck_dir}; resume with --resume auto"
                )
            return res
    if cfg.trace:
        write_run_trace(cfg.trace, topo.rank, topo.dims.world_size, trace_rows, dist.barrier)
    session.close()
    state = gather_full_state(topo, trainer.stages, trainer.parts, cfg.model, trainer.stage_ranks)
    if rank0:
        res.state, res.digest = state, params_digest(state.items())
        writer.write(
            {
                "final": True,
                "run_id": run_id,
                "params_digest": res.digest,
                "steps": t.steps,
                "samples_applied": session.applied,
                "ledger": ledger_stats(session.applied, t.steps, t.global_batch),  # for hybridpar report
                "batching": trainer.policy.statistics(),
                "oom_retries": trainer.oom_retries,
                "p2p": {str(k): v.to_dict() for k, v in trainer.p2p.stats.items()},
            }
        )
        writer.close()
        record = {"run_id": run_id, "step": t.steps, "params_digest": res.digest}
        final = write_model_dir(state, cfg.model, run_dir / FINAL_DIR, record, cfg.data.tokenizer)
        rundir.record_state(run_dir, token, state="finished", step=t.steps)
        logger.info(f"hybridpar: the trained model is in {final} (a Hugging Face model directory)")
        logger.info(summary_line(trainer.policy.statistics(), trainer.oom_retries))
        if log and t.sample_tokens:  # (a test's quiet run skips the generation's cost)
            model = empty_stage(cfg.model, range(cfg.model.n_layers), True, True, torch.device("cpu"))
            load_stage_(model, StateSource(state), hf_layout=False)
            tok = Tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer else None
            prompt = tok.encode(t.sample_prompt) if tok else encode(t.sample_prompt)
            out = generate(model, prompt, t.sample_tokens, seed=t.seed)
            text = tok.decode(out) if tok else decode(out)
            logger.info(f"\n--- sample from the trained model ---\n{t.sample_prompt}{text}\n---")
    return res


def enter_worker(cfg: Config, restarts: int) -> tuple[Config, list[str]]:
    """The start of every worker process (torchrun's and launch()'s): die with the launcher, stop at once
    if this launch already failed in a way a restart repeats, then the pre-flight check (ValueError)."""
    token = os.environ.get(rundir.TOKEN_ENV)
    run_dir = Path(cfg.run_dir)
    if token:  # started by our launcher, which holds the run directory
        launcher = os.environ.get(rundir.LAUNCHER_ENV) or rundir.lock_info(run_dir).get("pid")
        if not die_with_parent(int(launcher) if launcher else None):
            raise SystemExit("hybridpar: worker exits: its launcher is gone")
        rec = rundir.read_run(run_dir)
        if rec and rec.get("launch") == token and rec.get("state") == "failed" and rec.get("permanent"):
            raise SystemExit(2)  # restarted after a failure that would repeat: end now, said once already
    try:
        local = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
        return preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")), restarts, verify=False, local_ranks=local)
    except ValueError as e:
        if token:
            rundir.record_state(run_dir, token, state="failed", permanent=True, error=str(e))
        raise


def main(argv: list[str] | None = None) -> int:
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # set by torch's elastic agent
    try:
        cfg, notes = enter_worker(parse_args(sys.argv[1:] if argv is None else argv), restarts)
    except ValueError as e:
        print(f"hybridpar: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        for note in notes:
            print(note, flush=True)
    bind_local_rank(cfg.parallel.cpu_bind, layout=cfg.parallel.layout)  # before any thread starts
    try:
        train(cfg, restart_count=restarts)
    finally:
        release_groups()
    return 0


if __name__ == "__main__":
    sys.exit(main())
