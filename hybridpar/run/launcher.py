"""What a launcher (`hybridpar train`, `hybridpar.launch`) does around torch's elastic agent: claim the
run directory after the pre-flight check, hand its workers the launch token, and turn the state they
recorded into an honest exit code (resilience/rundir.py). `launch` is the Python API: it starts local
workers through the agent's API (the command line runs `torch.distributed.run` itself, see cli.py).
Exit codes of `hybridpar train`:

    0    finished
    1    failed (a worker crashed more often than the restarts allow, or the launcher was stopped before
         a checkpoint could be written)
    2    bad configuration or data: found before any worker started, or by a worker (a failure that a
         restart would repeat, so the run ends without restarts)
    143  preempted: SIGTERM to the launcher or to any worker; the step in flight finished and was
         checkpointed; `--resume auto` continues the run
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridpar.config import Config
from hybridpar.config.parse import override_flags
from hybridpar.resilience import rundir
from hybridpar.run.preflight import checkpoint_dir

if TYPE_CHECKING:
    from hybridpar.plan.launch import AutoPlan


def start_launch(cfg: Config, overwrite: bool = False, node_key: str | None = None) -> rundir.RunClaim:
    """Claim `cfg.run_dir` for this launch (ValueError if another launch holds it or it holds another run)
    and put the token into the environment that the workers inherit. `node_key`: this launcher is one
    node of a launch of several, named by the key (rundir.claim_node). End with `end_launch`."""
    run_dir, ck_dir, resume = Path(cfg.run_dir), checkpoint_dir(cfg), cfg.checkpoint.resume
    if node_key is None:
        claim = rundir.claim(run_dir, ck_dir, resume, overwrite)
    else:
        claim = rundir.claim_node(run_dir, ck_dir, resume, overwrite, node_key)
    if claim.note:
        print(claim.note, flush=True)
    os.environ[rundir.TOKEN_ENV] = claim.token
    os.environ[rundir.LAUNCHER_ENV] = str(os.getpid())
    return claim


def end_launch(claim: rundir.RunClaim) -> None:
    if os.environ.get(rundir.TOKEN_ENV) == claim.token:
        del os.environ[rundir.TOKEN_ENV]
        os.environ.pop(rundir.LAUNCHER_ENV, None)
    claim.release()


def outcome(cfg: Config, claim: rundir.RunClaim) -> tuple[int, str | None]:
    """Exit code and a line to print, from what the workers of this launch recorded."""
    code, why = rundir.exit_code(Path(cfg.run_dir), claim.token)
    if code == rundir.EXIT_PREEMPTED:
        return code, (
            f"hybridpar: preempted and checkpointed (exit {code}); continue with --resume auto "
            f"--run-dir {cfg.run_dir}"
        )
    if code == rundir.EXIT_USAGE:
        return code, f"hybridpar: error: {why}"
    if code == rundir.EXIT_FAILED:
        return code, f"hybridpar: training failed{': ' + why if why else ''} (exit {code})"
    return code, None


def stop_on_permanent_failure(cfg: Config, claim: rundir.RunClaim, poll_s: float = 0.25) -> threading.Event:
    """`hybridpar train` only: a thread that watches run.json and, once a worker has recorded a failure that
    a restart would repeat, sends SIGTERM to this launcher, so that torch's agent stops the workers instead
    of restarting them (its restart loop cannot be told otherwise). Not for `launch()`, which runs in the
    caller's process: there, restarted workers stop at once by themselves (train.enter_worker). Set the
    returned event to end the watch."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_s):
            try:
                rec = rundir.read_run(Path(cfg.run_dir))
            except ValueError:
                continue
            if rec and rec.get("launch") == claim.token and rec.get("state") == "failed" and rec.get("permanent"):
                os.kill(os.getpid(), signal.SIGTERM)  # raised in the agent as SignalException: shut down
                return

    threading.Thread(target=watch, name="hybridpar-failure-watch", daemon=True).start()
    return done


