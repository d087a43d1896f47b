"""Launch local workers from Python through torch's elastic agent (the API behind torchrun), for
`hybridpar.launch(cfg)`. The command line uses `torch.distributed.run` itself (see cli.py)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from hybridpar.config import Config


def _worker(cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    from hybridpar.topology.cpus import bind_local_rank
    from hybridpar.train import enter_worker, train

    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # set by the elastic agent
    cfg, notes = enter_worker(Config.from_dict(cfg_dict), restarts)  # the pre-flight `launch` ran, again
    bind_local_rank(cfg.parallel.cpu_bind)  # before any thread starts
    if notes and os.environ.get("RANK") == "0":
        print("\n".join(notes), flush=True)
    res = train(cfg, restart_count=restarts)
    if res.digest is None:
        return None
    return {"losses": res.losses, "val_losses": res.val_losses, "params_digest": res.digest,
            "start_step": res.start_step, "restarts": restarts, "run_id": res.run_id}


def launch(cfg: Config, *, max_restarts: int | None = None, nproc: int | None = None,
           start_method: str = "spawn", overwrite: bool = False) -> dict[str, Any] | None:
    """Validate `cfg`, run it on `nproc` (default tp*pp*dp) local processes (rendezvous on loopback), and
    return rank 0's summary: per-step losses of the last attempt, validation losses, the final params digest
    (None if the run was preempted). The elastic agent restarts all workers up to `max_restarts` times
    (default resilience.max_restarts); restarted workers resume from the newest verified checkpoint.
    `nproc` other than tp*pp*dp with a resume re-plans the layout (resilience.replan). The run directory
    is held for the launch: a run_dir holding another run is refused unless `overwrite` (which deletes that
    run's files). Bad config or data raises ValueError before any worker starts, and so does a failure a
    worker found that a restart would repeat. `start_method`
    'fork' starts workers faster (CPU only: CUDA cannot be forked once initialised), but forks
    whatever threads and locks the caller holds: a fork-started run once hung at start-up in a test
    process that had run other torch work, so prefer 'spawn' from anything long-lived."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hybridpar.launcher import end_launch, start_launch
    from hybridpar.preflight import preflight
    from hybridpar.resilience.rundir import EXIT_USAGE, exit_code
    from hybridpar.topology.rendezvous import LOOPBACK_BACKEND, register_loopback_rendezvous

    world = nproc or cfg.parallel.world_size
    preflight(cfg, world)
    claim = start_launch(cfg, overwrite)
    try:
        register_loopback_rendezvous()
        lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world,
                          rdzv_backend=LOOPBACK_BACKEND, rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1",
                          run_id=uuid.uuid4().hex,
                          max_restarts=cfg.resilience.max_restarts if max_restarts is None else max_restarts,
                          monitor_interval=0.2, start_method=start_method)
        try:
            results = elastic_launch(lc, _worker)(cfg.to_dict())
        except Exception as e:
            code, why = exit_code(Path(cfg.run_dir), claim.token)
            if code == EXIT_USAGE:
                raise ValueError(why) from e
            raise
        return results[0]
    finally:
        end_launch(claim)
