"""A node that joins a running elastic job resumes with the survivors (no processes). Its agent has not
restarted (TORCHELASTIC_RESTART_COUNT 0) while theirs has, so a worker that judged by its own agent's count
started the run afresh beside survivors resuming a checkpoint: the two halves called different
collectives and waited for each other until parallel.timeout_s (seen with the command of
docs/multi-node.md, which does not pass --checkpoint.resume auto). The rendezvous round, which every node
of a round shares, decides instead (topology/rendezvous.py). And an elastic launch that writes no
checkpoints is warned: its survivors start over from step 0."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybridpar.config import Config
from hybridpar.resilience.rundir import TOKEN_ENV
from hybridpar.run.launcher import elastic_note
from hybridpar.run.train import enter_worker
from hybridpar.topology.rendezvous import ATTEMPT_ENV, ROUND_ENV, _each_round, job_restarts


class _Store:
    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.keys[key]


def _handler(round_: int) -> SimpleNamespace:
    """What `_each_round` reads of torch's DynamicRendezvousHandler: its shared state's round."""
    state = SimpleNamespace(round=round_)
    return SimpleNamespace(_bootstrap_store_info="stale", _state_holder=SimpleNamespace(state=state))


def test_each_round_hands_the_round_to_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROUND_ENV, raising=False)
    monkeypatch.delenv(ATTEMPT_ENV, raising=False)
    store = _Store()
    handler = _handler(3)
    info = SimpleNamespace(rank=0, store=store)
    assert _each_round(handler, lambda: info)() is info
    assert os.environ[ROUND_ENV] == "3" and os.environ[ATTEMPT_ENV] == store.keys["hybridpar/attempt"].decode()
    assert handler._bootstrap_store_info is None  # rebuilt every round (the rule it was written for)


@pytest.mark.parametrize(
    "own,round_,want",
    [
        ("0", None, 0),  # a first start under torch's own backends
        ("2", None, 2),  # one agent restarted twice (no round handed over)
        ("0", "0", 0),  # the job's first round
        ("0", "2", 2),  # a node joining a job in its third round: not a fresh start
        ("1", "2", 2),  # the survivor of the same round agrees
    ],
)
def test_job_restarts_is_the_jobs_not_the_agents(
    monkeypatch: pytest.MonkeyPatch, own: str, round_: str | None, want: int
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", own)
    if round_ is None:
        monkeypatch.delenv(ROUND_ENV, raising=False)
    else:
        monkeypatch.setenv(ROUND_ENV, round_)
    assert job_restarts() == want


def _worker_config(monkeypatch: pytest.MonkeyPatch, own: str, round_: str, tmp: str) -> Config:
    """The config a worker of the default layout (4 processes) runs, as `enter_worker` sees its agent's
    environment (no launcher token: plain torchrun's worker)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", own)
    monkeypatch.setenv(ROUND_ENV, round_)
    cfg = Config()
    cfg.run_dir = tmp
    return enter_worker(cfg)[0]


def test_the_joining_node_resumes_as_the_survivors_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    first = _worker_config(monkeypatch, "0", "0", str(tmp_path))
    survivor = _worker_config(monkeypatch, "1", "2", str(tmp_path))
    newcomer = _worker_config(monkeypatch, "0", "2", str(tmp_path))
    assert first.checkpoint.resume == "off"  # a fresh run stays fresh
    assert survivor.checkpoint.resume == newcomer.checkpoint.resume == "auto"


def test_an_elastic_launch_without_checkpoints_is_warned() -> None:
    warning = elastic_note("1:2", 0)
    assert warning is not None and "--checkpoint.every" in warning and "step 0" in warning
    assert elastic_note("1:2", 50) is None  # the survivors resume from a checkpoint
    assert elastic_note("2", 0) is None and elastic_note("2:2", 0) is None  # not elastic: a lost node ends it
