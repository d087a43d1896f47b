"""Pure parts of recovery: the elastic re-plan policy, resume after a restart, the sample ledger, the fault
spec parser and the watchdog's verdict (no processes)."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybridpar.config import Config, parse_args
from hybridpar.emulate.faults import Fault, Injector, fired_ids, parse_faults
from hybridpar.pipeline.schedules import stages_per_rank
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.resilience import watchdog
from hybridpar.resilience.elastic import layout_for_world, replan, resume_mode
from hybridpar.resilience.session import add_step, ledger_stats
from hybridpar.resilience.watchdog import RankView, judge


def _layout(cfg: Config) -> tuple:
    p = cfg.parallel
    return p.tp, p.pp, p.dp, p.schedule, stages_per_rank(p), cfg.train.microbatches  # chunks: stages per rank


def test_replan_policy_keeps_tp_then_pp() -> None:
    cfg = Config()  # tp2 x pp2, 1F1B, 4 microbatches, global batch 16
    assert _layout(replan(cfg, 2)) == (2, 1, 1, "1f1b", 1, 4)  # shrink 4 -> 2: tp kept, pp gives way
    assert _layout(replan(cfg, 8)) == (2, 2, 2, "1f1b", 1, 4)  # grow: dp takes the rest
    assert _layout(replan(cfg, 6)) == (2, 1, 3, "1f1b", 1, 4)  # pp=2 does not divide 3
    assert _layout(replan(cfg, 1)) == (1, 1, 1, "1f1b", 1, 4)
    assert _layout(replan(cfg, 4)) == _layout(cfg)  # the same world: nothing changes
    assert replan(cfg, 2).train.global_batch == 16 and cfg.parallel.pp == 2  # input untouched


def test_replan_adapts_schedule_and_microbatches() -> None:
    cfg = parse_args(
        [
            "--parallel.tp",
            "1",
            "--parallel.pp",
            "4",
            "--parallel.schedule",
            "interleaved-1f1b",
            "--parallel.virtual_stages",
            "2",
            "--model.n_layers",
            "8",
            "--train.microbatches",
            "4",
        ]
    )
    assert _layout(replan(cfg, 2)) == (1, 2, 1, "interleaved-1f1b", 2, 4)  # still valid: kept
    assert _layout(replan(cfg, 1)) == (1, 1, 1, "1f1b", 1, 4)  # interleaved needs pp >= 2
    cfg = parse_args(
        [
            "--parallel.tp",
            "1",
            "--parallel.pp",
            "1",
            "--parallel.dp",
            "2",
            "--train.global_batch",
            "8",
            "--train.microbatches",
            "4",
            "--train.microbatch_sizes",
            "1,1,1,1",
        ]
    )
    new = replan(cfg, 4)  # 2 samples per replica now: fewer microbatches, explicit sizes dropped
    assert _layout(new) == (1, 1, 4, "1f1b", 1, 2) and new.train.microbatch_sizes is None
    tp3 = parse_args(["--parallel.tp", "4", "--parallel.pp", "1", "--model.n_heads", "4", "--model.dim", "128"])
    assert replan(tp3, 6).parallel.tp == 2  # 4 does not divide 6; 3 does not divide the heads; 2 does


def test_replan_refuses_what_cannot_work() -> None:
    cfg = parse_args(
        [
            "--train.global_batch",
            "2",
            "--train.microbatches",
            "1",
            "--parallel.tp",
            "1",
            "--parallel.pp",
            "1",
            "--parallel.dp",
            "1",
        ]
    )
    with pytest.raises(ValueError, match="no pipeline degree fits world=3"):
        replan(cfg, 3)  # dp=3 would leave a replica without a sample
    with pytest.raises(ValueError, match="world of 0"):
        replan(cfg, 0)


def test_restart_resumes_and_fresh_run_is_unchanged() -> None:
    cfg = Config()
    assert resume_mode(cfg, 0).checkpoint.resume == "off"  # a fresh run: as configured
    assert resume_mode(cfg, 2).checkpoint.resume == "auto" and cfg.checkpoint.resume == "off"
    cfg.resilience.resume_on_restart = False
    assert resume_mode(cfg, 2).checkpoint.resume == "off"
    cfg = Config()
    same, note = layout_for_world(cfg, 2, 0)
    assert note is None and same.parallel.pp == 2  # fresh run on another world: validate() will refuse it
    new, note = layout_for_world(cfg, 2, 1)  # restarted on 2 processes: resume and re-plan
    assert new.checkpoint.resume == "auto" and _layout(new)[:3] == (2, 1, 1)
    assert "tp=2 pp=2 dp=1 -> tp=2 pp=1 dp=1" in note and "global batch 16" in note
    cfg.resilience.replan = "off"
    assert layout_for_world(cfg, 2, 1)[0].parallel.pp == 2


def test_a_re_plan_is_printed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`hybridpar train`'s launcher prints the first attempt's re-plan; its rank 0 worker does not again,
    but does after a restart (a new world), and under plain torchrun (no launcher of ours)."""
    from hybridpar.resilience.rundir import LAUNCHER_ENV
    from hybridpar.run.train import notes_to_print

    note = ["hybridpar: elastic re-plan for 2 processes: ..."]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(LAUNCHER_ENV, "1234")
    assert notes_to_print(note, 0) == [] and notes_to_print(note, 1) == note
    monkeypatch.setenv("RANK", "1")
    assert notes_to_print(note, 1) == []
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(LAUNCHER_ENV)
    assert notes_to_print(note, 0) == note


