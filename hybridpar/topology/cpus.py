"""Which CPU cores a local rank runs on, and how many intra-op threads it uses.

Ranks of one host share its cores. Left to the OS scheduler ("none"), a rank woken by a message often
waits for the core its sender still runs on: on a 2-core VM with 4 pipeline ranks, the wake-up of a
receiver took 282 us at the median this way, 45 us with rank r bound to core r % 2 (measured with
timestamps in the links, emulated 1F1B pp=4; see the README's Performance section). "cores" binds each local
rank to its own share of the cores the process may use:
- more ranks than cores: round robin, rank r on core r % n, so neighbouring pipeline stages (which
  hand each other every message) sit on different cores;
- otherwise contiguous equal shares (cores [r*k, (r+1)*k) for k = n // ranks), which keeps a rank's
  threads on neighbouring cores (shared caches); cores left over stay unused.
Either way the rank runs one intra-op thread per core of its share, so its threads never contend with
one another. Binding is off by default, as in torchrun: it takes cores away from the OS's balancing.
"""

from __future__ import annotations

import os
from typing import Sequence

from hybridpar.config.sections import CPU_BINDINGS


def share_of(local_rank: int, local_world: int, allowed: Sequence[int]) -> list[int]:
    """The cores of `allowed` (sorted) that local rank `local_rank` of `local_world` is bound to."""
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is outside 0..{local_world - 1}")
    cores = sorted(allowed)
    if not cores:
        raise ValueError("no CPU core is available to this process")
    if local_world >= len(cores):
        return [cores[local_rank % len(cores)]]
    k = len(cores) // local_world
    return cores[local_rank * k : (local_rank + 1) * k]


def bind_local_rank(mode: str, local_rank: int | None = None, local_world: int | None = None) -> int:
    """Apply `mode` (CPU_BINDINGS) to this process as local rank `local_rank` of `local_world`
    (default: torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE) and set its intra-op threads; returns them."""
    import torch

    if mode not in CPU_BINDINGS:
        raise ValueError(f"CPU binding must be one of {CPU_BINDINGS}, got {mode!r}")
    rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_world is None else local_world
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if mode == "cores" and allowed:
        share = share_of(rank, world, allowed)
        os.sched_setaffinity(0, share)
        threads = len(share)
    else:
        threads = max(1, (len(allowed) or os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    return threads
