"""The launch recipes in docs/recipes parse: the Slurm batch script passes shellcheck (or, where shellcheck
is not installed, `bash -n`), the Kubernetes manifest is YAML of an elastic PyTorchJob, and the command
each one runs is a valid `hybridpar train` command line (torchrun's flags, then a config that validates,
with tp inside a node). Each starts the rendezvous store outside the training nodes (`hybridpar
rendezvous`, reachable by them) and makes every agent its client."""

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
from hybridpar.run.launcher import elastic_note
from hybridpar.run.preflight import preflight_config
from hybridpar.topology.nodes import tp_node_problem
from hybridpar.topology.rdzv_store import parse_rendezvous_args

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
    assert elastic_note(flags["--nnodes"], cfg.checkpoint.every) is None  # a lost node resumes, not restarts
    assert "is_host=false" in flags["--rdzv-conf"].split(",")  # every agent a client of the store
    return flags


@pytest.mark.multiprocess  # runs shellcheck / bash
def test_slurm_script() -> None:
    script = RECIPES / "slurm.sbatch"
    tool = ["shellcheck", "--shell=bash"] if shutil.which("shellcheck") else ["bash", "-n"]
    out = subprocess.run([*tool, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    text = script.read_text()
    head, _, training = text.partition("#SBATCH hetjob\n")  # the store's component, then the training nodes'
    assert training and "--gpus" not in head  # the store runs on a node of its own, with no GPU
    assert re.search(r"^#SBATCH --ntasks-per-node=1$", training, re.M)  # one agent per node
    sample = {"GPUS_PER_NODE": "8", "train_nodes": "2", "store_host": "n0", "RDZV_PORT": "29500"}
    sample |= {"SLURM_JOB_ID": "77", "RUN_DIR": "/shared/runs/x"}

    def command(start: str) -> list[str]:  # the command line that starts with `start`, sample values in
        line = text[text.index(f"\n{start}") + 1 :].replace("\\\n", " ").split("\n")[0]
        return shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda m: sample.get(m.group(1), m.group(0)), line))

    store = command("hybridpar rendezvous ")
    assert parse_rendezvous_args(store[2:-1]) == ("0.0.0.0", 29500) and store[-1] == "&"  # in the background
    assert text.index("\nhybridpar rendezvous ") < text.index("\nsrun ")  # started before the agents
    args = command("srun ")
    assert args[:5] == ["srun", "--het-group=1", "--kill-on-bad-exit=0", "hybridpar", "train"] and args[-1] == "$@"
    flags = check_command(args[5:-1])
    assert flags["--nnodes"] == "1:2" and flags["--rdzv-endpoint"] == "n0:29500" and flags["--rdzv-id"] == "77"
    assert re.search(r"^store_host=\$\(hostname\)$", text, re.M)  # this script's node: component 0's
    # Slurm requeues (--requeue) on preemption and node failure, not at the time limit: the script does,
    # when the agents come back with 143 (signalled and checkpointed), whose exit code it keeps.
    after = text[text.index("\nsrun ") :]
    assert "set +e" in text[: text.index("\nsrun ")] and re.search(r"^status=\$\?$", after, re.M)
    assert 'if [ "$status" -eq 143 ]; then\n  scontrol requeue "$SLURM_JOB_ID"' in after
    assert after.rstrip().endswith('exit "$status"')


def test_kubernetes_manifest() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((RECIPES / "pytorchjob.yaml").read_text())}
    assert sorted(docs) == ["Deployment", "PyTorchJob", "Service"]
    job, service, store = docs["PyTorchJob"], docs["Service"], docs["Deployment"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    elastic, worker = job["spec"]["elasticPolicy"], job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert elastic["rdzvBackend"] == "c10d" and elastic["minReplicas"] <= worker["replicas"] <= elastic["maxReplicas"]
    # Restarted on 128 and up (143: preempted, checkpointed), failed on 1 and 2 (a restart would repeat them).
    assert worker["restartPolicy"] == "ExitCode"
    (container,) = worker["template"]["spec"]["containers"]
    assert container["command"][:2] == ["hybridpar", "train"]
    flags = check_command(container["command"][2:])
    assert flags["--nnodes"] == f"{elastic['minReplicas']}:{elastic['maxReplicas']}"
    assert int(flags["--nproc-per-node"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/runs" in mounts and "/dev/shm" in mounts
    # The store: one pod of its own, behind the Service that the agents' endpoint names, never on a node
    # of the job's training pods.
    assert store["spec"]["replicas"] == 1
    pod = store["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (server,) = pod["spec"]["containers"]
    assert server["command"][:2] == ["hybridpar", "rendezvous"] and "nvidia.com/gpu" not in str(server)
    host, port = parse_rendezvous_args(server["command"][2:])
    (svc_port,) = service["spec"]["ports"]
    assert host == "0.0.0.0" and port == svc_port["targetPort"] == server["ports"][0]["containerPort"]
    assert flags["--rdzv-endpoint"] == f"{service['metadata']['name']}:{svc_port['port']}"
    (away,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert away["topologyKey"] == "kubernetes.io/hostname"
    assert away["labelSelector"]["matchLabels"] == {"training.kubeflow.org/job-name": job["metadata"]["name"]}
