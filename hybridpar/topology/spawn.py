"""The one spawn helper for multi-process tests (and benchmarks): start N ranks on loopback, bound the
whole run by a deadline, and turn any rank's failure or a hang into an exception in the caller.

A rank returns a JSON-serialisable value (tensors go through files that the caller names), so nothing
is unpickled from a worker. Each rank runs with one intra-op thread: several ranks share few cores.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, out: str, parent: int, args: tuple) -> None:
    from hybridpar.topology.lifetime import die_with_parent

    # A caller killed outright (a bench stopped with SIGTERM, a test run cut off) takes its ranks with it.
    if not die_with_parent(parent):
        os._exit(1)
    from hybridpar.topology.rendezvous import set_loopback_rank_env

    set_loopback_rank_env(rank, world, port)  # the caller hosts the store, bound to loopback
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
    """Run `fn(*args)` in `world` fresh processes (spawn) forming one torch.distributed world through
    env:// on a store this process hosts on 127.0.0.1. Returns each rank's return value. Raises RuntimeError
    with the failing rank's
    traceback, or TimeoutError (after killing every rank) if the deadline passes."""
    from hybridpar.topology.rendezvous import loopback_store

    ctx = mp.get_context("spawn")
    store = loopback_store(0)
    port = store.port
    with tempfile.TemporaryDirectory(prefix="hybridpar-ranks-") as out:
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, port, out, os.getpid(), args), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
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
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
        errors = sorted(Path(out).glob("rank*.err"))
        if errors:
            # The error written first is the cause; the others are usually peers losing their connection to it.
            first = min(errors, key=lambda e: e.stat().st_mtime_ns)
            also = [e.stem for e in errors if e != first]
            raise RuntimeError(
                f"{first.stem} failed" + (f" (then {', '.join(also)})" if also else "") + f":\n{first.read_text()}"
            )
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"ranks exited abnormally (rank, exit code): {bad}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
