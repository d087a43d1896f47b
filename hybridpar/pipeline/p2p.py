"""Point-to-point messages between pipeline ranks: batched non-blocking isend/irecv, receive buffers
reused across microbatches and steps, and per-link counters (bytes, messages, time spent waiting).

This is the real form of the tutorial's `OptimizedCommunication`. Unlike its `data_ptr()`-keyed cache,
nothing is ever served from a stale buffer: a buffer goes back to the pool only once its consumer
(the backward that saved it) is finished with it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Hashable

import torch
import torch.distributed as dist


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


class P2P:
    """Messages to and from peers given as global ranks. Keys name receives ("F", stage, mb)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, timeout_s: float) -> None:
        self.device, self.dtype = device, dtype
        self.timeout = timedelta(seconds=timeout_s)
        self.stats: dict[int, LinkStats] = defaultdict(LinkStats)
        self._pool: dict[tuple[int, ...], list[torch.Tensor]] = defaultdict(list)
        self._recvs: dict[Hashable, tuple[list[dist.Work], torch.Tensor, int]] = {}
        self._sends: list[tuple[list[dist.Work], torch.Tensor, int]] = []
        self._ops: list[dist.P2POp] = []
        self._op_keys: list[tuple[str, Hashable, torch.Tensor, int]] = []

    # Ops are queued and then posted together by flush(), so that one action's sends and the receives
    # posted ahead of the next actions go out as one batch (one NCCL group call on GPU).
    def queue_send(self, tensor: torch.Tensor, peer: int) -> None:
        t = tensor.detach().contiguous()
        self._ops.append(dist.P2POp(dist.isend, t, peer))
        self._op_keys.append(("send", None, t, peer))

    def queue_recv(self, key: Hashable, shape: tuple[int, ...], peer: int) -> None:
        assert key not in self._recvs, f"receive {key} posted twice"
        buf = self._pool[shape].pop() if self._pool[shape] else torch.empty(shape, dtype=self.dtype, device=self.device)
        self._ops.append(dist.P2POp(dist.irecv, buf, peer))
        self._op_keys.append(("recv", key, buf, peer))

    def flush(self) -> None:
        if not self._ops:
            return
        # Forget sends that already completed, so their tensors can be freed before the step ends.
        self._sends = [s for s in self._sends if not all(w.is_completed() for w in s[0])]
        works = dist.batch_isend_irecv(self._ops)
        # gloo returns one work per op; NCCL coalesces the batch into a single work that covers all.
        per_op = len(works) == len(self._ops)
        for i, (kind, key, t, peer) in enumerate(self._op_keys):
            w = [works[i]] if per_op else works
            nbytes = t.numel() * t.element_size()
            if kind == "send":
                self._sends.append((w, t, peer))
                self.stats[peer].sent_bytes += nbytes
                self.stats[peer].sent_msgs += 1
            else:
                self._recvs[key] = (w, t, peer)
        self._ops, self._op_keys = [], []

    def wait_recv(self, key: Hashable) -> torch.Tensor:
        """Block until receive `key` has landed and return its buffer (owned by the caller until release)."""
        self.flush()
        works, buf, peer = self._recvs.pop(key)
        t0 = time.perf_counter()
        for w in works:
            w.wait(self.timeout)
        st = self.stats[peer]
        st.recv_wait_s += time.perf_counter() - t0
        st.recv_bytes += buf.numel() * buf.element_size()
        st.recv_msgs += 1
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self._pool[tuple(buf.shape)].append(buf)

    def wait_sends(self) -> None:
        """Drain all outstanding sends (end of a step): their tensors may then be freed or reused."""
        self.flush()
        for works, _, peer in self._sends:
            t0 = time.perf_counter()
            for w in works:
                w.wait(self.timeout)
            self.stats[peer].send_wait_s += time.perf_counter() - t0
        self._sends.clear()

    def pending(self) -> int:
        return len(self._recvs) + len(self._sends) + len(self._ops)