def test_resilience_config_validation() -> None:
    validate_config(Config())
    for flags, message in [
        (
            ["--resilience.hang_timeout_s", "1", "--resilience.heartbeat_s", "1"],
            "resilience.hang_timeout_s=1.0 must be at least twice resilience.heartbeat_s=1.0",
        ),
        (["--resilience.hang_timeout_s", "-1"], "resilience.hang_timeout_s must be >= 0"),
        (["--resilience.max_restarts", "-2"], "resilience.max_restarts must be a non-negative"),
        (["--resilience.heartbeat_s", "0"], "resilience.heartbeat_s must be > 0"),
        (["--resilience.slow_phase_timeout_s", "10"], "slow_phase_timeout_s=10.0 must be at least"),
        (["--resilience.replan", "maybe"], "resilience.replan='maybe' is not one of auto, off"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            validate_config(parse_args(flags))
    validate_config(parse_args(["--resilience.hang_timeout_s", "0"]))  # 0 disables the watchdog


def test_sample_ledger() -> None:
    runs: list[list[int]] = []
    for s in (0, 1, 2):
        add_step(runs, s)
    assert runs == [[0, 3]]
    assert ledger_stats(runs, 3, 16) == {"lost_samples": 0, "duplicated_samples": 0}
    assert ledger_stats([[0, 2], [3, 4]], 4, 16) == {"lost_samples": 16, "duplicated_samples": 0}
    assert ledger_stats([[0, 3], [2, 4]], 4, 16) == {"lost_samples": 0, "duplicated_samples": 16}


def test_fault_spec(tmp_path: Path) -> None:
    faults = parse_faults(
        "rank=1:kill@step=3:phase=p2p, rank=0:sleep=2.5@step=1:phase=ckpt-write,"
        "rank=0:corrupt=pickle@step=4:phase=step-end,rank=2:stop@step=0",
        4,
    )
    assert faults[0] == Fault(1, "kill", 3, "p2p") and faults[1].arg == "2.5"
    assert str(faults[2]) == "rank=0:corrupt=pickle@step=4:phase=step-end" and faults[3].phase == "forward"
    assert parse_faults("") == []
    for spec, message in [
        ("rank=1:kill", "malformed"),
        ("rank=1:explode@step=1", "action 'explode'"),
        ("rank=1:kill@step=1:phase=lunch", "phase 'lunch'"),
        ("rank=9:kill@step=1", "rank 9"),
        ("rank=1:sleep@step=1", "sleep needs seconds"),
        ("rank=1:kill=3@step=1", "takes no value"),
        ("rank=1:corrupt=melt@step=1", "corrupt needs one of"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_faults(spec, 4)
    # Fired faults are recorded and skipped by the next attempt (a torn last line is ignored).
    first = "0:rank=0:sleep=0@step=1:phase=forward"
    (tmp_path / "chaos.jsonl").write_text(json.dumps({"id": first}) + '\n{"id": ')
    assert fired_ids(tmp_path / "chaos.jsonl") == {first}
    inj = Injector(
        parse_faults("rank=0:sleep=0@step=1,rank=0:sleep=0@step=2,rank=1:kill@step=1"), 0, tmp_path, tmp_path / "ck"
    )
    assert sorted(inj.pending) == [1]
    inj.check("forward", 2)
    assert fired_ids(tmp_path / "chaos.jsonl") == {first, "1:rank=0:sleep=0@step=2:phase=forward"}
    assert not inj.pending
    assert sorted(Injector(parse_faults("rank=0:sleep=0@step=2"), 0, tmp_path, tmp_path).pending) == [0]  # a new spec


def _views(*rows: tuple[float, float, bool]) -> list[RankView]:
    return [RankView(seen_beat=b, seen_seq=s, info={"slow": slow}) for b, s, slow in rows]


def test_watchdog_verdict() -> None:
    now, t, slow = 100.0, 5.0, 50.0
    assert judge(_views((99, 99, False), (99, 98, False)), now, t, slow) is None  # healthy
    culprit, why = judge(_views((99, 90, False), (93, 90, False)), now, t, slow)  # rank 1 froze
    assert culprit == 1 and "no heartbeat for 7.0 s" in why
    # Everybody alive, nobody progressing: the rank whose progress is oldest is the one the others wait on.
    culprit, why = judge(_views((99, 93, False), (99, 91, False), (99, 94, False)), now, t, slow)
    assert culprit == 1 and "no progress for 9.0 s" in why
    # One rank in a slow phase (a checkpoint write) keeps the run from being called hung...
    assert judge(_views((99, 60, True), (99, 90, False)), now, t, slow) is None
    # ...until the slow allowance is spent too; and a frozen rank is named whatever its phase.
    assert judge(_views((99, 40, True), (99, 90, False)), now, t, slow)[0] == 0
    assert judge(_views((90, 90, True), (99, 99, False)), now, t, slow)[0] == 0
    # A rank that finished is not waited for.
    done = _views((50, 50, False), (99, 99, False))
    done[0].info["done"] = True
    assert judge(done, now, t, slow) is None


def test_watchdog_names_the_computing_rank_not_its_waiting_peers() -> None:
    views = _views((99, 92, False), (99, 93, False))
    views[0].info["phase"], views[1].info["phase"] = "p2p", "forward"  # rank 1 hung computing, rank 0 waits on it
    assert judge(views, 100.0, 5.0, 50.0)[0] == 1


class _Store:
    """The two store calls a watchdog makes, in memory."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.kv[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.kv[k] for k in keys]


def test_unwatched_time() -> None:
    # Heartbeat 1 s: a look began at 10.0, the wait after it ended at 11.003 (a look of 3 ms): nothing lost;
    # one that ended at 71.0 was stopped for a minute, in the look or in the wait alike.
    assert watchdog.unwatched(1.0, 10.0, 11.003) == pytest.approx(0.003)
    assert watchdog.unwatched(1.0, 10.0, 71.0) == pytest.approx(60.0)
    assert watchdog.unwatched(1.0, 10.0, 10.5) == 0.0  # a wait cut short (the watchdog stopping)


@pytest.mark.parametrize("where", ["wait", "look"])
def test_a_watchdog_stopped_and_continued_goes_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str) -> None:
    """A process stopped for a minute (SIGSTOP, a paused machine) and continued is no hang: the watchdog
    does not count the time it did not run itself, whether the stop falls in its wait or inside one of
    its few-ms looks (here in its store write; such a stop was once counted as a minute with no progress),
    and still names a rank that then makes no progress."""
    offset = [0.0]  # seconds the process "was stopped", added to the clock the watchdog reads
    clock = SimpleNamespace(monotonic=lambda: time.monotonic() + offset[0], time=time.time)
    monkeypatch.setattr(watchdog, "time", clock)

    class StoppedInWait(threading.Event):  # the watcher spends its life in this wait
        stop_s = 0.0

        def wait(self, timeout: float | None = None) -> bool:
            ended = super().wait(timeout)
            if where == "wait":
                offset[0], self.stop_s = offset[0] + self.stop_s, 0.0
            return ended

    class StoppedInLook(_Store):
        def set(self, key: str, value: str) -> None:
            if where == "look":
                offset[0], stopped.stop_s = offset[0] + stopped.stop_s, 0.0
            super().set(key, value)

    def until(cond, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.01)

    fired: list[int] = []
    store = StoppedInLook()
    wd = watchdog.Watchdog(store, "w", 0, 1, 1.0, 1.0, 0.02, tmp_path, abort=fired.append)
    wd._stop = stopped = StoppedInWait()
    wd.mark("forward", 0)
    wd.start()
    until(lambda: json.loads(store.kv["w/0"])["beat"] >= 3)  # its second look: the first has seen step 0
    stopped.stop_s = 60.0  # its main thread stopped too: no progress in that minute
    until(lambda: offset[0] == 60.0)
    time.sleep(0.1)  # a few looks after it went on
    assert fired == [], "a watchdog called its own stop a hang"
    wd.mark("forward", 1)  # the main thread goes on, then makes no progress: named
    until(lambda: bool(fired))
    assert fired == [watchdog.EXIT_CODE]
    assert "rank 0 is hung: alive but no progress" in (tmp_path / "watchdog.jsonl").read_text()
    wd.stop(finished=False)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--emulate.fault", "rank=4:kill@step=1"], "rank 4 does not exist in a world of 4"),
        (["--emulate.fault", "rank=1:kill@step=1:phase=nap"], "phase 'nap' is not one of"),
        (
            [
                "--nproc-per-node",
                "3",
                "--resume",
                "auto",
                "--train.global_batch",
                "2",
                "--train.microbatches",
                "1",
                "--parallel.schedule",
                "gpipe",
            ],
            "no pipeline degree fits world=3",
        ),  # no valid re-plan: refused up front
        (["--nproc-per-node", "2"], "= 4, but 2 processes"),  # a fresh run on another world is still refused
    ],
)
def test_cli_refuses_bad_resilience_input_before_launch(argv, match, monkeypatch, capsys) -> None:
    import torch.distributed.run as tdr

    from hybridpar import cli

    monkeypatch.setattr(tdr, "run", lambda *a, **k: pytest.fail("a worker was launched for an invalid config"))
    assert cli.main(["train", *argv]) == 2
    assert match in capsys.readouterr().err
