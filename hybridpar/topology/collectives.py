"""Small control-plane collectives without pickle: JSON objects travel as UTF-8 bytes in a tensor
(torch's *_object collectives unpickle whatever a peer sends)."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

# Every rank's equal-sized input into one tensor, and a sum scattered in equal slices. torch 2.13 names them
# all_gather_single and reduce_scatter_single and deprecates all_gather_into_tensor and reduce_scatter_tensor
# (a FutureWarning per call); torch 2.11, the GPU image's, has only the older names (an AttributeError there
# broke tensor parallelism and ZeRO). Same arguments, same result; dynamo maps either to its functional
# collectives inside a compiled layer.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_json(obj: Any, device: torch.device, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's JSON-serialisable `obj`, in rank order of `group` (collective)."""
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    return [json.loads(p[: int(s)].cpu().numpy().tobytes().decode()) for p, s in zip(parts, sizes)]
