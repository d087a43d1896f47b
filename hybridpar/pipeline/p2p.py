"""Point-to-point messages between pipeline ranks: batched non-blocking isend/irecv, receive buffers
reused across microbatches and steps, and per-link counters (bytes, messages, time spent waiting).

Unlike a cache keyed by `data_ptr()` (which hands out stale tensors once memory is reused),
nothing is ever served from a stale buffer: a buffer goes back to the pool only once its consumer
(the backward that saved it) is finished with it.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Hashable

import torch
import torch.distributed as dist

from hybridpar.pipeline.shm import DESCRIPTOR, RecvLink, SendLink, transport_for


@dataclass
class LinkStats:
    sent_bytes: int = 0
    sent_msgs: int = 0
    recv_bytes: int = 0
    recv_msgs: int = 0
    recv_wait_s: float = 0.0  # time blocked waiting for data that had not arrived yet
    send_wait_s: float = 0.0  # time blocked at the end of a step for sends to drain

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class _Borrow:
    """A shared-memory receive that hands out the message in the ring instead of a buffer."""

    shape: tuple[int, ...]


@dataclass(frozen=True)
class _LinkKey:
    """The receive of a shared-memory link's descriptor from `peer` (never a caller's key)."""

    peer: int


class _Batch:
    """The messages of one flush: `works[i]` is op i's work once batch `seq` is posted."""

    __slots__ = ("ops", "seq", "works", "error")

    def __init__(self, ops: list[tuple[str, Hashable, torch.Tensor, int]], seq: int) -> None:
        self.ops, self.seq = ops, seq
        self.works: list[dist.Work | None] = []  # None: a receive already landed (`_forget`)
        self.error: BaseException | None = None


