"""Shared-memory links for pipeline messages between CPU ranks on one host.

Why: on this kind of machine a gloo message crosses several threads (the caller, gloo's I/O threads on
both sides, the waiting caller) and the loopback TCP stack, and every wake-up after a few milliseconds
of idling runs on cold caches: in the middle of an emulated 1F1B step a hop costs ~0.8-0.9 ms (a 4-byte
`pg.send` call alone takes 34 us warm, 168 us after 20 ms idle). A link here is one direction, sender
-> receiver: a ring buffer in a shared file that the sender copies each message into, and a FIFO
"doorbell" it writes one byte to after each message, on which a waiting receiver sleeps. The receiver
copies the message out into its own buffer and frees the ring space at once (`recv_into`), or is lent
it in place and frees it when done (`take` / `free`, in arrival order). A send is complete as soon as
it is copied in: there is nothing to post, and no thread.

Setup needs no store and no collective: the sender creates the ring (a file in /dev/shm, unlinked at
once, so that nothing is left behind however a process ends) and the FIFO, and sends (its pid, their
descriptors, a random token) as its first message on the link over the process group (P2P does that);
the receiver opens them through /proc/<pid>/fd and checks the token. Linux only.

Ordering: the sender writes the payload, then publishes the ring's head; the receiver reads the head,
then the payload. x86-64 keeps a core's stores in order and its loads in order (total store order),
which this relies on; `transport_for` therefore picks these links only on x86-64.

A ring without room for a message grows instead of waiting: the sender makes a ring twice as large (or
four times the message), writes a record that points the receiver to it and continues there. So a
sender never waits for its receiver, whatever order a schedule consumes messages in (no deadlock), and
a link's memory is what its most messages in flight need.
"""

from __future__ import annotations

import math
import mmap
import os
import platform
import select
import struct
import sys
import tempfile
import time
from collections import deque

import torch

TRANSPORTS = ("auto", "process_group", "shared_memory")

_CTL = 128  # control block: head (bytes written, sender) at 0, tail (bytes consumed, receiver) at 64
_HDR = 64  # record header (kind, payload bytes), padded so that every payload starts 64-byte aligned
_DATA, _WRAP, _SWITCH = 1, 2, 3  # record kinds
_RESERVE = 512  # room always kept for one switch record (header + path)
_MIN_CAPACITY = 1 << 20
DESCRIPTOR = 4  # int64s in a link descriptor


