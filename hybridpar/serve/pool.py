"""The worker processes of a serving deployment: dp × pp × tp ranks forming one torch.distributed
world on loopback (a store this process hosts, as `testing.run_ranks` does for tests), one replica per
dp group. Each replica's driver is connected to this process by a pipe carrying JSON; a reader
thread per replica hands its events (tokens, completions, status) to `on_event`.

A replica whose process dies is marked dead: its reader sees the pipe close and reports
`{"type": "replica_failed"}` so the caller can fail that replica's requests instead of waiting.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

from hybridpar.serve.worker import WorkerSpec, spec_dict


def _worker(spec_d: dict[str, Any], rank: int, world: int, port: int, conn: Connection | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True")
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
    os._exit(0)  # skip interpreter teardown (gloo threads, see testing.py)


class ReplicaPool:
    def __init__(self, spec: WorkerSpec, on_event: Callable[[int, dict[str, Any]], None],
                 start_timeout_s: float = 300.0) -> None:
        from hybridpar.topology.rendezvous import loopback_store

        self.spec, self.on_event = spec, on_event
        self.n = spec.dp
        world = spec.dp * spec.pp * spec.tp
        self._store = loopback_store(0)  # kept alive for the workers' rendezvous
        ctx = mp.get_context("spawn")
        drivers = {d * spec.pp * spec.tp: d for d in range(spec.dp)}  # global rank of (dp=d, pp=0, tp=0)
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self.alive = [True] * self.n
        self.ready = [threading.Event() for _ in range(self.n)]
        self._locks = [threading.Lock() for _ in range(self.n)]
        child_ends: dict[int, Connection] = {}
        for rank, d in sorted(drivers.items()):
            ours, theirs = ctx.Pipe(duplex=True)
            self.conns.append(ours)
            child_ends[rank] = theirs
        for rank in range(world):
            p = ctx.Process(target=_worker, args=(spec_dict(spec), rank, world, self._store.port, child_ends.get(rank)),
                            daemon=True)
            p.start()
            self.procs.append(p)
        self._readers = [threading.Thread(target=self._read, args=(d,), daemon=True) for d in range(self.n)]
        for t in self._readers:
            t.start()
        deadline = time.monotonic() + start_timeout_s
        for d in range(self.n):  # a replica is ready once its driver sent its first status
            while not self.ready[d].wait(0.2):
                if not self.alive[d] or time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in self.procs):
                    self.close()
                    raise RuntimeError(f"replica {d} did not start (a worker exited or {start_timeout_s:.0f} s passed)")

    def _read(self, d: int) -> None:
        conn = self.conns[d]
        while True:
            try:
                ev = json.loads(conn.recv_bytes().decode())
            except (EOFError, OSError):
                break
            self.ready[d].set()
            self.on_event(d, ev)
        self.alive[d] = False
        self.on_event(d, {"type": "replica_failed"})

    def send(self, d: int, msg: dict[str, Any]) -> bool:
        if not self.alive[d]:
            return False
        try:
            with self._locks[d]:
                self.conns[d].send_bytes(json.dumps(msg).encode())
            return True
        except (OSError, ValueError):
            self.alive[d] = False
            return False

    def close(self, timeout_s: float = 20.0) -> None:
        """Ask every driver to stop (each passes STOP down its pipeline), then reap the processes."""
        for d in range(self.n):
            self.send(d, {"type": "stop"})
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