class P2P:
    """Messages to and from peers given as global ranks. Keys name receives ("F", stage, mb).

    Ops are queued and then posted together by flush(), so that one action's sends and the receives
    posted ahead of the next actions go out together. On CUDA (NCCL) the batch is one group call from
    the caller's thread, enqueued on the stream that produced the tensors. On CPU (gloo) posting does
    real work in the calling thread (about 0.15 ms per message here, more right after a long compute,
    when caches are cold) while the pipeline's next compute waits behind it, so a posting thread posts
    the batches instead, in queue order (the only order gloo matches messages by), and the compute
    goes on at once. The thread only posts; completion is still waited for where the data is needed.
    Each P2P object has its own thread, so two objects that talk to the same peer must use different
    `tag`s (gloo matches a receive with the first message of its sender and tag): between threads there
    is no posting order.

    `transport`: between CPU ranks on one host (`auto`, see shm.py) messages go through shared memory
    instead: a send is copied into its link's ring, at once if the link is open and nothing is queued
    before it, else at the flush, and is then complete; a receive is copied out when it is waited
    for, or lent in place (`borrow`), its ring space freed at the flush after its release. The
    process group then only carries each link's descriptor, once.
    """

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        timeout_s: float,
        post_from_thread: bool | None = None,
        tag: int = 0,
        transport: str = "auto",
    ) -> None:
        self.device, self.dtype, self.tag = device, dtype, tag
        self.transport = transport_for(transport, device)  # "shared_memory" | "process_group"
        self._out: dict[int, SendLink] = {}
        self._in: dict[int, RecvLink] = {}
        self._in_order: dict[int, deque[tuple[Hashable, torch.Tensor]]] = defaultdict(deque)
        self._landed: dict[Hashable, torch.Tensor] = {}
        self._borrowed: dict[int, tuple[RecvLink, list]] = {}  # data_ptr of a handed-out ring view -> its token
        # Released ring records, freed at the next flush: after the sends queued with them, so that
        # the bookkeeping does not sit between a backward and the gradient it sends.
        self._to_free: list[tuple[RecvLink, list]] = []
        self._linking: set[int] = set()  # peers whose link descriptor is being received
        self.timeout_s = timeout_s
        self.timeout = timedelta(seconds=timeout_s)
        self.stats: dict[int, LinkStats] = defaultdict(LinkStats)
        self._pool: dict[tuple[int, ...], list[torch.Tensor]] = defaultdict(list)
        self._buffers_live = self._buffers_peak = 0  # bytes of receive buffers (memory accounting)
        # Storages of the receive buffers alive now: a stage that reads a message in place (its own dtype) has
        # autograd save that very tensor, which the buffers already count (`holds`).
        self._buffer_storages: set[int] = set()
        self._recvs: dict[Hashable, tuple[_Batch | None, int, torch.Tensor, int]] = {}  # batch None: shared memory
        self._sends: list[tuple[_Batch, int, torch.Tensor, int]] = []
        self._ops: list[tuple[str, Hashable, torch.Tensor, int]] = []
        self._threaded = device.type == "cpu" if post_from_thread is None else post_from_thread
        # Batches are posted in order, so "batch n is posted" is "posted >= n": no per-batch event
        # to build on the caller's side, which runs right after a compute, when that costs most.
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._flushes = self._posted = 0
        self._cond = threading.Condition()
        self._world, self._rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (None, None)
        # Emulation only (emulate/slow_link.py): seconds added to every message received from these peers,
        # as a link that much slower would take; counted as waiting. Empty = off.
        self.link_delay_s: dict[int, float] = {}

    def _check_peer(self, peer: int) -> None:
        # The posting thread calls the process group directly, which does not check ranks (gloo
        # crashes on one out of range): check here, where the caller's frame names the mistake.
        if self._world is not None and not (0 <= peer < self._world and peer != self._rank):
            raise ValueError(
                f"P2P peer {peer} is not another rank of this world (ranks 0..{self._world - 1}, "
                f"this is rank {self._rank})"
            )

    def queue_send(self, tensor: torch.Tensor, peer: int) -> None:
        self._check_peer(peer)
        t = tensor.detach().contiguous()
        link = self._out.get(peer) if not self._ops else None
        if link is not None:  # shared memory, nothing queued before it: copied now, not at the flush
            link.send(t)
            self._count_send(peer, t)
            return
        self._ops.append(("send", None, t, peer))

    def queue_recv(self, key: Hashable, shape: tuple[int, ...], peer: int, borrow: bool = False) -> None:
        """`borrow`: the caller will `release` the buffer it gets (and nothing reads it after that):
        over shared memory it is then the message where it lies in the link's ring, no copy."""
        assert key not in self._recvs, f"receive {key} posted twice"
        self._check_peer(peer)
        if borrow and self.transport == "shared_memory":
            self._ops.append(("recv", key, _Borrow(shape), peer))
            return
        buf = self._pool[shape].pop() if self._pool[shape] else self._new_buffer(shape)
        self._ops.append(("recv", key, buf, peer))

    def _new_buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        n, ptr = buf.numel() * buf.element_size(), buf.untyped_storage().data_ptr()
        self._buffers_live += n
        self._buffers_peak = max(self._buffers_peak, self._buffers_live)
        self._buffer_storages.add(ptr)
        # Counted down when its memory goes: a split backward does not give its buffers back to the pool (W may
        # read one after it, through an alias: autograd hands the incoming gradient through the residual add to
        # the last linear's output gradient, which W keeps), so a buffer lives as long as its last reader holds
        # it. The storage, not this tensor object: a stage reads the message through a view of it (its detached
        # input), which may outlive the buffer's own object.
        weakref.finalize(buf.untyped_storage(), self._buffer_freed, n, ptr)
        return buf

    def _buffer_freed(self, n: int, ptr: int) -> None:
        self._buffers_live -= n
        self._buffer_storages.discard(ptr)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in one of this P2P's receive buffers (counted in `buffer_bytes`)."""
        return bool(self._buffer_storages) and t.untyped_storage().data_ptr() in self._buffer_storages

    def buffer_bytes(self) -> int:
        """Bytes this P2P allocated for messages, at their most: receive buffers alive at once, plus the
        rings of its shared-memory send links (the receiver maps the sender's ring: counted there)."""
        return self._buffers_peak + sum(link.peak_bytes for link in self._out.values())

    def flush(self) -> None:
        if self._ops:
            self._post()
        if self._to_free:
            for link, token in self._to_free:
                link.free(token)
            self._to_free.clear()

    def _post(self) -> None:
        # Forget sends that already completed, so their tensors can be freed before the step ends.
        self._sends = [
            s for s in self._sends if not (s[0].seq <= self._posted and s[0].works and s[0].works[s[1]].is_completed())
        ]
        ops, self._ops = self._ops, []
        if self.transport == "shared_memory":
            ops = self._through_shared_memory(ops)
            if not ops:
                return
        self._flushes += 1
        batch = _Batch(ops, self._flushes)
        if self._threaded:
            if self._thread is None:
                self._thread = threading.Thread(target=self._post_loop, name="hybridpar-p2p-post", daemon=True)
                self._thread.start()
            self._queue.put(batch)
        else:
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, tag=self.tag)
                    for kind, _, t, peer in batch.ops
                ]
            )
            # NCCL coalesces the batch into a single work that covers all its ops.
            batch.works = works if len(works) == len(batch.ops) else works * len(batch.ops)
            self._posted = batch.seq
        for i, (kind, key, t, peer) in enumerate(batch.ops):
            if kind == "send":
                self._sends.append((batch, i, t, peer))
                if not isinstance(key, _LinkKey):
                    self._count_send(peer, t)
            else:
                self._recvs[key] = (batch, i, t, peer)

    def _count_send(self, peer: int, t: torch.Tensor) -> None:
        self.stats[peer].sent_bytes += t.numel() * t.element_size()
        self.stats[peer].sent_msgs += 1

    def _through_shared_memory(
        self, ops: list[tuple[str, Hashable, torch.Tensor, int]]
    ) -> list[tuple[str, Hashable, torch.Tensor, int]]:
        """Send over (and register receives on) the shared-memory links; returns what the process group
        still carries: each link's descriptor, its sender's first message on the link."""
        pg_ops = []
        for kind, key, t, peer in ops:
            if kind == "send":
                link = self._out.get(peer)
                if link is None:
                    link = self._out[peer] = SendLink(t.numel() * t.element_size())
                    pg_ops.append(("send", _LinkKey(peer), link.descriptor(), peer))
                link.send(t)  # complete once copied: nothing to wait for
                self._count_send(peer, t)
            else:
                if peer not in self._in and peer not in self._linking:
                    self._linking.add(peer)
                    pg_ops.append(("recv", _LinkKey(peer), torch.empty(DESCRIPTOR, dtype=torch.int64), peer))
                self._in_order[peer].append((key, t))
                self._recvs[key] = (None, 0, t, peer)
        return pg_ops

    def _post_loop(self) -> None:
        while (batch := self._queue.get()) is not None:
            self._post_batch(batch)
            with self._cond:
                self._posted = batch.seq
                self._cond.notify_all()

    def _post_batch(self, batch: _Batch) -> None:
        # The group is looked up per batch, not held while the loop waits: a reference kept here would keep
        # the default group (and its worker threads) alive past destroy_process_group (topology/lifetime.py).
        pg = dist.group.WORLD  # peers are global ranks: their ranks in the default group
        try:
            batch.works = [
                pg.send([t], peer, self.tag) if kind == "send" else pg.recv([t], peer, self.tag)
                for kind, _, t, peer in batch.ops
            ]
        except BaseException as e:  # re-raised where the caller waits for one of these messages
            batch.error = e

    def _wait(self, batch: _Batch, i: int, what: str) -> None:
        if self._posted < batch.seq:
            with self._cond:
                if not self._cond.wait_for(lambda: self._posted >= batch.seq, self.timeout_s):
                    raise TimeoutError(
                        f"P2P: {what} was not posted within {self.timeout_s:g} s " "(the posting thread is stuck)"
                    )
        if batch.error is not None:
            raise RuntimeError(f"P2P: posting {what} failed: {batch.error}") from batch.error
        batch.works[i].wait(self.timeout)

    def wait_recv(self, key: Hashable) -> torch.Tensor:
        """Block until receive `key` has landed and return its buffer (owned by the caller until release)."""
        self.flush()
        batch, i, buf, peer = self._recvs.pop(key)
        t0 = time.perf_counter()
        if batch is None:
            buf = self._wait_shared_memory(key, peer)
        else:
            self._wait(batch, i, f"receive {key} from rank {peer}")
            self._forget(batch, i)
        if peer in self.link_delay_s:
            time.sleep(self.link_delay_s[peer])
        st = self.stats[peer]
        st.recv_wait_s += time.perf_counter() - t0
        st.recv_bytes += buf.numel() * buf.element_size()
        st.recv_msgs += 1
        return buf

    @staticmethod
    def _forget(batch: _Batch, i: int) -> None:
        """Drop the batch's references to receive i, landed: from here on the buffer lives exactly as long as its
        reader holds it. The batch itself may live on, timed by others: `_sends` keeps it until its sends are
        found complete at a later flush, and the posting thread until its next batch, so a buffer it still
        pointed to would be freed at a moment set by timing, not by its reader (ZB-H1 through the process group
        held one message more at pipeline rank 0's peak than its W needed: docs/memory.md)."""
        kind, key, _, peer = batch.ops[i]
        batch.ops[i] = (kind, key, None, peer)
        batch.works[i] = None  # gloo's receive work keeps its tensor

    def _wait_shared_memory(self, key: Hashable, peer: int) -> torch.Tensor:
        link = self._in.get(peer)
        if link is None:
            batch, i, desc, _ = self._recvs.pop(_LinkKey(peer))
            self._linking.discard(peer)
            self._wait(batch, i, f"the shared-memory link from rank {peer}")
            link = self._in[peer] = RecvLink(desc, peer)
        # A link delivers in send order, which is the order its receives were queued in: land the ones
        # queued before `key` on the way (each into its own buffer).
        order = self._in_order[peer]
        while key not in self._landed:
            k, buf = order.popleft()
            what = f"receive {k} from rank {peer}"
            if isinstance(buf, _Borrow):
                view, token = link.take(buf.shape, self.dtype, self.timeout_s, what)
                self._borrowed[view.data_ptr()] = (link, token)
                self._landed[k] = view
            else:
                link.recv_into(buf, self.timeout_s, what)
                self._landed[k] = buf
        return self._landed.pop(key)

    def lent(self, t: torch.Tensor) -> bool:
        """Whether `t` lies in a ring this P2P lent a message from (its storage is the ring's)."""
        if not self._in:
            return False
        ptr = t.untyped_storage().data_ptr()
        return any(ptr in link.storages for link in self._in.values())

    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer `wait_recv` returned: to the pool, or (borrowed) its ring space."""
        borrowed = self._borrowed.pop(buf.data_ptr(), None) if self._borrowed else None
        if borrowed is not None:
            self._to_free.append(borrowed)
        else:
            self._pool[tuple(buf.shape)].append(buf)

    def wait_sends(self) -> None:
        """Drain all outstanding sends (end of a step): their tensors may then be freed or reused."""
        self.flush()
        for batch, i, _, peer in self._sends:
            t0 = time.perf_counter()
            self._wait(batch, i, f"a send to rank {peer}")
            self.stats[peer].send_wait_s += time.perf_counter() - t0
        self._sends.clear()

    def close(self) -> None:
        """Stop the posting thread (after the messages already queued) and close the shared-memory links."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(self.timeout_s)
            self._thread = None
        for link in [*self._out.values(), *self._in.values()]:
            link.close()
        self._to_free.clear()
        self._out.clear()
        self._in.clear()

    def pending(self) -> int:
        return len(self._recvs) + len(self._sends) + len(self._ops)
