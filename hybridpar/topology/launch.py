"""Launch local workers from Python through torch's elastic agent (the API behind torchrun), for
`hybridpar.launch(cfg)`. The command line uses `torch.distributed.run` itself (see cli.py)."""

from __future__ import annotations

import os
import uuid
from typing import Any

from hybridpar.config import Config


def _worker(cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    import torch

    from hybridpar.train import train

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    res = train(Config.from_dict(cfg_dict))
    if res.digest is None:
        return None
    return {"losses": res.losses, "val_losses": res.val_losses, "params_digest": res.digest}


def launch(cfg: Config, *, max_restarts: int = 0) -> dict[str, Any]:
    """Validate `cfg`, run it on tp*pp*dp local processes (rendezvous on loopback), and return rank 0's
    summary: per-step losses, validation losses and the final params digest."""
    cfg.validate(world_size=cfg.parallel.world_size)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hybridpar.topology.rendezvous import LOOPBACK_BACKEND, register_loopback_rendezvous

    register_loopback_rendezvous()
    lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.parallel.world_size,
                      rdzv_backend=LOOPBACK_BACKEND, rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1",
                      run_id=uuid.uuid4().hex,
                      max_restarts=max_restarts, monitor_interval=0.5, start_method="spawn")
    results = elastic_launch(lc, _worker)(cfg.to_dict())
    return results[0]
