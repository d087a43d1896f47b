"""An agent's side of the standalone rendezvous store (`hybridpar rendezvous`, topology/rdzv_store.py):
a store client that survives the store's restart.

A TCPStore client does not reconnect: once its server is gone every operation fails ("Broken pipe"),
even after a new server listens on the same port. `ReconnectingStore` wraps one and, on a lost
connection, connects again (waiting up to its timeout for the store to come back) and repeats the
operation. The restarted store is empty, so two things are put back (`restore_rendezvous`):
- the null state that torch's c10d backend expects under its key (it writes it once, at start; a get
  of a missing key would block until the timeout);
- the rendezvous state itself, written back by the first agent to reconnect from its own last copy
  (members, round, waiting nodes), each member's heartbeat set to now: an empty state would let a node
  that joins next form a round of its own beside the one training (two runs writing one directory), and
  heartbeats as old as the outage would make the agents drop every member, themselves included.
  A node that died during the outage stops sending heartbeats and is dropped as usual, after
  keep_alive_interval x keep_alive_max_attempt seconds.
"""

from __future__ import annotations

import sys
import threading
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

import torch.distributed as dist


class StoreLost(RuntimeError):
    """The standalone store did not answer again within the timeout."""


def connect(host: str, port: int, timeout_s: float, again: bool = False) -> dist.TCPStore:
    """A client of the store at host:port; StoreLost if none answers within `timeout_s` (a client's
    connection is retried until then: this also waits for a store that is starting or restarting).
    `again`: the store answered before (the message says so)."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, TimeoutError) as e:
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if "Ping failed" in str(e):  # torch's handshake got another answer: a port some other server holds
            raise StoreLost(
                f"{where} answers, but not as a rendezvous store (torch's store handshake got another reply): "
                "another program holds the port; give --rdzv-endpoint the port hybridpar rendezvous listens on, "
                "or a free one"
            ) from e
        what = "stopped answering and did not come back" if again else "did not answer"
        then = "again (the workers were stopped and checkpoint if they can)" if again else "first"
        raise StoreLost(
            f"the rendezvous store at {where} {what} within {timeout_s:g} s (--rdzv-conf read_timeout): start "
            f"it {then} with hybridpar rendezvous --port {port}, then the agents with --checkpoint.resume auto"
        ) from e


def _behind(e: BaseException | None, kind: type[BaseException]) -> BaseException | None:
    """The `kind` error behind `e` (torch wraps errors in its rendezvous errors), if any."""
    while e is not None and not isinstance(e, kind):
        e = e.__cause__ or e.__context__
    return e


def store_lost(e: BaseException | None) -> StoreLost | None:
    """The StoreLost behind `e`, if any."""
    lost = _behind(e, StoreLost)
    return lost if isinstance(lost, StoreLost) else None


def store_error_line(e: BaseException, endpoint: str | None) -> str | None:
    """The line a launcher prints when its agent ended because the rendezvous store at `endpoint` could not
    be reached, or its nodes did not all come within the join timeout, or None: a standalone store that did
    not come back says so itself (StoreLost); any other lost connection is a store that died with its host,
    a training agent, unless none answered at all."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    if lost := store_lost(e):
        return f"hybridpar: error: {lost}"
    if _behind(e, RendezvousTimeoutError):  # torch says nothing; the launcher said "training failed"
        return (
            "hybridpar: error: the rendezvous did not gather its nodes within --rdzv-conf join_timeout (600 s "
            "unless set): a node was lost, or never started, and a job of --nnodes N waits for all N; start "
            "the missing node's agent within that time, or make the job elastic (--nnodes MIN:MAX); then "
            "continue with --checkpoint.resume auto"
        )
    if endpoint is None or not _behind(e, RendezvousConnectionError):  # no endpoint: its agent hosts the store
        return None
    return (
        f"hybridpar: error: the rendezvous store at {endpoint} cannot be reached: if a training agent hosted "
        "it, that agent's node is gone and the job with it (run the store outside the training nodes: "
        "hybridpar rendezvous --help); continue with --checkpoint.resume auto"
    )


class ReconnectingStore(dist.Store):
    """A client of the TCPStore at host:port that connects again when the connection is lost (the store
    restarted) and repeats the operation. `on_reconnect` hooks run with the new connection first.
    Operations wait as long as this store's timeout (`set_timeout`, as PrefixStore and torch's barrier
    set it), and so does a reconnection."""

    def __init__(self, host: str, port: int, timeout_s: float, inner: dist.TCPStore | None = None) -> None:
        super().__init__()
        self.host, self.port = host, port
        self.where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.set_timeout(timedelta(seconds=timeout_s))
        self.generation = 0  # connections made after the first: how often the store came back
        self.on_reconnect: list[Callable[[dist.TCPStore], None]] = []
        self._lock = threading.Lock()
        self._lost: StoreLost | None = None  # a reconnection that failed: the next ones fail at once
        self._inner = inner if inner is not None else connect(host, port, timeout_s)

    def _connect(self) -> dist.TCPStore:
        return connect(self.host, self.port, self.timeout.total_seconds(), again=True)

    def _reconnect(self, seen: int) -> None:
        with self._lock:
            if self.generation != seen:
                return  # another thread has reconnected meanwhile
            if self._lost is not None:
                raise self._lost  # another thread waited the whole timeout already
            try:
                inner = self._connect()
            except StoreLost as e:
                self._lost = e
                raise
            for hook in self.on_reconnect:
                hook(inner)
            self._inner = inner
            self.generation += 1
        print(f"hybridpar: the rendezvous store at {self.where} restarted: reconnected", file=sys.stderr, flush=True)

    def _call(self, op: str, *args: Any) -> Any:
        seen, inner = self.generation, self._inner
        inner.set_timeout(self.timeout)
        try:
            return getattr(inner, op)(*args)
        except dist.DistNetworkError:  # connection lost; a timeout (DistStoreError) is the caller's
            self._reconnect(seen)
        inner = self._inner
        inner.set_timeout(self.timeout)
        return getattr(inner, op)(*args)

    # The operations torch's rendezvous and elastic agent use (the rest of dist.Store is not overridden).
    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def add(self, key: str, value: int) -> int:
        return self._call("add", key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call("wait", keys, self.timeout if timeout is None else timeout)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._call("multi_set", keys, values)


def restore_rendezvous(handler: Any, backend: Any, store: ReconnectingStore) -> None:
    """Make torch's DynamicRendezvousHandler `handler` (its state kept by `backend` in `store`) carry on
    through a restart of the store (see the module)."""
    # torch's backend writes its null state once, in its constructor; write it again into a new store.
    store.on_reconnect.append(lambda inner: inner.compare_set(backend._key, "", backend._NULL_SENTINEL))
    holder = handler._state_holder  # the one object every rendezvous operation syncs through
    plain_sync = holder.sync

    def sync() -> bool | None:
        seen, mine = store.generation, holder.state  # the last state synced, with any change pending
        result = plain_sync()
        if store.generation == seen or holder._token is not None:
            return result  # no restart, or another agent has put the state back already
        now = datetime.now(timezone.utc)
        for node in mine.last_heartbeats:
            mine.last_heartbeats[node] = now
        holder._state, holder._token = mine, None  # no token: written only over the null state
        holder.mark_dirty()
        result = plain_sync()  # torch's own write; if another agent was first, its state is read instead
        if result:
            print(
                f"hybridpar: wrote the rendezvous state back into the restarted store (round {mine.round}, "
                f"{len(mine.participants)} nodes)",
                file=sys.stderr,
                flush=True,
            )
        return result

    holder.sync = sync
