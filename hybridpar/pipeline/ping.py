"""Round trips of one message through the pipeline's own transport (`P2P`: shared memory between CPU
ranks of a host, else the process group): the hop latency the planner's probe (plan/probe.py) and the
pipeline benchmark (bench/latency.py) measure."""

from __future__ import annotations

import time
from typing import Callable

import torch

from hybridpar.pipeline.p2p import P2P


def ping_pong(
    p2p: P2P, me: int, a: int, b: int, peer: Callable[[int], int], shape: tuple[int, ...], round_trips: int, warmup: int
) -> list[float]:
    """Round trips a -> b -> a of one message of `shape` (float32); run by both ends. Returns the
    measured round-trip seconds on `a`, [] on `b`."""
    x = torch.zeros(shape, dtype=p2p.dtype, device=p2p.device)
    rtts: list[float] = []
    for i in range(warmup + round_trips):
        if me == a:
            t0 = time.perf_counter()
            p2p.queue_send(x, peer(b))
            p2p.queue_recv(("pong", i), shape, peer(b))
            p2p.flush()
            buf = p2p.wait_recv(("pong", i))
            t1 = time.perf_counter()
            p2p.release(buf)
            p2p.wait_sends()
            if i >= warmup:
                rtts.append(t1 - t0)
        else:
            p2p.queue_recv(("ping", i), shape, peer(a))
            p2p.flush()
            buf = p2p.wait_recv(("ping", i))
            p2p.queue_send(buf, peer(a))
            p2p.flush()
            p2p.wait_sends()
            p2p.release(buf)
    return rtts
