"""One run per directory: who owns a run directory, and what state the run is in.

A run directory holds one run, named by a run id in `<run_dir>/run.json`. Checkpoints record the run
id that wrote them (manifest.json and trainer_state.json), so `--resume auto` takes only its own run's
checkpoints and pruning deletes only its own. A fresh run into a directory that holds another run is
refused unless `--overwrite` (which deletes that run's files first); resuming continues the run id found.

The launcher (`hybridpar train`, `hybridpar.launch`) holds an exclusive `flock` on
`<run_dir>/.hybridpar.lock` for the whole run and writes a random token into it; its workers get the
token in their environment (`HYBRIDPAR_RUN_TOKEN`) and, before each checkpoint commit, check that the
lock is still held and still carries their token. So a second launcher on the same directory is refused
at once, and a worker whose launcher died cannot commit over a newer launch's work. Under plain
torchrun (no token), rank 0 takes the lock itself for the life of the worker.

`run.json` also carries the run's state (running, finished, preempted, failed) written by the workers,
from which the launcher derives its exit code (see `exit_code`), and marks a failure that would repeat on
restart (configuration, data, shape: `permanent`), so restarted workers end at once instead of retrying.
Several nodes (`hybridpar train --nnodes N`, one launcher per node on one shared run directory): each
launcher holds a *shared* flock instead, and the lock file names the run's launch key (torchrun's
rendezvous backend, id and endpoint, the same on every node of one job; see `claim_node`). The first
launcher claims the directory as above and writes the key; a launcher with the same key joins (same run
id, same token), also after a node was lost and comes back; a launcher with another key, or a single-node
launch, is refused while any node holds the directory. flock is advisory and, on some network
filesystems, per host: there it does not exclude a launcher on another machine (the run id check still
refuses another run's checkpoints), but it always does among launchers of one machine.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUN_FILE, LOCK_FILE = "run.json", ".hybridpar.lock"
TOKEN_ENV = "HYBRIDPAR_RUN_TOKEN"
LAUNCHER_ENV = "HYBRIDPAR_LAUNCHER_PID"  # the launcher each worker must die with (its node's, see train.py)
FORMAT = "hybridpar-run/1"
# Exit codes of `hybridpar train` and what they mean to a scheduler (documented in the README).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_PREEMPTED = 0, 1, 2, 143
# What a run writes into its directory, deleted by --overwrite (never anything else of the user's).
# final_model.pt is what runs before the final/ directory wrote.
RUN_OUTPUTS = (
    "metrics.jsonl",
    "resilience.jsonl",
    "watchdog.jsonl",
    "chaos.jsonl",
    "config.toml",
    "train.log",
    "final",
    "final_model.pt",
    RUN_FILE,
)
CHECKPOINT_PREFIXES = ("step-", ".tmp-step-", ".old-step-", "abandoned-step-")


def read_run(run_dir: Path) -> dict[str, Any] | None:
    """The run record of `run_dir`, or None if there is none. A damaged one raises ValueError."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} is damaged ({e}); move the run directory aside or pass --overwrite") from None
    if not isinstance(rec, dict) or rec.get("format") != FORMAT or not isinstance(rec.get("run_id"), str):
        raise ValueError(f"{path} is not a {FORMAT} record; move the run directory aside or pass --overwrite")
    return rec


