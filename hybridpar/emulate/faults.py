"""Fault injection: a named TESTING mode (`--emulate.fault`), off by default, that makes a chosen rank fail
in a chosen way at a chosen step and phase — so that recovery is tested on the real code paths.

Grammar (whitespace ignored)::

    spec   := "" | entry ("," entry)*
    entry  := "rank=" INT ":" ACTION "@step=" INT [":phase=" PHASE]      # phase defaults to forward
    ACTION := kill | stop | raise | exit0 | term | hang | sleep=SECONDS | corrupt=KIND
    KIND   := flip | truncate | delete | mix | pickle

- kill: SIGKILL this rank; stop: SIGSTOP it (frozen: the watchdog must name it); raise: an exception in
  the rank; exit0: `sys.exit(0)` in the middle of training (a rank that "succeeds" early); term: SIGTERM
  (preemption); hang: the main thread blocks forever while its process stays alive (a collective its
  peers wait on never starts); sleep=S: a slow phase that must *not* be called a hang.
- corrupt=KIND damages the newest committed checkpoint (flip a bit in its largest shard, truncate it,
  delete it, replace it with the same file of the previous checkpoint — a checkpoint mixed from two
  steps —, or replace DCP's `.metadata` with a pickle that would run code when unpickled), then kills
  the rank: the restart must fall back to the previous checkpoint, naming the file, running nothing.

Phases (PHASES) are the injection points of the trainer: forward (a stage's forward, training only),
p2p (posting or waiting for a pipeline message), all-reduce (the data-parallel gradient reduction),
optimizer (before AdamW steps), step-end, validate, and the phases of a checkpoint write: ckpt-write
(before this rank's shards are written), ckpt-barrier (written, not yet agreed), ckpt-manifest (rank 0:
trainer state written, manifest not), ckpt-rename (manifest written, not committed), ckpt-done
(committed, older ones not yet pruned). The run entry builds the `Injector` (attach.py) and hands it to the
resilience session, whose probe (resilience/probe.py) calls `check` at each of these phases: the trainer and
the session never import this module.

Each fault fires once per run directory: before acting, the rank appends it to `<run_dir>/chaos.jsonl`
(fsynced), and a restarted worker skips faults listed there — otherwise a resumed run would meet the same
fault again forever.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ACTIONS = ("kill", "stop", "raise", "exit0", "term", "hang", "sleep", "corrupt")
CORRUPTIONS = ("flip", "truncate", "delete", "mix", "pickle")
CKPT_PHASES = ("ckpt-write", "ckpt-barrier", "ckpt-manifest", "ckpt-rename", "ckpt-done")
PHASES = ("forward", "p2p", "all-reduce", "optimizer", "step-end", "validate", *CKPT_PHASES)
EXPECTED_FORM = "rank=<int>:<action>@step=<int>[:phase=<phase>], e.g. 'rank=1:kill@step=3:phase=forward'"
_ENTRY = re.compile(r"rank=(\d+):([a-z0-9]+)(?:=([A-Za-z0-9.]+))?@step=(\d+)(?::phase=([a-z0-9-]+))?")


class InjectedFault(RuntimeError):
    """The exception raised by `raise`."""


@dataclass(frozen=True)
class Fault:
    rank: int
    action: str
    step: int
    phase: str = "forward"
    arg: str | None = None  # sleep seconds, corruption kind

    def __str__(self) -> str:
        act = self.action + (f"={self.arg}" if self.arg is not None else "")
        return f"rank={self.rank}:{act}@step={self.step}:phase={self.phase}"


def parse_faults(spec: str, world_size: int | None = None) -> list[Fault]:
    """Parse `emulate.fault`; ValueError naming the entry and what is expected."""
    faults: list[Fault] = []
    for raw in (e.strip() for e in spec.replace(" ", "").split(",")):
        if not raw:
            continue
        m = _ENTRY.fullmatch(raw)
        if not m:
            raise ValueError(f"emulate.fault entry {raw!r} is malformed: expected {EXPECTED_FORM}")
        rank, action, arg, step, phase = int(m[1]), m[2], m[3], int(m[4]), m[5] or "forward"
        if action not in ACTIONS:
            raise ValueError(f"emulate.fault entry {raw!r}: action {action!r} is not one of {', '.join(ACTIONS)}")
        if phase not in PHASES:
            raise ValueError(f"emulate.fault entry {raw!r}: phase {phase!r} is not one of {', '.join(PHASES)}")
        if action == "sleep":
            if arg is None or not re.fullmatch(r"\d+(\.\d+)?", arg):
                raise ValueError(f"emulate.fault entry {raw!r}: sleep needs seconds, e.g. sleep=5")
        elif action == "corrupt":
            if arg not in CORRUPTIONS:
                raise ValueError(f"emulate.fault entry {raw!r}: corrupt needs one of {', '.join(CORRUPTIONS)}")
        elif arg is not None:
            raise ValueError(f"emulate.fault entry {raw!r}: action {action!r} takes no value")
        if world_size is not None and rank >= world_size:
            raise ValueError(f"emulate.fault entry {raw!r}: rank {rank} does not exist in a world of {world_size}")
        faults.append(Fault(rank, action, step, phase, arg))
    return faults


def fault_id(index: int, fault: Fault) -> str:
    """A fault's identity in the ledger: its position in the spec and the fault itself (so another spec
    used in the same run directory later does not inherit what an earlier one fired)."""
    return f"{index}:{fault}"


def fired_ids(ledger: Path) -> set[str]:
    """Ids (`fault_id`) of the faults already fired in this run directory."""
    if not ledger.is_file():
        return set()
    out = set()
    for line in ledger.read_text(encoding="utf-8").splitlines():
        try:
            out.add(str(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a kill while being written: that fault had not acted yet
    return out


class Injector:
    """This rank's pending faults; `check(phase, step)` fires the matching one."""

    def __init__(self, faults: list[Fault], rank: int, run_dir: Path, ckpt_dir: Path) -> None:
        self.ledger, self.ckpt_dir, self.rank = Path(run_dir) / "chaos.jsonl", Path(ckpt_dir), rank
        done = fired_ids(self.ledger)
        self.pending = {i: f for i, f in enumerate(faults) if f.rank == rank and fault_id(i, f) not in done}
        # Called just before a fault acts (the probe publishes a heartbeat), so that what the watchdog
        # reports as the rank's last phase is the phase the fault was injected in, not one beat earlier.
        self.before_fault: Callable[[], None] = lambda: None

    def check(self, phase: str, step: int) -> None:
        for i, f in list(self.pending.items()):
            if f.phase == phase and f.step == step:
                del self.pending[i]
                self._record(i, f)
                self.before_fault()
                self._act(f)

    def _record(self, i: int, f: Fault) -> None:
        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(
            {"id": fault_id(i, f), "fault": str(f), "rank": self.rank, "pid": os.getpid(), "time": time.time()}
        )
        fd = os.open(self.ledger, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, ("\n" + line + "\n").encode())  # the leading newline ends a line torn by a kill
            os.fsync(fd)
        finally:
            os.close(fd)
        print(f"hybridpar: chaos (testing mode): injecting {f}", file=sys.stderr, flush=True)

    def _act(self, f: Fault) -> None:
        if f.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif f.action == "raise":
            raise InjectedFault(f"injected fault {f}")
        elif f.action == "exit0":
            sys.exit(0)
        elif f.action == "hang":
            while True:
                time.sleep(3600)
        elif f.action == "sleep":
            time.sleep(float(f.arg or 0))
        elif f.action == "corrupt":
            corrupt_newest(self.ckpt_dir, f.arg or "flip")
            os.kill(os.getpid(), signal.SIGKILL)


def corrupt_newest(root: Path, kind: str) -> Path | None:
    """Damage the newest committed checkpoint under `root` (see the module docstring); the damaged file."""
    from hybridpar.resilience.commits import DCP_METADATA, committed

    found = committed(root)
    if not found:
        return None
    newest = found[0][1]
    if kind == "pickle":
        target = newest / DCP_METADATA
        # The bytes of pickle protocol 0 calling os.system: unpickling it would create the file.
        bomb = b"cos\nsystem\n(S'touch " + str(root / "PWNED").encode() + b"'\ntR."
        target.write_bytes(bomb.ljust(target.stat().st_size, b" "))
        return target
    target = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    if kind == "delete":
        target.unlink()
    elif kind == "truncate":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif kind == "mix" and len(found) > 1 and (older := found[1][1] / target.name).is_file():
        target.write_bytes(older.read_bytes())
    else:  # flip (and mix without an older checkpoint to mix from)
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x10
        target.write_bytes(bytes(data))
    return target
