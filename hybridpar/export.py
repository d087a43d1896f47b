"""Gather the sharded, pipelined model into one full fp32 state dict on rank 0, and its digest.

The digest is sha256 over (name, fp32 bytes) of every parameter of the full model in definition order,
so two runs can be compared bit for bit whatever their (tp, pp, dp) layout.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from hybridpar.config import ModelConfig
from hybridpar.model.registry import full_shapes, param_stages
from hybridpar.model.stage import Stage
from hybridpar.model.tp import full_tensor
from hybridpar.topology.mesh import Topology


def params_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def gather_full_state(
    topo: Topology, stages: dict[int, Stage], parts: Sequence[range], cfg: ModelConfig, stage_ranks: Sequence[int]
) -> dict[str, torch.Tensor] | None:
    """Collective over the whole world (call on every rank): rank 0 gets {name: full cpu fp32 tensor}
    in definition order, other ranks None. Replica dp=0 is the source (replicas are identical).
    `stage_ranks[s]` is the pipeline rank holding stage s (the schedule's placement)."""
    shapes = full_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, s in param_stages(cfg, parts).items():
        owner = topo.dims.moved(0, pp=stage_ranks[s])
        if topo.dp_rank == 0 and s in stages:
            p = stages[s].get_parameter(name)
            full = full_tensor(p, topo.group("tp") if topo.dims.tp > 1 else None)  # collective over tp
            if topo.rank == owner:
                if owner == 0:
                    out[name] = full.detach().float().cpu().clone()
                else:
                    dist.send(full.detach().float().contiguous(), dst=0)
        if topo.rank == 0 and owner != 0:
            buf = torch.empty(shapes[name], dtype=torch.float32, device=topo.device)
            dist.recv(buf, src=owner)
            out[name] = buf.cpu()
    return out if topo.rank == 0 else None