def elastic_note(nnodes: str, checkpoint_every: int) -> str | None:
    """The warning an elastic launch (`--nnodes MIN:MAX`, MIN < MAX) without periodic checkpoints gets: the
    survivors of a lost node resume from the newest checkpoint, and a run that writes none starts over
    (only a node that joins, which stops the workers at a step's end, leaves a checkpoint behind)."""
    lo, sep, hi = nnodes.partition(":")
    if not sep or lo == hi or checkpoint_every > 0:
        return None
    return (
        f"hybridpar: warning: --nnodes {nnodes} survives a lost node, but without --checkpoint.every N the "
        "survivors restart the run from step 0: they resume from the newest checkpoint, and none is written"
    )


def restart_note(nnodes: str, restarts: str | None, checkpoint_every: int) -> str | None:
    """The warning a launch that is not elastic gets when it asks for restarts (`restarts`: the number given
    to `--max-restarts` or `--resilience.max_restarts`, None where neither was given) without periodic
    checkpoints: a restarted run resumes from the newest checkpoint, so with none each restart starts over.
    The default's restarts get no warning (the README's first command would print one); an elastic launch
    gets `elastic_note` instead."""
    lo, sep, hi = nnodes.partition(":")
    if checkpoint_every > 0 or restarts is None or not restarts.isdigit() or int(restarts) == 0 or (sep and lo != hi):
        return None
    return (
        f"hybridpar: warning: {restarts} restart(s) asked for, but without --checkpoint.every N each restart "
        "starts the run over from step 0: a restart resumes from the newest checkpoint, and none is written"
    )


def planned_flags(cfg: Config) -> list[str]:
    """The chosen layout as `--key=VALUE` flags, appended to the workers' command line (read after the
    user's, so they win)."""
    from hybridpar.plan.launch import PLANNED

    return override_flags(cfg, list(PLANNED))


def report_plan(planned: AutoPlan, run_dir: str, world: int) -> None:
    """Print the choice and the runners-up; write plan.json into the (claimed) run directory."""
    from hybridpar.plan.launch import record, summary, write_record

    path = write_record(run_dir, record(planned, world))
    print(f"{summary(planned)}\nhybridpar: the ranked layouts are in {path}", flush=True)


def _worker(cfg_dict: dict[str, Any], origin: dict[str, Any] | None = None) -> dict[str, Any] | None:
    if origin is not None:  # forked from the fork server: the launcher's environment, die with it
        from hybridpar.topology.spawn import enter

        enter(origin)
    from hybridpar.run.train import enter_worker, train
    from hybridpar.topology.cpus import bind_local_rank
    from hybridpar.topology.lifetime import release_groups

    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # set by the elastic agent
    cfg, notes = enter_worker(Config.from_dict(cfg_dict))  # the pre-flight `launch` ran, again
    bind_local_rank(cfg.parallel.cpu_bind, layout=cfg.parallel.layout)  # before any thread starts
    if notes and os.environ.get("RANK") == "0":
        print("\n".join(notes), flush=True)
    try:
        res = train(cfg, restart_count=restarts)
    finally:
        release_groups()  # before the interpreter ends: see topology/lifetime.py
    if res.digest is None:
        return None
    return {
        "losses": res.losses,
        "val_losses": res.val_losses,
        "params_digest": res.digest,
        "start_step": res.start_step,
        "restarts": restarts,
        "run_id": res.run_id,
    }


START_METHODS = ("forkserver", "spawn", "fork")


def threads_forked() -> int:
    """How many threads besides the caller's this process runs (every OS thread: an OpenMP or BLAS pool,
    a store's event loop, not only Python's), which a fork would copy the state of but not run."""
    try:
        return len(os.listdir("/proc/self/task")) - 1
    except OSError:  # no procfs (macOS): Python's own threads are what can be seen
        return threading.active_count() - 1


