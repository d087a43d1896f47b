"""The launch recipes in docs/recipes parse: the Slurm batch script passes shellcheck (or, where shellcheck
is not installed, `bash -n`), the Kubernetes manifest is YAML of an elastic PyTorchJob, and the command
each one runs is a valid `hybridpar train` command line (torchrun's flags, then a config that validates,
with tp inside a node)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from hybridpar.cli import split_argv
from hybridpar.config import parse_args
from hybridpar.run.preflight import preflight_config
from hybridpar.topology.nodes import tp_node_problem

RECIPES = Path(__file__).resolve().parent.parent / "docs" / "recipes"


def check_command(args: list[str]) -> dict[str, str]:
    """torchrun's flags of a `hybridpar train` command line (asserting that ours make a valid config)."""
    theirs, ours = split_argv(args)
    cfg = parse_args(ours)
    preflight_config(cfg)
    flags = {}
    for i, a in enumerate(theirs):
        if a.startswith("--"):
            key, _, val = a.partition("=")
            flags[key] = val or theirs[i + 1]
    assert tp_node_problem(cfg.parallel.tp, int(flags["--nproc-per-node"])) is None
    assert cfg.checkpoint.resume == "auto" and flags["--rdzv-backend"] == "c10d"
    return flags


@pytest.mark.multiprocess  # runs shellcheck / bash
def test_slurm_script() -> None:
    script = RECIPES / "slurm.sbatch"
    tool = ["shellcheck", "--shell=bash"] if shutil.which("shellcheck") else ["bash", "-n"]
    out = subprocess.run([*tool, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    text = script.read_text()
    assert re.search(r"^#SBATCH --ntasks-per-node=1$", text, re.M)  # one agent per node
    # The srun line with sample values for the job's variables.
    line = text[text.index("srun ") :].replace("\\\n", " ")
    sample = {"SLURM_JOB_NUM_NODES": "2", "GPUS_PER_NODE": "8", "head_node": "n0", "RDZV_PORT": "29500"}
    sample |= {"SLURM_JOB_ID": "77", "RUN_DIR": "/shared/runs/x"}
    line = re.sub(r"\$\{?(\w+)\}?", lambda m: sample.get(m.group(1), m.group(0)), line.split("\n")[0])
    args = shlex.split(line)
    assert args[:4] == ["srun", "--kill-on-bad-exit=0", "hybridpar", "train"] and args[-1] == "$@"
    flags = check_command(args[4:-1])
    assert flags["--nnodes"] == "1:2" and flags["--rdzv-endpoint"] == "n0:29500" and flags["--rdzv-id"] == "77"


def test_kubernetes_manifest() -> None:
    docs = list(yaml.safe_load_all((RECIPES / "pytorchjob.yaml").read_text()))
    assert len(docs) == 1
    job = docs[0]
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    elastic, worker = job["spec"]["elasticPolicy"], job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert elastic["rdzvBackend"] == "c10d" and elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    (container,) = worker["template"]["spec"]["containers"]
    assert container["command"][:2] == ["hybridpar", "train"]
    flags = check_command(container["command"][2:])
    assert flags["--nnodes"] == f"{elastic['minReplicas']}:{elastic['maxReplicas']}"
    assert int(flags["--nproc-per-node"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    assert flags["--rdzv-endpoint"].split(":")[1] == str(container["ports"][0]["containerPort"])
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/runs" in mounts and "/dev/shm" in mounts
