"""`--node-rank` outside `--nnodes` is refused before anything starts (no processes). torchrun takes it,
and the node then waits as a client for a node 0 the others never make it (static rendezvous): seen as a
launch that printed its data line and hung until killed."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpar.cli import main
from hybridpar.topology.nodes import node_rank_problem


@pytest.mark.parametrize("rank,nnodes", [(None, "2"), ("0", "2"), ("1", "2"), ("3", "2:4"), ("0", "1")])
def test_node_ranks_of_the_job_pass(rank: str | None, nnodes: str) -> None:
    assert node_rank_problem(rank, nnodes) is None


@pytest.mark.parametrize("rank,nnodes", [("2", "2"), ("5", "2"), ("-1", "2"), ("x", "2"), ("4", "1:4")])
def test_other_node_ranks_are_named(rank: str, nnodes: str) -> None:
    why = node_rank_problem(rank, nnodes)
    assert why is not None and f"--node-rank {rank} is not a node of --nnodes {nnodes}" in why


def test_train_refuses_it_before_claiming_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    argv = ["train", "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "--master-port", "1"]
    assert main([*argv, "--run-dir", str(run)]) == 2
    assert "give 0 to 1, one per node" in capsys.readouterr().err and not run.exists()
