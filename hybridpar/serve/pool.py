"""The worker processes of a serving deployment: dp × pp × tp ranks forming one torch.distributed
world on loopback (a store this process hosts, as `testing.run_ranks` does for tests), one replica per
dp group. Each replica's driver is connected to this process by a pipe carrying JSON; a reader
thread per replica hands its events (tokens, completions, status) to `on_event`.

Liveness is watched per worker, not per replica: a watcher thread waits on every worker's process
sentinel, so the death of any rank — a pipeline stage behind the driver included, whose loss the
driver itself would notice only when its next wait timed out (`--timeout-s`, 120 s by default) —
marks its replica dead at once. The replica's other workers are then stopped (nothing can finish
without the dead one; left alone they would sit in their waits until that timeout), and
`{"type": "replica_failed"}` is reported once, so the caller fails or re-places that replica's
requests instead of waiting. `failures` names each dead worker (reported by /health).

Workers never outlive this process: they are forked from the fork server that topology/spawn.py keeps
(no fresh interpreter importing torch per worker) and each watches this process (`spawn.enter`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from hybridpar.serve.worker import WorkerSpec
from hybridpar.topology.spawn import fork_server, origin


def _worker(spec_d: dict[str, Any], rank: int, world: int, port: int, conn: Connection | None, origin: dict) -> None:
    from hybridpar.topology.spawn import enter

    enter(origin)  # before anything slow: the server may be killed while we start
    from hybridpar.topology.rendezvous import set_loopback_rank_env

    set_loopback_rank_env(rank, world, port)
    import torch.distributed as dist

    from hybridpar.serve.channel import PipeChannel
    from hybridpar.serve.worker import serve_rank
    from hybridpar.topology.cpus import bind_local_rank

    bind_local_rank("none", rank, world)  # the replicas' ranks share the cores
    try:
        serve_rank(spec_d, PipeChannel(conn) if conn is not None else None)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown (gloo threads, see topology/spawn.py)


class ReplicaPool:
    def __init__(
        self, spec: WorkerSpec, on_event: Callable[[int, dict[str, Any]], None], start_timeout_s: float = 300.0
    ) -> None:
        from hybridpar.topology.rendezvous import loopback_store

        self.spec, self.on_event = spec, on_event
        self.n = spec.dp
        self.per_replica = spec.pp * spec.tp  # global rank r is in replica r // per_replica, its driver first
        world = spec.dp * self.per_replica
        self._store = loopback_store(0)  # kept alive for the workers' rendezvous
        ctx = fork_server()  # replicas start without importing torch again (topology/spawn.py)
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self.alive = [True] * self.n
        self.failures: list[dict[str, Any]] = []  # each worker that died of itself (not stopped by us)
        self.ready = [threading.Event() for _ in range(self.n)]
        self._locks = [threading.Lock() for _ in range(self.n)]
        self._state = threading.Lock()
        self._closing = False
        self._dead: set[int] = set()  # replicas reported dead
        self._stopped: set[int] = set()  # ranks killed because another worker of their replica died
        child_ends: dict[int, Connection] = {}
        for d in range(self.n):
            ours, theirs = ctx.Pipe(duplex=True)
            self.conns.append(ours)
            child_ends[d * self.per_replica] = theirs
        try:
            for rank in range(world):
                p = ctx.Process(
                    target=_worker,
                    daemon=True,
                    args=(dataclasses.asdict(spec), rank, world, self._store.port, child_ends.get(rank), origin()),
                )
                self.procs.append(p)  # before start: interrupted inside start(), it is still stopped below
                p.start()
            threading.Thread(target=self._watch, daemon=True, name="hybridpar-serve-watch").start()
            for d in range(self.n):
                threading.Thread(target=self._read, args=(d,), daemon=True, name=f"hybridpar-serve-read{d}").start()
            deadline = time.monotonic() + start_timeout_s
            for d in range(self.n):  # a replica is ready once its driver sent its first status
                while not self.ready[d].wait(0.2):
                    if not self.alive[d] or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"replica {d} did not start ({self._why(d) or f'{start_timeout_s:.0f} s passed'})"
                        )
        except BaseException:  # a failed start, or SIGTERM / Ctrl-C while starting: stop every worker now
            self._closing = True
            self._kill(self.procs)
            raise

    def _why(self, d: int) -> str:
        return "; ".join(
            f"worker rank {f['rank']} (stage {f['stage']}, tp rank {f['tp_rank']}) exited with " f"code {f['exitcode']}"
            for f in self.failures
            if f["replica"] == d
        )

    def _watch(self) -> None:
        """Wait on every worker's sentinel (readable once the process has exited: no polling). This
        thread alone reaps workers while the pool runs: two threads reaping one process race (the
        loser sees no exit code)."""
        left = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while left and not self._closing:
            for s in wait(list(left)):
                rank = left.pop(s)
                if self._closing:
                    return
                d = rank // self.per_replica
                p = self.procs[rank]
                p.join(1)  # reaps it: the sentinel fired, so this returns at once with its exit code
                with self._state:
                    if rank not in self._stopped:  # it died of itself, not stopped by us after another one
                        self.failures.append(
                            {
                                "replica": d,
                                "rank": rank,
                                "stage": (rank // self.spec.tp) % self.spec.pp,
                                "tp_rank": rank % self.spec.tp,
                                "exitcode": p.exitcode,
                            }
                        )
                self._replica_dead(d)

    def _replica_dead(self, d: int) -> None:
        """Replica `d` is dead (reported once): the caller takes it out of routing, then it reads as
        dead (`alive`, /health), then its remaining workers are stopped."""
        with self._state:
            if d in self._dead:
                return
            self._dead.add(d)
        if not self._closing:
            self.on_event(d, {"type": "replica_failed"})
        self.alive[d] = False
        ranks = range(d * self.per_replica, (d + 1) * self.per_replica)
        running = [r for r in ranks if not wait([self.procs[r].sentinel], 0)]
        with self._state:
            self._stopped.update(running)
        self._kill([self.procs[r] for r in running], reap=False)

    def _driver_gone(self, d: int) -> None:
        """Replica `d`'s pipe broke, which happens as its driver exits: wait for that exit to complete,
        so that the driver counts among the workers that died of themselves, not those stopped after."""
        wait([self.procs[d * self.per_replica].sentinel], 5)
        self._replica_dead(d)

    def _read(self, d: int) -> None:
        conn = self.conns[d]
        while True:
            try:
                ev = json.loads(conn.recv_bytes().decode())
            except (EOFError, OSError):
                break
            self.ready[d].set()
            self.on_event(d, ev)
        self._driver_gone(d)

    def send(self, d: int, msg: dict[str, Any]) -> bool:
        if not self.alive[d]:
            return False
        try:
            with self._locks[d]:
                self.conns[d].send_bytes(json.dumps(msg).encode())
            return True
        except (OSError, ValueError):
            self._driver_gone(d)
            return False

    @staticmethod
    def _kill(procs: list[Any], reap: bool = True) -> None:
        """SIGKILL `procs` and wait (5 s at most) until they have exited; `reap` them too unless the
        watcher does."""
        started = [p for p in procs if p.pid is not None]
        for p in started:
            if not wait([p.sentinel], 0):
                p.kill()
        deadline = time.monotonic() + 5
        for p in started:
            if reap:
                p.join(max(0.0, deadline - time.monotonic()))
            else:
                wait([p.sentinel], max(0.0, deadline - time.monotonic()))

    def close(self, timeout_s: float = 20.0) -> None:
        """Ask every driver to stop (each passes STOP down its pipeline), then reap the processes;
        whatever has not exited by `timeout_s` (or when this is interrupted) is killed."""
        self._closing = True  # workers exiting from here on are expected: the watcher stops reaping
        for d in range(self.n):
            self.send(d, {"type": "stop"})
        deadline = time.monotonic() + timeout_s
        try:
            for p in self.procs:
                p.join(max(0.1, deadline - time.monotonic()))
        finally:
            self._kill(self.procs)
