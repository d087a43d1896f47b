"""Heartbeat watchdog: name a hung rank within `hang_timeout_s` and abort, instead of c10d's 30-minute wait.

Every rank runs one thread that, each `heartbeat_s`, (1) writes its beat to the c10d store — a counter,
the main thread's progress counter, phase and step, pid and host — and (2) reads every rank's beat. All
ages are measured on the reader's own monotonic clock ("when did I last see this value change"), so
clocks of different machines are never compared. Two rules, checked in this order:

- a rank whose beat has not changed for `hang_timeout_s` is frozen (SIGSTOP, dead, unreachable): it is
  named, killed if it lives on this host (so the elastic agent need not wait out its SIGTERM grace on a
  stopped process), and this rank aborts;
- when *no* rank has made progress for its allowance (`hang_timeout_s`, or `slow_phase_timeout_s` while
  a rank is in a phase marked slow: a checkpoint write, validation), the run is hung: a rank stuck
  outside a waiting phase (p2p, all-reduce, checkpoint barrier) is named first, the oldest progress
  breaking ties (the one the others wait on, e.g. the rank that never joined a collective), and this
  rank aborts.

Time this rank's own watcher did not run is not counted in any age: the process stopped (SIGSTOP, a
paused machine) and continued knows nothing of its peers for that time, and judged on it a group stopped
and continued would abort itself at its first look instead of going on (or checkpointing a SIGTERM that
came meanwhile, which a launcher admitting a node sends to stopped workers). Such time is all that passed
between the beginnings of two looks beyond the heartbeat (`unwatched`): a stop falls in the wait, or in
a look (its store calls or its verdict). An age thus counts the heartbeats waited, not a look's own
milliseconds; a store slow to answer delays a verdict by its slowness, never forever (each look adds a
heartbeat), and a store that fails is counted in full (`resilience.hang_timeout_s` of failures ends it).

Aborting = a JSON line appended to `<report_dir>/watchdog.jsonl`, one line on stderr naming the rank, its
last phase and step, and `os._exit(EXIT_CODE)`: the elastic agent sees a failed worker and restarts the
group (resilience.max_restarts), which resumes from the newest verified checkpoint.

The store is a separate client connection (not the process group's), so a main thread blocked inside a
store operation cannot delay the beats.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

EXIT_CODE = 70  # EX_SOFTWARE: distinct from a Python error (1) and a bad config (2)
WAIT_PHASES = frozenset({"p2p", "all-reduce", "ckpt-barrier"})  # phases that wait on peers


@dataclass
class RankView:
    """What one watcher knows about one rank, with times on the watcher's clock."""

    beat: int = -1
    seq: int = -1
    seen_beat: float = 0.0
    seen_seq: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


def discount(views: list[RankView], seconds: float) -> None:
    """Leave `seconds` the watcher did not run out of every age: each rank is last seen that much later."""
    for v in views:
        v.seen_beat += seconds
        v.seen_seq += seconds


def unwatched(heartbeat_s: float, since: float, now: float) -> float:
    """Seconds from `since` (the last look's beginning; after a failed look, the wait's) to `now` (the end
    of the wait) that the watcher did not watch: all beyond the heartbeat it waited (module docstring)."""
    return max(0.0, now - since - heartbeat_s)


def judge(views: list[RankView], now: float, timeout_s: float, slow_timeout_s: float) -> tuple[int, str] | None:
    """Pure decision: (culprit rank, why) if the run is hung, else None. See the module docstring."""
    live = [(r, v) for r, v in enumerate(views) if not v.info.get("done")]  # a finished rank beats no more
    if not live:
        return None
    frozen = [(now - v.seen_beat, r) for r, v in live if now - v.seen_beat > timeout_s]
    if frozen:
        age, r = max(frozen)
        return r, f"no heartbeat for {age:.1f} s (frozen, stopped or dead)"

    def allowance(v: RankView) -> float:
        return slow_timeout_s if v.info.get("slow") else timeout_s

    if all(now - v.seen_seq > allowance(v) for _, v in live):
        # Suspects first: a rank stuck computing, not one waiting for a message or a collective (whose
        # peer is the problem); among them the one whose progress is oldest.
        suspects = [(r, v) for r, v in live if v.info.get("phase") not in WAIT_PHASES] or live
        age, r = max((now - v.seen_seq, r) for r, v in suspects)
        return r, f"alive but no progress for {age:.1f} s while the other ranks wait"
    return None


