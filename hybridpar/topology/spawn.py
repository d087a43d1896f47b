"""The one spawn helper for multi-process tests (and benchmarks): start N ranks on loopback, bound the
whole run by a deadline, and turn any rank's failure or a hang into an exception in the caller.

Ranks are forked from a fork server, a process of its own that imported torch and the training code once
(with one BLAS thread, so it runs no thread a fork would copy without running) and has done no torch work:
a fresh interpreter per rank spent about 3 s of CPU importing them, which a suite of a few hundred
launches on two cores paid for minutes. Each rank still starts from that clean state, in the caller's
environment and working directory, as a spawned one would.

A rank returns a JSON-serialisable value (tensors go through files that the caller names), so nothing
is unpickled from a worker. Each rank runs with one intra-op thread: several ranks share few cores.

A rank that dies natively (a segfault, glibc aborting on a corrupted heap, a kill from outside) writes
no Python error; its peers then fail on the lost connection, and their errors would hide the cause. So
each rank runs with `faulthandler` writing every thread's Python stack to a file of its own at the fatal
signal, and the error raised names the rank that died, the signal, and that trace first (`failure`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing as mp
import multiprocessing.forkserver
import os
import signal
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

# What every rank imports, loaded once in the fork server (torch._dynamo: the first model built pulls it in).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "hybridpar.run.train",
    "hybridpar.run.launcher",
    "hybridpar.topology.rendezvous",
]


def origin() -> dict[str, Any]:
    """What a process forked from the fork server needs from its caller (`enter`): the caller's pid, the
    server's pid, the caller's environment and its standard output and error now."""
    return {
        "caller": os.getpid(),
        "server": getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
        "env": dict(os.environ),
        "stdio": _Stdio(),  # taken over as the child unpickles it: its fds 1 and 2 become the caller's
    }


class _Stdio:
    """The caller's file descriptors 1 and 2 as they are when a process is started (a test's capture file,
    a log the caller redirected to), handed to the child as the same open files, as a spawned child would
    inherit them: the fork server's own are those of whoever started it, earlier."""

    def __reduce__(self) -> tuple:
        from multiprocessing.reduction import DupFd

        return (_take_stdio, (DupFd(1), DupFd(2)))


def _take_stdio(out: Any, err: Any) -> None:
    for fd, handed in ((1, out.detach()), (2, err.detach())):
        os.dup2(handed, fd)
        os.close(handed)


def enter(origin: dict[str, Any]) -> None:
    """First thing in a process forked from the fork server: die with the caller, take its environment.
    Exits at once if the caller is already gone."""
    from hybridpar.topology.lifetime import die_with, die_with_parent

    # A caller killed outright (a bench stopped with SIGTERM, a test run cut off) takes its processes
    # along: each watches it (the server, their parent, also exits then, but only once its interpreter has
    # finished, tens of seconds on loaded cores). Each process the server forks is handed the caller's
    # end of the pipe whose closing tells the server to exit (so that a child could ask it for processes
    # in turn): ours never do, and holding it would keep the server alive after the caller.
    if not (die_with_parent(origin["server"]) and die_with(origin["caller"])):
        os._exit(1)
    alive = multiprocessing.forkserver._forkserver._forkserver_alive_fd
    if alive is not None:
        os.close(alive)
        multiprocessing.forkserver._forkserver._forkserver_alive_fd = None
    # The caller's environment now, not the server's from when it started; over it, what this process set
    # since its fork (torch's elastic agent sets each worker's RANK, WORLD_SIZE, ... before calling it).
    since = set_since_fork()
    os.environ.clear()
    os.environ.update(origin["env"])
    os.environ.update(since)


