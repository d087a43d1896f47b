"""Process layout: `ParallelDims` (pure) and `Topology` (the live DeviceMesh and groups).

Rank order is (dp, pp, cp, tp) with tp fastest, as in Megatron-LM: tensor-parallel peers, which talk on
every layer, are neighbouring ranks (same node, fastest links); context-parallel peers, which pass keys
and values around a ring in every attention layer, next; data-parallel peers, which talk once per step,
are furthest apart.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybridpar.topology.nodes import NodeMap
from hybridpar.topology.rendezvous import worker_store_prefix

# The parallel axes in rank order, slowest first. A new axis (a sharded-optimizer or context-parallel
# one) is a field of ParallelDims plus its place here: coordinates, rank arithmetic, the DeviceMesh and
# its groups all follow from this tuple.
AXES = ("dp", "pp", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    pp: int
    tp: int
    world_size: int
    cp: int = 1  # context parallelism: the sequence split over cp ranks (model/ring_attention.py)

    def __post_init__(self) -> None:
        for name in (*AXES, "world_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ParallelDims.{name} must be a positive integer, got {v!r}")
        if math.prod(self.shape) != self.world_size:
            formula = " × ".join(AXES)
            sizes = " × ".join(str(n) for n in self.shape)
            raise ValueError(
                f"{formula} = {sizes} = {math.prod(self.shape)} does not equal the world size {self.world_size}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes of the axes, in AXES order (the DeviceMesh's shape)."""
        return tuple(getattr(self, a) for a in AXES)

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of a global rank, in AXES order: (dp_rank, pp_rank, cp_rank, tp_rank)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        out = []
        for size in reversed(self.shape):  # the last axis is the fastest
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def coord(self, rank: int, axis: str) -> int:
        return self.coords(rank)[AXES.index(axis)]

    def rank_of(self, *coords: int) -> int:
        """The global rank at `coords` (AXES order)."""
        if len(coords) != len(AXES):
            raise ValueError(f"rank_of takes {len(AXES)} coordinates ({', '.join(AXES)}), got {len(coords)}")
        rank = 0
        for c, size in zip(coords, self.shape):
            rank = rank * size + c
        return rank

    def moved(self, rank: int, **along: int) -> int:
        """The rank whose coordinates are `rank`'s with those named in `along` replaced."""
        c = list(self.coords(rank))
        for axis, v in along.items():
            c[AXES.index(axis)] = v
        return self.rank_of(*c)


def pick_backend(requested: str) -> tuple[str, str]:
    """(backend, device type): NCCL on CUDA when available, gloo on CPU otherwise."""
    if requested == "auto":
        requested = "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError("parallel.backend='nccl' needs CUDA, which is not available here: use 'gloo' or 'auto'")
    return requested, ("cuda" if requested == "nccl" else "cpu")


def init_process_group(backend: str, timeout_s: float) -> None:
    """Join the default group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR…), bounded by
    `timeout_s` so that a missing peer fails instead of waiting forever."""
    if dist.is_initialized():
        return
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # torch's env:// assumes a new agent store per restart, but the elastic agent keeps one store
        # for all rounds: without a per-attempt prefix, restarted workers read the dead workers' gloo
        # addresses and fail to connect ("Connection refused"). torchrun's workers set these variables.
        agent = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
        store = dist.PrefixStore(worker_store_prefix(), agent)  # one prefix per rendezvous round
    if store is None:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    else:
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=timeout_s),
            store=store,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )


@dataclass
class Topology:
    """The live layout of this process: dims, coordinates, mesh, device. Passed explicitly everywhere."""

    dims: ParallelDims
    rank: int
    mesh: DeviceMesh
    device: torch.device
    backend: str
    timeout_s: float
    dp_rank: int = field(init=False)
    pp_rank: int = field(init=False)
    tp_rank: int = field(init=False)
    cp_rank: int = field(init=False)
    nodes: NodeMap | None = None  # which ranks share a node (topology/nodes.py); None: not gathered

    def __post_init__(self) -> None:
        self.dp_rank, self.pp_rank, self.tp_rank = (self.dims.coord(self.rank, a) for a in ("dp", "pp", "tp"))
        self.cp_rank = self.dims.coord(self.rank, "cp")

    def group(self, axis: str) -> dist.ProcessGroup:
        """The group of `axis` ("dp", "pp", "cp", "tp"), or "dp_cp": the ranks that hold the same
        parameters and so sum their gradients (data-parallel replicas x context-parallel peers)."""
        if axis == "dp_cp" and self.dims.cp == 1:
            axis = "dp"
        return self.mesh.get_group(axis)

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of the process at pipeline position `pp_rank` with our dp and tp coordinates."""
        return self.dims.moved(self.rank, pp=pp_rank)


def build_topology(dp: int, pp: int, tp: int, backend: str = "auto", timeout_s: float = 120.0, cp: int = 1) -> Topology:
    """Create (or reuse) the default process group and a (dp, pp, cp, tp) DeviceMesh whose every sub-group
    carries the same timeout."""
    backend, device_type = pick_backend(backend)
    init_process_group(backend, timeout_s)
    dims = ParallelDims(dp=dp, pp=pp, tp=tp, cp=cp, world_size=dist.get_world_size())
    mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)
    axes: tuple[str, ...] = AXES
    if cp > 1:  # gradients are summed over replicas and context-parallel peers alike
        mesh["dp", "cp"]._flatten("dp_cp")
        axes = (*AXES, "dp_cp")
    # DeviceMesh builds its sub-groups with c10d's default timeout (30 min for gloo), not the default
    # group's: set ours on each so that no collective can hang longer than asked.
    timeout = timedelta(seconds=timeout_s)
    for axis in axes:
        dist.distributed_c10d._set_pg_timeout(timeout, mesh.get_group(axis))
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    nodes = NodeMap.gather(device, dims)  # raises if tensor-parallel peers would span nodes
    return Topology(
        dims=dims, rank=dist.get_rank(), mesh=mesh, device=device, backend=backend, timeout_s=timeout_s, nodes=nodes
    )