def transport_for(transport: str, device: torch.device) -> str:
    """ "shared_memory" or "process_group" for a P2P on `device`. `auto` picks shared memory where it
    works: CPU tensors, x86-64, every rank on this host (LOCAL_WORLD_SIZE == WORLD_SIZE, as torchrun
    and the spawn helper set). Asking for `shared_memory` where it cannot work is a ValueError."""
    if transport not in TRANSPORTS:
        raise ValueError(f"P2P transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "process_group":
        return transport
    why = _why_not(device)
    if why is None:
        return "shared_memory"
    if transport == "shared_memory":
        raise ValueError(f"P2P transport shared_memory cannot be used: {why}; use auto or process_group")
    return "process_group"


def _why_not(device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"it carries CPU tensors, the device is {device}"
    if not sys.platform.startswith("linux"):
        return f"it opens the peer's files through /proc (Linux), this system is {sys.platform}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it relies on x86-64 store ordering, this machine is {platform.machine()}"
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local is None or world is None or local != world:
        return f"every rank must be on this host (LOCAL_WORLD_SIZE={local}, WORLD_SIZE={world}; " "torchrun sets both)"
    return None


def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


def record_bytes(message_bytes: int) -> int:
    """Ring bytes one message takes: its header and its payload, padded to 64 bytes."""
    return _HDR + _align(message_bytes)


def first_capacity(message_bytes: int) -> int:
    """A new link's ring: room for four of its first message, at least 1 MiB."""
    return _align(max(_MIN_CAPACITY, 4 * record_bytes(message_bytes)))


def grown_capacity(capacity: int, record: int) -> int:
    """The ring that replaces a full one: twice as large, or four records if that is more."""
    return _align(max(2 * capacity, 4 * record))


class _Ring:
    """One mapped ring. Offsets are byte positions that only grow; position p lives at p % capacity.
    The sender's ring is an unlinked file it keeps open; the receiver opens it through /proc."""

    def __init__(self, fd: int, capacity: int) -> None:
        self.fd, self.capacity = fd, capacity
        self.mm = mmap.mmap(fd, _CTL + capacity)
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=_CTL, count=capacity)
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the data area as each dtype (one view each)

    @classmethod
    def create(cls, capacity: int, token: int) -> _Ring:
        capacity = _align(capacity)
        # Unlinked at once: nothing is left behind however a process ends (the memory goes with the
        # last descriptor or mapping).
        fd, path = tempfile.mkstemp(prefix="hybridpar-p2p-", dir=_directory())
        os.unlink(path)
        os.ftruncate(fd, _CTL + capacity)
        ring = cls(fd, capacity)
        struct.pack_into("<q", ring.mm, 8, token)
        return ring

    @classmethod
    def open(cls, pid: int, fd: int, token: int, what: str) -> _Ring:
        mine = _open_peer_fd(pid, fd, os.O_RDWR, what)
        try:
            ring = cls(mine, os.fstat(mine).st_size - _CTL)
        finally:
            os.close(mine)
        ring.fd = -1
        if struct.unpack_from("<q", ring.mm, 8)[0] != token:
            raise ConnectionError(f"P2P: {what}: /proc/{pid}/fd/{fd} is not the ring its descriptor names")
        return ring

    def view(self, at: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The contiguous `shape` tensor of `dtype` at byte `at` of the data area (64-byte aligned): one
        op, since every op counts on a hop (the first ones after an idle run on cold caches)."""
        flat = self._typed.get(dtype)
        if flat is None:
            flat = self._typed[dtype] = self.data.view(dtype)
        strides, step = [], 1
        for d in reversed(shape):
            strides.append(step)
            step *= d
        return flat.as_strided(shape, strides[::-1], at // dtype.itemsize)

    def head(self) -> int:
        return struct.unpack_from("<q", self.mm, 0)[0]

    def tail(self) -> int:
        return struct.unpack_from("<q", self.mm, 64)[0]

    def header(self, pos: int) -> tuple[int, int]:
        return struct.unpack_from("<qq", self.mm, _CTL + pos % self.capacity)

    def release(self) -> None:
        """Drop the sender's descriptor (the mapping goes when its last user does)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open_peer_fd(pid: int, fd: int, flags: int, what: str) -> int:
    try:
        return os.open(f"/proc/{pid}/fd/{fd}", flags)
    except FileNotFoundError:
        raise ConnectionError(
            f"P2P: {what}: the sending process {pid} is gone " "(it exited before the link was opened)"
        ) from None
    except PermissionError as e:
        raise ConnectionError(
            f"P2P: {what}: cannot open the sender's ring through /proc ({e}); " "use the process_group transport"
        ) from None


class SendLink:
    """The sending end: a ring and a doorbell FIFO; `descriptor()` names them for the receiver."""

    def __init__(self, first_message_bytes: int) -> None:
        self._token = int.from_bytes(os.urandom(7), "little")
        path = os.path.join(tempfile.mkdtemp(prefix="hybridpar-p2p-", dir=_directory()), "bell")
        os.mkfifo(path, 0o600)
        # Read-write, so that opening does not wait for a reader and writes never block on one.
        self._bell = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
        self._ring = _Ring.create(first_capacity(first_message_bytes), self._token)
        self._first = self._ring.fd
        self._head = 0
        self._retired: list[tuple[_Ring, int]] = []  # rings left for a bigger one, until the receiver left them
        self.peak_bytes = _CTL + self._ring.capacity  # most bytes of rings held at once (memory accounting)

    def descriptor(self) -> torch.Tensor:
        """(pid, ring fd, doorbell fd, token) as int64."""
        return torch.tensor([os.getpid(), self._first, self._bell, self._token], dtype=torch.int64)

    def send(self, t: torch.Tensor) -> None:
        """Copy contiguous `t` into the ring and ring the doorbell."""
        n = t.numel() * t.element_size()
        rec = _HDR + _align(n)
        ring = self._ring
        if self._retired:
            for r, end in [x for x in self._retired if x[0].tail() >= x[1]]:  # the receiver moved on
                r.release()
                self._retired.remove((r, end))
        if not self._fits(ring, rec + _RESERVE):
            bigger = _Ring.create(grown_capacity(ring.capacity, rec), self._token)
            self._write(ring, _SWITCH, 8, lambda at: struct.pack_into("<q", ring.mm, _CTL + at, bigger.fd))
            self._retired.append((ring, self._head))
            self._ring, self._head, ring = bigger, 0, bigger
            held = sum(_CTL + r.capacity for r in [bigger, *(r for r, _ in self._retired)])
            self.peak_bytes = max(self.peak_bytes, held)
        self._write(ring, _DATA, n, lambda at: ring.view(at, t.shape, t.dtype).copy_(t))
        try:
            os.write(self._bell, b"\x01")
        except BlockingIOError:  # 64 KiB of unread rings: the receiver will wake up on those
            pass

    def _fits(self, ring: _Ring, rec: int) -> bool:
        pos = self._head % ring.capacity
        skip = ring.capacity - pos if pos + rec > ring.capacity else 0
        return self._head + skip + rec - ring.tail() <= ring.capacity

    def _write(self, ring: _Ring, kind: int, n: int, fill) -> None:
        rec = _HDR + _align(n)
        pos = self._head % ring.capacity
        if pos + rec > ring.capacity:  # no room before the end: mark the rest skipped, start over at 0
            struct.pack_into("<qq", ring.mm, _CTL + pos, _WRAP, 0)
            self._head += ring.capacity - pos
            pos = 0
        struct.pack_into("<qq", ring.mm, _CTL + pos, kind, n)
        fill(pos + _HDR)
        self._head += rec
        struct.pack_into("<q", ring.mm, 0, self._head)  # publish: after the payload (x86 store order)

    def close(self) -> None:
        for ring in [self._ring, *(r for r, _ in self._retired)]:
            ring.release()
        self._retired.clear()
        if self._bell >= 0:
            os.close(self._bell)  # a receiver waiting on an empty ring now gets end-of-file
            self._bell = -1


class RecvLink:
    """The receiving end, opened from the sender's descriptor."""

    def __init__(self, descriptor: torch.Tensor, peer: int) -> None:
        self._pid, ring_fd, bell_fd, self._token = (int(x) for x in descriptor.tolist())
        self.peer = peer
        what = f"the shared-memory link from rank {peer}"
        self._bell = _open_peer_fd(self._pid, bell_fd, os.O_RDONLY | os.O_NONBLOCK, what)
        self._ring = _Ring.open(self._pid, ring_fd, self._token, what)
        self._tail = 0
        # Storages of every ring this link lent from: whether a tensor lies in one (P2P.lent).
        self.storages = {self._ring.data.untyped_storage().data_ptr()}
        self._poll = select.poll()  # not select(): it fails on descriptors past 1023
        self._poll.register(self._bell, select.POLLIN)
        # Records taken and not yet freed, in arrival order: [ring, end position, freed]. A ring's tail
        # (what the sender may overwrite) only moves past a freed prefix.
        self._held: deque[list] = deque()

    def recv_into(self, buf: torch.Tensor, timeout_s: float, what: str) -> None:
        """Block until the next message has landed, copy it into contiguous `buf`, free its ring space."""
        data, token = self.take(tuple(buf.shape), buf.dtype, timeout_s, what)
        buf.copy_(data)
        self.free(token)

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, timeout_s: float, what: str
    ) -> tuple[torch.Tensor, list]:
        """Block until the next message has landed; return it as a `shape` tensor of `dtype` where it
        lies in the ring (no copy) and the token that `free` takes once nothing reads it any more."""
        nbytes = dtype.itemsize * math.prod(shape)
        deadline = time.monotonic() + timeout_s
        while True:
            ring = self._ring
            if ring.head() > self._tail:
                kind, n = ring.header(self._tail)
                pos = self._tail % ring.capacity
                if kind == _WRAP:
                    self._tail += ring.capacity - pos
                    continue
                at = pos + _HDR
                self._tail += _HDR + _align(n)
                token = [ring, self._tail, kind == _SWITCH]
                self._held.append(token)
                if kind == _SWITCH:
                    fd = struct.unpack_from("<q", ring.mm, _CTL + at)[0]
                    self._advance()  # the sender drops this ring once every record in it is freed
                    self._ring, self._tail = _Ring.open(self._pid, fd, self._token, what), 0
                    self.storages.add(self._ring.data.untyped_storage().data_ptr())
                    continue
                if n != nbytes:
                    raise RuntimeError(
                        f"P2P: {what}: expected {nbytes} bytes (shape {tuple(shape)}, {dtype}), "
                        f"the sender sent {n}: the two ranks disagree on the message's shape"
                    )
                return ring.view(at, shape, dtype), token
            self._sleep(deadline, timeout_s, what)

    def free(self, token: list) -> None:
        token[2] = True
        self._advance()

    def _advance(self) -> None:
        while self._held and self._held[0][2]:
            ring, end, _ = self._held.popleft()
            struct.pack_into("<q", ring.mm, 64, end)

    def _sleep(self, deadline: float, timeout_s: float, what: str) -> None:
        """Wait for the doorbell (or drain rings that a message already answered)."""
        try:
            if os.read(self._bell, 4096):
                return
            raise ConnectionError(
                f"P2P: {what}: rank {self.peer} closed its shared-memory link " "(it exited or failed)"
            )
        except BlockingIOError:
            pass
        if self._ring.head() > self._tail:
            return
        left = deadline - time.monotonic()
        if left <= 0 or not self._poll.poll(left * 1e3):
            raise TimeoutError(f"P2P: {what} did not arrive within {timeout_s:g} s")

    def close(self) -> None:
        if self._bell >= 0:
            os.close(self._bell)
            self._bell = -1