class Watchdog:
    """Start with `start()`, report the main thread's progress with `mark(phase, step)`, end with `stop()`."""

    def __init__(
        self,
        store: Any,
        key_prefix: str,
        rank: int,
        world: int,
        timeout_s: float,
        slow_timeout_s: float,
        heartbeat_s: float,
        report_dir: Path,
        abort: Callable[[int], None] = os._exit,
    ) -> None:
        self.store, self.prefix, self.rank, self.world = store, key_prefix, rank, world
        self.timeout_s, self.slow_timeout_s, self.heartbeat_s = timeout_s, slow_timeout_s, heartbeat_s
        self.report_dir, self._abort = Path(report_dir), abort
        # Setup (building stages, loading a checkpoint) may be slow on a loaded machine: watched as slow.
        self.phase, self.step, self.slow, self.seq = "setup", -1, True, 0
        self._beat, self._done = 0, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridpar-watchdog", daemon=True)
        self.host, self.pid = socket.gethostname(), os.getpid()

    def mark(self, phase: str, step: int | None = None, slow: bool = False) -> None:
        """Called by the main thread at every phase change; cheap (no I/O)."""
        self.phase, self.slow = phase, slow
        if step is not None:
            self.step = step
        self.seq += 1

    def start(self) -> "Watchdog":
        self.publish()
        self._thread.start()
        return self

    def stop(self, finished: bool = True) -> None:
        """Stop beating. `finished`: tell the watchers this rank completed (its silence is then no alarm);
        after a failure it is not said, so the peers still name this rank if they are left waiting."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.heartbeat_s + 5)
        if finished:
            self.phase, self._done = "done", True
            try:
                self.publish()
            except Exception:  # the store may already be gone at the very end of a run
                pass

    def _key(self, r: int) -> str:
        return f"{self.prefix}/{r}"

    def publish(self) -> None:
        self._beat += 1
        self.store.set(
            self._key(self.rank),
            json.dumps(
                {
                    "beat": self._beat,
                    "seq": self.seq,
                    "phase": self.phase,
                    "step": self.step,
                    "slow": self.slow,
                    "done": self._done,
                    "pid": self.pid,
                    "host": self.host,
                }
            ),
        )

    def _read(self, views: list[RankView], now: float) -> None:
        keys = [self._key(r) for r in range(self.world)]
        present = [k for k in keys if self.store.check([k])]
        for k, raw in zip(present, self.store.multi_get(present) if present else []):
            r = int(k.rsplit("/", 1)[1])
            info = json.loads(bytes(raw).decode())
            v = views[r]
            if info["beat"] != v.beat:
                v.beat, v.seen_beat = info["beat"], now
            if info["seq"] != v.seq:
                v.seq, v.seen_seq = info["seq"], now
            v.info = info

    def _run(self) -> None:
        t0 = time.monotonic()
        views = [RankView(seen_beat=t0, seen_seq=t0) for _ in range(self.world)]
        store_ok, look = t0, t0  # look: when the last look began (None after a failed one)
        while True:
            asleep = time.monotonic()
            if self._stop.wait(self.heartbeat_s):
                return
            now = time.monotonic()
            # Stopped or starved of CPU in the wait or in the last look (module docstring); after a failed
            # look only the wait's overrun: time blocked on a store that is gone is what store_ok counts.
            if (lost := unwatched(self.heartbeat_s, look if look is not None else asleep, now)) > 0:
                discount(views, lost)
                store_ok += lost
            look = now
            try:
                self.publish()
                self._read(views, now)
                store_ok = now
            except Exception as e:  # store unreachable: the agent (or rank 0 hosting it) is gone
                look = None
                if now - store_ok > self.timeout_s:
                    self._fire(self.rank, f"the c10d store has been unreachable for {now - store_ok:.1f} s ({e})", {})
                    return
                continue
            if self._stop.is_set():
                return
            verdict = judge(views, now, self.timeout_s, self.slow_timeout_s)
            if verdict is not None:
                culprit, why = verdict
                self._fire(culprit, why, views[culprit].info)
                return

    def _fire(self, culprit: int, why: str, info: dict[str, Any]) -> None:
        phase, step = info.get("phase", "?"), info.get("step", "?")
        msg = (
            f"hybridpar: watchdog on rank {self.rank}: rank {culprit} is hung: {why}; its last phase was "
            f"{phase!r} at step {step} (resilience.hang_timeout_s={self.timeout_s:g}); aborting"
        )
        report = {
            "detected_by": self.rank,
            "culprit": culprit,
            "reason": why,
            "phase": phase,
            "step": step,
            "time": time.time(),
            "message": msg,
        }
        try:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.report_dir / "watchdog.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, ("\n" + json.dumps(report) + "\n").encode())  # one write: lines never interleave
            finally:
                os.close(fd)
        except OSError:
            pass
        print(msg, file=sys.stderr, flush=True)
        # A frozen process on this host would make the agent wait out its SIGTERM grace period: end it.
        if culprit != self.rank and "no heartbeat" in why and info.get("host") == self.host and info.get("pid"):
            try:
                os.kill(int(info["pid"]), signal.SIGKILL)
            except OSError:
                pass
        self._abort(EXIT_CODE)


def start_watchdog(
    rank: int, world: int, run_id: str, cfg: Any, report_dir: Path, master: tuple[str, int]
) -> Watchdog | None:
    """A started watchdog per `cfg` (a ResilienceConfig) on its own client of the store at `master`
    (host, port), keys under `run_id`; None when resilience.hang_timeout_s is 0."""
    if not cfg.hang_timeout_s:
        return None
    import torch.distributed as dist

    store = dist.TCPStore(
        master[0], master[1], is_master=False, timeout=timedelta(seconds=max(5.0, cfg.heartbeat_s * 3))
    )
    return Watchdog(
        store,
        f"hybridpar/watchdog/{run_id}",
        rank,
        world,
        cfg.hang_timeout_s,
        cfg.slow_phase_timeout_s,
        cfg.heartbeat_s,
        report_dir,
    ).start()