def fork_refusal(start_method: str) -> str | None:
    """Why `launch(start_method=...)` must not start its workers that way, or None. A forked worker
    inherits every lock and half-done structure of the caller's other threads without the threads: a
    second fork-started launch from one process once died in its workers (SIGSEGV in the garbage
    collector, freeing the first launch's store). CPython 3.12 warns on the same condition."""
    if start_method not in START_METHODS:
        return f"start_method={start_method!r} is not one of {', '.join(START_METHODS)}"
    n = threads_forked() if start_method == "fork" else 0
    if n == 0:
        return None
    return (
        f"start_method='fork' would fork this process, which runs {n} thread(s) besides this one (a BLAS or "
        "OpenMP pool, a store, a past launch's leftovers): a forked worker inherits their locks without them; "
        "use start_method='forkserver' or 'spawn', or fork only from a process that has started no threads (a fresh "
        "interpreter with OPENBLAS_NUM_THREADS=1 set before numpy or torch is imported, no torch operation "
        "run, no launch before)"
    )


def launch(
    cfg: Config,
    *,
    max_restarts: int | None = None,
    nproc: int | None = None,
    start_method: str = "forkserver",
    overwrite: bool = False,
) -> dict[str, Any] | None:
    """Validate `cfg`, run it on `nproc` (default tp*pp*dp) local processes (rendezvous on loopback), and
    return rank 0's summary: per-step losses of the last attempt, validation losses, the final params digest
    (None if the run was preempted). The elastic agent restarts all workers up to `max_restarts` times
    (default resilience.max_restarts); restarted workers resume from the newest verified checkpoint.
    `nproc` other than tp*pp*dp with a resume re-plans the layout (resilience.replan). With
    parallel.auto the layout is planned here for `nproc` (default tp*pp*dp), holding the planner's keys
    set to other than their defaults, and plan.json written (plan/launch.py). The run directory
    is held for the launch: a run_dir holding another run is refused unless `overwrite` (which deletes that
    run's files). Bad config or data raises ValueError before any worker starts, and so does a failure a
    worker found that a restart would repeat. `start_method`: 'forkserver' (forked from a process that
    imported torch and the trainer once and has run nothing: topology/spawn.py), 'spawn' (a fresh
    interpreter per worker, importing them again) or 'fork' (this process itself; CPU only: CUDA cannot be
    forked once initialised), refused as a ValueError where the caller runs other threads (`fork_refusal`)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hybridpar.resilience.rundir import EXIT_USAGE, exit_code
    from hybridpar.run.preflight import preflight
    from hybridpar.topology.rendezvous import LOOPBACK_BACKEND, register_loopback_rendezvous

    if why := fork_refusal(start_method):
        raise ValueError(why)
    world = nproc or cfg.parallel.world_size
    planned = None
    if cfg.parallel.auto:  # the keys set to other than their defaults are the user's, held fixed
        from hybridpar.plan.launch import auto_plan, given_by_value

        planned = auto_plan(cfg, given_by_value(cfg), world)
        cfg = planned.cfg
    preflight(cfg, world, local_ranks=world)
    claim = start_launch(cfg, overwrite)
    try:
        if planned is not None:
            report_plan(planned, cfg.run_dir, world)
        register_loopback_rendezvous()
        extra: tuple[Any, ...] = ()
        if start_method == "forkserver":  # ours, with torch and the trainer preloaded
            from hybridpar.topology.spawn import fork_server, origin

            fork_server()
            extra = (origin(),)
        lc = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=world,
            rdzv_backend=LOOPBACK_BACKEND,
            rdzv_endpoint="127.0.0.1:0",
            local_addr="127.0.0.1",
            run_id=uuid.uuid4().hex,
            max_restarts=cfg.resilience.max_restarts if max_restarts is None else max_restarts,
            monitor_interval=0.2,
            start_method=start_method,
        )
        try:
            results = elastic_launch(lc, _worker)(cfg.to_dict(), *extra)
        except Exception as e:
            code, why = exit_code(Path(cfg.run_dir), claim.token)
            if code == EXIT_USAGE:
                raise ValueError(why) from e
            raise
        return results[0]
    finally:
        end_launch(claim)
        # The agent's rendezvous store sits in reference cycles and keeps two event-loop threads alive
        # until a garbage collection frees it: collect now, so that a launch leaves no thread behind
        # (for a later fork to copy, or a forked child's collector to free again).
        gc.collect()