def write_run(run_dir: Path, rec: dict[str, Any]) -> None:
    """Replace `run.json` atomically (a crash leaves the old record or the new one, never half of one)."""
    path = Path(run_dir) / RUN_FILE
    tmp = path.with_name(f".{RUN_FILE}.{secrets.token_hex(4)}")
    with tmp.open("w", encoding="utf-8") as fh:
        json.dump(rec, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace the file `path` by `text` atomically (a reader sees the old file or the new one)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a write cut short leaves nothing behind
        raise


def checkpoint_run_id(ckpt: Path) -> str | None:
    """The run id recorded in a checkpoint's manifest (None: unreadable, or written before run ids)."""
    try:
        m = json.loads((Path(ckpt) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return m.get("run_id") if isinstance(m, dict) and isinstance(m.get("run_id"), str) else None


def _checkpoint_entries(ck_dir: Path) -> list[Path]:
    if not ck_dir.is_dir():
        return []
    return sorted(p for p in ck_dir.iterdir() if p.name.startswith(CHECKPOINT_PREFIXES))


def check_path_is_dir(key: str, path: Path) -> None:
    """`path` is a directory, or can be created as one (its nearest existing ancestor is a writable dir)."""
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{key}={str(path)!r} is a file, not a directory: choose another {key}")
        return
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{key}={str(path)!r} cannot be created: {str(parent)!r} is not a writable directory")


def plan_claim(run_dir: Path, ck_dir: Path, resume: str, overwrite: bool) -> str:
    """Decide, without changing anything, what a launch does with `run_dir`: 'new', 'continue' or
    'overwrite'. Raises ValueError when a fresh run would mix with another run's files."""
    check_path_is_dir("run_dir", run_dir)
    check_path_is_dir("checkpoint.dir", ck_dir)
    rec = None if overwrite else read_run(run_dir)
    if overwrite:
        return "overwrite"
    if rec is not None:
        if resume == "off":
            raise ValueError(
                f"run_dir={str(run_dir)!r} holds run {rec['run_id']} ({rec.get('state', 'unknown')} at step "
                f"{rec.get('step', 0)}): pass --resume auto to continue it, --overwrite to replace it, or "
                f"another --run-dir"
            )
        return "continue"
    # No run record, yet another run's records: a fresh run would overwrite some (metrics.jsonl) and append
    # to others (resilience.jsonl; chaos.jsonl, whose faults would then count as fired already).
    if left := [n for n in RUN_OUTPUTS if (run_dir / n).exists()]:
        raise ValueError(
            f"run_dir={str(run_dir)!r} holds another run's {', '.join(left)} but no {RUN_FILE}: pass "
            f"--overwrite to delete them, or choose another --run-dir"
        )
    # No run record: any committed checkpoint here belongs to another run (or predates run ids).
    foreign = [p for p in _checkpoint_entries(ck_dir) if p.name.startswith("step-")]
    if foreign and resume in ("off", "auto"):
        raise ValueError(
            f"checkpoint.dir={str(ck_dir)!r} holds checkpoints of another run ({foreign[-1].name}, run "
            f"{checkpoint_run_id(foreign[-1]) or 'without a run id'}) but run_dir={str(run_dir)!r} records "
            f"none: resume one explicitly with --resume <checkpoint path>, pass --overwrite to delete them, "
            f"or choose another --run-dir / --checkpoint.dir"
        )
    return "new"


def _remove_outputs(run_dir: Path, ck_dir: Path) -> list[str]:
    gone = []
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        gone.append(name)
    for p in _checkpoint_entries(ck_dir):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
        gone.append(p.name)
    return gone


@dataclass
class RunClaim:
    """A held run directory: the lock's file descriptor (closed by `release`), the run id and the token."""

    run_dir: Path
    run_id: str
    token: str
    fd: int | None
    note: str | None = None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None


def _holder(fd: int) -> dict[str, Any]:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _in_use(run_dir: Path, holder: dict[str, Any]) -> ValueError:
    nodes = " (a launch of several nodes)" if holder.get("key") else ""
    return ValueError(
        f"run_dir={str(run_dir)!r} is in use by another launch{nodes} (pid {holder.get('pid', '?')} on "
        f"{holder.get('host', '?')}): wait for it to end, stop it, or choose another --run-dir"
    )


def _lock(run_dir: Path, token: str, key: str | None = None) -> int:
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise _in_use(run_dir, holder) from None
    os.ftruncate(fd, 0)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "token": token, **({"key": key} if key else {})}
    os.pwrite(fd, json.dumps(info).encode(), 0)
    return fd


def claim(run_dir: Path, ck_dir: Path, resume: str, overwrite: bool, key: str | None = None) -> RunClaim:
    """Take `run_dir` for one launch (see the module docstring); ValueError if it is taken or holds another
    run. `key`: the launch key of a run of several nodes, written into the lock for `claim_node`."""
    run_dir, ck_dir = Path(run_dir), Path(ck_dir)
    mode = plan_claim(run_dir, ck_dir, resume, overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    fd = _lock(run_dir, token, key)
    try:
        note = None
        if mode == "overwrite":
            gone = _remove_outputs(run_dir, ck_dir)
            note = f"hybridpar: --overwrite: removed {len(gone)} entries of the previous run" if gone else None
        rec = read_run(run_dir) if mode == "continue" else None
        run_id = rec["run_id"] if rec else secrets.token_hex(6)
        launches = (rec or {}).get("launches", [])
        write_run(
            run_dir,
            {
                **(rec or {"format": FORMAT, "run_id": run_id, "created": time.time()}),
                "launches": [*launches, launch_record()] if isinstance(launches, list) else [launch_record()],
                "state": "running",
                "launch": token,
                "error": None,
                "permanent": False,
                "updated": time.time(),
            },
        )
    except BaseException:
        os.close(fd)
        raise
    return RunClaim(run_dir, run_id, token, fd, note)


def claim_node(run_dir: Path, ck_dir: Path, resume: str, overwrite: bool, key: str, wait_s: float = 30.0) -> RunClaim:
    """Take `run_dir` for one node of a launch of several (module docstring): the first node with `key`
    claims it as `claim` does, the others join that claim; another key or a single-node launch holding the
    directory is a ValueError. Every node then holds the lock shared until it ends."""
    run_dir = Path(run_dir)
    deadline = time.monotonic() + wait_s
    while True:
        joined = _join(run_dir, key)
        if isinstance(joined, RunClaim):
            return joined
        if joined is None:  # nobody holds the directory: claim it as the first node
            try:
                c = claim(run_dir, ck_dir, resume, overwrite, key)
            except ValueError:
                if time.monotonic() > deadline or not _held(run_dir):
                    raise
                continue  # another node claimed it first: join that claim
            # On Linux a downgrade lets no other lock in between (fs/locks.c converts under one spinlock).
            fcntl.flock(c.fd, fcntl.LOCK_SH)
            return c
        if time.monotonic() > deadline:
            raise TimeoutError(f"run_dir={str(run_dir)!r}: the first node did not finish claiming it in {wait_s:.0f} s")
        time.sleep(0.1)  # the first node of this launch is still claiming


def _held(run_dir: Path) -> bool:
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _join(run_dir: Path, key: str) -> RunClaim | str | None:
    """Join the launch holding `run_dir` if it has launch key `key`: a RunClaim holding the lock shared;
    None if nobody holds it; 'wait' if the first node of this launch is still claiming it."""
    if not _held(run_dir):
        # (A launch that ends between this probe and the lock below would leave a stale holder to join:
        # that needs every node of it to exit within microseconds and a new launch with the same key.)
        return None
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # held exclusively: a single-node launch, or the first node still claiming
        holder = _holder(fd)
        os.close(fd)
        # No holder written yet: a claim between its lock and its pwrite (`_lock`), maybe this launch's
        # first node; refusing here would leave that node waiting for this one at the rendezvous.
        if not holder or holder.get("key") == key:
            return "wait"
        raise _in_use(run_dir, holder) from None
    holder = _holder(fd)
    try:
        rec = read_run(run_dir) if holder.get("key") == key else None
    except ValueError:
        rec = None
    if rec is None or rec.get("launch") != holder.get("token"):
        os.close(fd)
        raise _in_use(run_dir, holder)
    return RunClaim(run_dir, rec["run_id"], holder["token"], fd)


def launch_record() -> dict[str, Any]:
    """What started this launch, for the run record: the command line as typed (`hybridpar train ...`,
    `torchrun ...` or the script calling `launch`), where and when, and the versions that ran it."""
    import platform
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for dist in ("hybridpar", "torch", "numpy", "safetensors", "tokenizers"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:  # run from a source tree, or an optional package
            versions[dist] = None
    return {
        "command": list(sys.orig_argv),
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "started": time.time(),
        "versions": versions,
    }


def set_aside(run_dir: Path) -> Path | None:
    """Move the finished or stopped run in `run_dir` to a sibling `run-<run id>` directory (for the default
    run directory only, so the plain `hybridpar train` can be run again without losing the last run).
    None, and nothing moved, if there is no run record or a launch holds the directory."""
    run_dir = Path(run_dir)
    rec = read_run(run_dir)
    if rec is None:
        return None
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # in use: the claim refuses it with the holder named
        dest = run_dir.with_name(f"run-{rec['run_id']}")
        if dest.exists():
            return None
        os.rename(run_dir, dest)
        return dest
    finally:
        os.close(fd)


def lock_info(run_dir: Path) -> dict[str, Any]:
    """What the launcher wrote into the lock file (pid, host, token); {} if unreadable."""
    try:
        info = json.loads((Path(run_dir) / LOCK_FILE).read_text(encoding="utf-8") or "{}")
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def record_state(run_dir: Path, token: str, **fields: Any) -> bool:
    """Set fields of run.json (state, step, error, ...) if it still belongs to launch `token`; a worker of
    an older launch never overwrites a newer launch's record. Returns whether it was written."""
    try:
        rec = read_run(run_dir)
    except ValueError:
        return False
    if rec is None or rec.get("launch") != token:
        return False
    write_run(run_dir, {**rec, **fields, "updated": time.time()})
    return True


def lock_holder_ok(run_dir: Path, token: str) -> str | None:
    """None if `run_dir`'s lock is held and carries `token` (our launcher is alive and still owns the
    directory); otherwise why not."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        return f"{path} is gone ({e.strerror})"
    try:
        try:
            # Exclusive probe: it fails while any launcher holds the lock, exclusively (one node) or
            # shared (the nodes of one run).
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None if _holder(fd).get("token") == token else "another launch now owns the run directory"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return "the launcher that started this worker is gone (its lock is released)"
    finally:
        os.close(fd)


def exit_code(run_dir: Path, token: str) -> tuple[int, str | None]:
    """The launcher's exit code from the state its workers recorded for launch `token`, and a line to
    print: finished 0, preempted (checkpointed) 143, a failure that would repeat 2, anything else 1."""
    try:
        rec = read_run(run_dir)
    except ValueError as e:
        return EXIT_FAILED, str(e)
    if rec is None or rec.get("launch") != token:
        return EXIT_FAILED, None
    state = rec.get("state")
    if state == "finished":
        return EXIT_OK, None
    if state == "preempted":
        return EXIT_PREEMPTED, None
    if state == "failed" and rec.get("permanent"):
        return EXIT_USAGE, rec.get("error")
    return EXIT_FAILED, rec.get("error")
