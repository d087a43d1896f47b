"""Which CPU cores a local rank runs on, and how many intra-op threads it uses.

Ranks of one host share its cores. Left to the OS scheduler ("none"), a rank woken by a message often
waits for the core its sender still runs on: on a 2-core VM with 4 pipeline ranks, the wake-up of a
receiver took 282 us at the median this way, 45 us with rank r bound to core r % 2 (measured with
timestamps in the links, emulated 1F1B pp=4; see the README's Performance section). "cores" binds each local
rank to its own share of the cores the process may use, taking the node's ranks in stage-major order
(pipeline rank, then data-parallel rank, then tensor-parallel rank; `stage_major_position`):
- more ranks than cores: round robin, the rank at position i on core i % n. The ranks of one pipeline
  stage compute at the same time and meet in collectives (tp at every layer, dp at the gradient
  reduction), so they sit on different cores; so do neighbouring stages, which hand each other every
  message. In rank order (tp fastest) the two tp groups of tp2 x dp2 on 2 cores would pair each rank with
  its tp partner's replica instead: measured here, stage-major steps tp2 x dp2 at 0.19-0.20 s where the OS
  scheduler gives 0.24-0.26, tp2 x pp2 at 0.20 vs 0.25, tp4 at 0.34 vs 0.56-0.60, dp4 at 0.13 vs 0.14-0.15,
  pipeline layouts within 5% either way (default model, 4 ranks, 2 cores);
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


def stage_major_position(rank: int, local_rank: int, local_world: int, dp: int, pp: int, tp: int) -> int:
    """Where global `rank` (local rank `local_rank` of `local_world` on its node, whose ranks are
    consecutive) stands among its node's ranks ordered by (pipeline, data-parallel, tensor-parallel)
    coordinates (the mesh's own, topology/mesh.py)."""
    from hybridpar.topology.mesh import ParallelDims

    if not 0 <= local_rank < local_world or rank < local_rank or rank - local_rank + local_world > dp * pp * tp:
        raise ValueError(
            f"rank {rank} as local rank {local_rank} of {local_world} does not fit a world of "
            f"dp={dp} x pp={pp} x tp={tp} = {dp * pp * tp}"
        )
    dims = ParallelDims(dp=dp, pp=pp, tp=tp, world_size=dp * pp * tp)
    node = range(rank - local_rank, rank - local_rank + local_world)
    return sorted(node, key=lambda r: (dims.coord(r, "pp"), dims.coord(r, "dp"), dims.coord(r, "tp"))).index(rank)


def bind_local_rank(
    mode: str,
    local_rank: int | None = None,
    local_world: int | None = None,
    layout: tuple[int, int, int] | None = None,
) -> int:
    """Apply `mode` (CPU_BINDINGS) to this process as local rank `local_rank` of `local_world`
    (default: torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE) and set its intra-op threads; returns them.
    `layout` (dp, pp, tp) with the global RANK orders the node's ranks stage-major; without it, by
    local rank."""
    import torch

    if mode not in CPU_BINDINGS:
        raise ValueError(f"CPU binding must be one of {CPU_BINDINGS}, got {mode!r}")
    rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_world is None else local_world
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if mode == "cores" and allowed:
        if layout is not None:
            rank = stage_major_position(int(os.environ.get("RANK", rank)), rank, world, *layout)
        share = share_of(rank, world, allowed)
        os.sched_setaffinity(0, share)
        threads = len(share)
    else:
        threads = max(1, (len(allowed) or os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    return threads
