"""Which ranks share a node, and the rule that follows: tensor-parallel peers, which exchange activations at
every layer, must share one; pipeline and data-parallel peers, which talk once per microbatch or per step,
may sit on different nodes.

torchrun's agents number the ranks of each node contiguously (node 0 gets 0..n-1, node 1 the next n, …)
and the layout numbers ranks (dp, pp, tp) with tp fastest (mesh.py), so tp stays inside a node exactly
when it divides the number of processes per node; `tp_node_problem` says so before any worker starts, and
`NodeMap.gather` checks the layout against the nodes the ranks really run on.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridpar.topology.collectives import all_gather_json

if TYPE_CHECKING:
    from hybridpar.topology.mesh import ParallelDims


def this_node() -> str:
    """This process's node: its torchrun agent (GROUP_RANK, which also tells apart several agents on one
    machine standing in for nodes), else its host name."""
    group = os.environ.get("GROUP_RANK")
    return f"agent-{group}" if group is not None else socket.gethostname()


def tp_node_problem(tp: int, procs_per_node: int) -> str | None:
    """Why `tp` cannot stay inside nodes of `procs_per_node` processes each (None if it can)."""
    if procs_per_node % tp == 0:
        return None
    return (
        f"parallel.tp={tp} does not divide the {procs_per_node} processes per node (--nproc-per-node): "
        f"tensor-parallel peers talk at every layer and must share a node; choose tp from "
        f"{[d for d in range(1, procs_per_node + 1) if procs_per_node % d == 0]} (pp and dp may span nodes)"
    )


def node_rank_problem(node_rank: str | None, nnodes: str) -> str | None:
    """Why `--node-rank` cannot name a node of `--nnodes` N (or MIN:MAX) nodes (None if it can, or is not
    given). torchrun takes any number, and a node rank of N or more then waits, as a client, for a node 0
    that the other nodes never make it: a hang instead of an error."""
    if node_rank is None:
        return None
    most = nnodes.rpartition(":")[2]
    if not most.isdigit():
        return None  # torchrun judges --nnodes itself
    if not node_rank.isdigit() or int(node_rank) >= int(most):
        return f"--node-rank {node_rank} is not a node of --nnodes {nnodes}: give 0 to {int(most) - 1}, one per node"
    return None


@dataclass(frozen=True)
class NodeMap:
    """node_of[rank] = the node index (0, 1, … in rank order) that rank runs on."""

    node_of: tuple[int, ...]

    @classmethod
    def from_names(cls, names: list[str]) -> NodeMap:
        index: dict[str, int] = {}
        return cls(tuple(index.setdefault(n, len(index)) for n in names))

    @classmethod
    def gather(cls, device: torch.device, dims: ParallelDims) -> NodeMap:
        """Collective: every rank's node; ValueError if a tensor-parallel group spans nodes."""
        nodes = cls.from_names(all_gather_json(this_node(), device))
        if (why := nodes.tp_problem(dims)) is not None:
            raise ValueError(why)
        return nodes

    @property
    def n_nodes(self) -> int:
        return len(set(self.node_of))

    def spans(self, dims: ParallelDims, axis: str) -> bool:
        """Whether some group along `axis` ('dp', 'pp', 'cp' or 'tp') has ranks on more than one node."""
        from hybridpar.topology.mesh import AXES

        k = AXES.index(axis)
        groups: dict[tuple[int, ...], set[int]] = {}
        for r in range(dims.world_size):
            c = dims.coords(r)
            groups.setdefault(c[:k] + c[k + 1 :], set()).add(self.node_of[r])
        return any(len(g) > 1 for g in groups.values())

    def tp_problem(self, dims: ParallelDims) -> str | None:
        if not self.spans(dims, "tp"):
            return None
        per_node = [self.node_of.count(n) for n in range(self.n_nodes)]
        return (
            f"parallel.tp={dims.tp} puts tensor-parallel peers on different nodes (processes per node: "
            f"{per_node}): tp must divide the processes of every node"
        )

    def describe(self, dims: ParallelDims) -> str:
        """E.g. '2 nodes: tp inside nodes; pp across nodes'."""
        across = [a for a in ("cp", "pp", "dp") if self.spans(dims, a)]
        return f"{self.n_nodes} nodes: tp inside nodes" + (f"; {', '.join(across)} across nodes" if across else "")
