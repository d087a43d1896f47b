"""Small control-plane collectives without pickle: JSON objects travel as UTF-8 bytes in a tensor
(torch's *_object collectives unpickle whatever a peer sends)."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


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