def set_since_fork() -> dict[str, str]:
    """The environment variables this process (forked from the fork server) holds other than the server was
    started with: Linux keeps a process's initial environment in /proc/self/environ, which a forked child
    shares with its parent. Where there is no procfs, every variable counts as set here."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return dict(os.environ)
    started = dict(kv.split("=", 1) for kv in os.fsdecode(raw).split("\0") if "=" in kv)
    return {k: v for k, v in os.environ.items() if started.get(k) != v}


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, out: str, origin: dict, args: tuple) -> None:
    enter(origin)
    from hybridpar.topology.rendezvous import set_loopback_rank_env

    set_loopback_rank_env(rank, world, port)  # the caller hosts the store, bound to loopback
    fault = Path(out, f"rank{rank}.fault").open("w")  # open until os._exit: faulthandler writes it at a crash
    # Every Python thread's stack: a crash in a C++ thread (gloo's workers) still shows where Python was.
    faulthandler.enable(fault, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        result = fn(*args)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is on disk and the group destroyed: skip interpreter finalisation, where gloo's worker
    # threads can still abort the process ("terminate called without an active exception",
    # pytorch/pytorch#190489) after everything succeeded.
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """Run `fn(*args)` in `world` fresh processes (forked from the fork server) forming one torch.distributed
    world through env:// on a store this process hosts on 127.0.0.1. Returns each rank's return value. Raises
    RuntimeError with the failing rank's traceback, or TimeoutError (after killing every rank) if the deadline
    passes."""
    from hybridpar.topology.rendezvous import loopback_store

    ctx = fork_server()
    store = loopback_store(0)
    port = store.port
    with tempfile.TemporaryDirectory(prefix="hybridpar-ranks-") as out:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, port, out, origin(), args), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        codes: dict[int, int | None] = {}
        try:
            while any(p.is_alive() for p in procs):
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed:
                    time.sleep(1.0)  # let the others notice and write their errors, then report the first
                    break
                if time.monotonic() > deadline:
                    alive = [r for r, p in enumerate(procs) if p.is_alive()]
                    raise TimeoutError(f"ranks {alive} of {world} still running after {timeout_s:.0f} s: killed")
                time.sleep(0.05)
        finally:
            codes = {r: p.exitcode for r, p in enumerate(procs)}  # before any is killed here (None: running)
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        error = failure(Path(out), codes)
        if error:
            raise RuntimeError(error)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def failure(out: Path, codes: dict[int, int | None]) -> str | None:
    """What went wrong in a launch, from the ranks' files in `out` and each rank's exit code when the launch
    stopped (negative: killed by that signal; None: still running then, killed by the helper afterwards):
    None if every rank returned. A rank that died natively comes first, with its fault trace: its peers'
    errors (a gloo "Connection reset by peer") are the consequence. Then the first Python error written."""
    lines = []
    names = {s.value: s.name for s in signal.Signals}
    for r, code in sorted(codes.items()):
        if code in (None, 0) or (out / f"rank{r}.err").exists():
            continue
        trace = (out / f"rank{r}.fault").read_text().strip() if (out / f"rank{r}.fault").exists() else ""
        how = f"died by {names.get(-code, f'signal {-code}')}" if code < 0 else f"exited with status {code}"
        what = f"its stacks at the signal:\n{trace}" if trace else "no fault trace (killed from outside?)"
        lines.append(f"rank{r} {how} without a Python error; {what}")
    errors = sorted(out.glob("rank*.err"), key=lambda e: e.stat().st_mtime_ns)
    if errors:
        # The error written first is the cause; the others are usually peers losing their connection to it.
        also = f" (then {', '.join(e.stem for e in errors[1:])})" if errors[1:] else ""
        lines.append(f"{'then ' if lines else ''}{errors[0].stem} failed{also}:\n{errors[0].read_text()}")
    return "\n".join(lines) or None


def fork_server() -> Any:
    """The multiprocessing context of this process's fork server, started (once) with PRELOAD loaded and one
    BLAS thread. A process it starts calls `enter(origin())` first."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with environ(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"):
        multiprocessing.forkserver.ensure_running()
    return ctx


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Environment variables set for the processes started inside (and restored after)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
