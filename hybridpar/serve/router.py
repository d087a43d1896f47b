"""Request placement over replicas (the dp groups, each a tp × pp engine).
Pure Python: it sees only what the replicas measured and reported
(per-token latencies of finished requests, KV-cache slots in use, queue depth, busy time) and its
own accounting of the requests it placed. Time is passed in, so it is unit-tested without processes.

Strategies: `round_robin` (the baseline), `load_balanced` (fewest outstanding tokens),
`performance_optimized` (smallest estimated completion: outstanding tokens × the replica's measured
seconds per token, weighted for this request's mix — a prefill-heavy request weighs the measured
prefill cost, a decode-heavy one the decode cost), `memory_aware` (most KV headroom), `hybrid`
(chooses one of them from the measured state, fixed thresholds by default, else a blend), `cache_aware`
(the replica holding the longest cached prefix of the prompt, `prefix.py`, unless it has `cache_slack`
more requests outstanding than the least loaded one; else hybrid).

No request is lost: a replica at its outstanding-request limit is skipped; when all are, requests
wait in the router's FIFO and are placed as replicas finish work. Only past `max_pending` waiting
does `submit` refuse, with `Overloaded` (the server answers 429 then).

A replica reported dead (`down`) gets no new placements; a request placed on it that can start over
(the caller decides: its client has seen nothing yet) is put back at the head of the queue
(`requeue`) and placed on a live replica. With no replica alive,
`submit` refuses with `Unavailable` (503) and `abandon` hands back the waiting requests to fail.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from hybridpar.serve.prefix import PrefixIndex

STRATEGIES = ("round_robin", "load_balanced", "performance_optimized", "memory_aware", "hybrid", "cache_aware")


class Overloaded(Exception):
    """Every replica is at its limit and the router's waiting queue is full."""


class Unavailable(Exception):
    """No replica is alive."""


@dataclass
class RouterConfig:
    strategy: str = "hybrid"
    memory_pressure: float = 0.8  # hybrid: above this → memory_aware
    performance_pressure: float = 0.8  # hybrid: above this → performance_optimized
    imbalance: float = 0.5  # hybrid: above this → load_balanced
    max_outstanding: int = 64  # requests per replica before it counts as busy
    max_pending: int = 256  # requests waiting in the router before submit refuses
    cache_slack: int = 4  # cache_aware: outstanding requests beyond the least loaded that a prefix is worth
    block_size: int = 16  # the replicas' KV block (cache_aware sizes its index from their capacity)
    ewma: float = 0.3  # weight of a new latency measurement
    window: int = 2048  # completed requests kept for latency percentiles

    def validate(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"router strategy={self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        for name in ("memory_pressure", "performance_pressure", "imbalance", "ewma"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValueError(f"router {name}={v!r} must be in (0, 1]")
        for name in ("max_outstanding", "max_pending", "window", "cache_slack", "block_size"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"router {name}={v!r} must be a positive integer")


@dataclass
class Request:
    id: str
    prompt_tokens: int
    max_tokens: int
    blocks: tuple[int, ...] = ()  # chained hashes of its prompt's full KV blocks (prefix.block_hashes)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens

    @property
    def prefill_heavy(self) -> bool:
        return self.prompt_tokens >= self.max_tokens


@dataclass
class ReplicaState:
    alive: bool = True
    outstanding: dict[str, Request] = field(default_factory=dict)
    sent_since_status: int = 0  # tokens placed after the replica's last status (not yet in its report)
    # Reported by the replica (None until its first report):
    kv_used: int = 0
    kv_capacity: int | None = None
    slots: int = 1  # sequences it runs at once (reported; 1 until then)
    queued_tokens: int = 0
    queue_depth: int = 0
    utilisation: float | None = None  # busy fraction between its last two reports
    _busy: tuple[float, float] | None = None  # (busy_s, time) of the last report
    # Measured per-token latencies (EWMA over finished requests):
    prefill_s: float | None = None
    decode_s: float | None = None
    routed: Counter = field(default_factory=Counter)

    @property
    def outstanding_tokens(self) -> int:
        return sum(r.tokens for r in self.outstanding.values())

    def kv_pressure(self) -> float:
        if not self.kv_capacity:
            return 0.0
        return (self.kv_used + self.queued_tokens + self.sent_since_status) / self.kv_capacity


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


class Router:
    def __init__(self, n_replicas: int, cfg: RouterConfig | None = None) -> None:
        if not isinstance(n_replicas, int) or n_replicas < 1:
            raise ValueError(f"n_replicas={n_replicas!r} must be a positive integer")
        self.cfg = cfg or RouterConfig()
        self.cfg.validate()
        self.replicas = [ReplicaState() for _ in range(n_replicas)]
        self.pending: deque[tuple[Request, float]] = deque()
        self.where: dict[str, int] = {}
        self.submitted_at: dict[str, float] = {}
        self.usage: Counter = Counter()
        self.latencies: deque[float] = deque(maxlen=self.cfg.window)
        self.completed = 0
        self._rr = 0
        self.prefix = PrefixIndex(n_replicas)

    # -- public API ----------------------------------------------------------------------------------
    def submit(self, req: Request, now: float) -> list[tuple[Request, int]]:
        """Place `req` (or queue it). Returns the placements made, in order: (request, replica)."""
        if req.id in self.where or any(r.id == req.id for r, _ in self.pending):
            raise ValueError(f"request id {req.id!r} is already in flight")
        if not self.live():
            raise Unavailable(f"no replica is running (all {len(self.replicas)} stopped)")
        if self.pending or not self._available():
            if len(self.pending) >= self.cfg.max_pending:
                raise Overloaded(
                    f"all {len(self.replicas)} replicas are at max_outstanding="
                    f"{self.cfg.max_outstanding} and {len(self.pending)} requests are waiting"
                )
            self.pending.append((req, now))
            return self._drain()
        self.submitted_at[req.id] = now
        return [(req, self._place(req))]

    def finished(
        self, req_id: str, now: float, prefill_s_per_token: float | None = None, decode_s_per_token: float | None = None
    ) -> list[tuple[Request, int]]:
        """A replica finished `req_id` (its measured costs, if any). Returns waiting requests now placed."""
        r = self.where.pop(req_id)
        rep = self.replicas[r]
        rep.outstanding.pop(req_id)
        a = self.cfg.ewma
        if prefill_s_per_token is not None:
            rep.prefill_s = (
                prefill_s_per_token if rep.prefill_s is None else (1 - a) * rep.prefill_s + a * prefill_s_per_token
            )
        if decode_s_per_token is not None:
            rep.decode_s = (
                decode_s_per_token if rep.decode_s is None else (1 - a) * rep.decode_s + a * decode_s_per_token
            )
        self.latencies.append(now - self.submitted_at.pop(req_id))
        self.completed += 1
        return self._drain()

    def report(
        self,
        replica: int,
        kv_used: int,
        kv_capacity: int,
        queue_depth: int,
        queued_tokens: int,
        busy_s: float,
        now: float,
        slots: int = 1,
    ) -> None:
        """A replica's measured status."""
        rep = self.replicas[replica]
        rep.slots = max(1, int(slots))
        rep.kv_used, rep.kv_capacity, rep.queue_depth, rep.queued_tokens = (
            kv_used,
            kv_capacity,
            queue_depth,
            queued_tokens,
        )
        rep.sent_since_status = 0
        self.prefix.resize(replica, kv_capacity // self.cfg.block_size)
        if rep._busy is not None and now > rep._busy[1]:
            rep.utilisation = min(1.0, max(0.0, (busy_s - rep._busy[0]) / (now - rep._busy[1])))
        rep._busy = (busy_s, now)

    def live(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.alive]

    def down(self, replica: int) -> list[str]:
        """Replica `replica` stopped: it gets no more placements. Returns the ids placed on it (the
        caller `requeue`s those that can start over and fails the others). Idempotent."""
        self.replicas[replica].alive = False
        self.prefix.forget(replica)
        return [rid for rid, r in self.where.items() if r == replica]

    def requeue(self, req_id: str) -> list[tuple[Request, int]]:
        """`req_id`, placed on a dead replica and able to start over, goes back to the head of the queue
        (keeping its submission time) and is placed again if a live replica has room. A no-op when the
        request is not on a dead replica (already moved, or finished), so racing callers are safe."""
        r = self.where.get(req_id)
        if r is None or self.replicas[r].alive:
            return []
        del self.where[req_id]
        req = self.replicas[r].outstanding.pop(req_id)
        self.pending.appendleft((req, self.submitted_at.pop(req_id)))
        return self._drain()

    def abandon(self) -> list[Request]:
        """With no replica alive: empties the waiting queue and returns what was in it (to be failed)."""
        if self.live():
            return []
        out = [req for req, _ in self.pending]
        self.pending.clear()
        return out

    def state(self) -> dict[str, float]:
        """The measured state hybrid decides on (all in [0, 1]), over the live replicas."""
        reps = [self.replicas[i] for i in self.live()] or self.replicas
        loads = [r.outstanding_tokens for r in reps]
        hi, lo = max(loads), min(loads)
        return {
            "memory_pressure": max(r.kv_pressure() for r in reps),
            "performance_pressure": max((r.utilisation or 0.0) for r in reps),
            "load_imbalance": (hi - lo) / (hi + lo) if hi + lo else 0.0,
        }

    def statistics(self) -> dict[str, Any]:
        lat = list(self.latencies)
        return {
            "strategy": self.cfg.strategy,
            "strategy_usage": dict(self.usage),
            "completed": self.completed,
            "pending": len(self.pending),
            "state": self.state(),
            "latency_s": {
                "p50": percentile(lat, 50),
                "p90": percentile(lat, 90),
                "p99": percentile(lat, 99),
                "n": len(lat),
            },
            "replicas": [
                {
                    "alive": r.alive,
                    "queue_depth": r.queue_depth,
                    "outstanding_requests": len(r.outstanding),
                    "outstanding_tokens": r.outstanding_tokens,
                    "kv_used_tokens": r.kv_used,
                    "kv_capacity_tokens": r.kv_capacity,
                    "utilisation": r.utilisation,
                    "prefill_s_per_token": r.prefill_s,
                    "decode_s_per_token": r.decode_s,
                    "routed": dict(r.routed),
                }
                for r in self.replicas
            ],
        }

    # -- placement -----------------------------------------------------------------------------------
    def _available(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.alive and len(r.outstanding) < self.cfg.max_outstanding]

    def _drain(self) -> list[tuple[Request, int]]:
        placed = []
        while self.pending and self._available():
            req, t = self.pending.popleft()
            self.submitted_at[req.id] = t  # latency counts the time it waited here
            placed.append((req, self._place(req)))
        return placed

    def _place(self, req: Request) -> int:
        choices = self._available()
        name, hit = self.cfg.strategy, None
        if name == "cache_aware":
            loads = {i: len(self.replicas[i].outstanding) for i in choices}
            hit = self.prefix.best(req.blocks, choices, loads, self.cfg.cache_slack)
            self.usage["cache_aware:" + ("prefix" if hit is not None else "hybrid")] += 1
            name = "cache_aware" if hit is not None else "hybrid"
        if name == "hybrid":
            st = self.state()
            if st["memory_pressure"] > self.cfg.memory_pressure:
                name = "memory_aware"
            elif st["performance_pressure"] > self.cfg.performance_pressure:
                name = "performance_optimized"
            elif st["load_imbalance"] > self.cfg.imbalance:
                name = "load_balanced"
            else:
                name = "blend"
            self.usage[f"hybrid:{name}"] += 1
        self.usage[name] += 1
        r = hit if name == "cache_aware" else getattr(self, f"_{name}")(req, choices)
        self.prefix.placed(r, req.blocks)  # whatever placed it: the replica will cache these blocks
        rep = self.replicas[r]
        rep.outstanding[req.id] = req
        rep.sent_since_status += req.tokens
        rep.routed["prefill_heavy" if req.prefill_heavy else "decode_heavy"] += 1
        self.where[req.id] = r
        return r

    def _round_robin(self, req: Request, choices: list[int]) -> int:
        n = len(self.replicas)
        for k in range(n):  # the next replica in turn that is not busy
            i = (self._rr + k) % n
            if i in choices:
                self._rr = i + 1
                return i
        raise AssertionError("no available replica")  # callers check availability first

    def _load_balanced(self, req: Request, choices: list[int]) -> int:
        return min(choices, key=lambda i: (self.replicas[i].outstanding_tokens, len(self.replicas[i].outstanding), i))

    def _costs(self, i: int) -> tuple[float, float] | None:
        """Replica i's measured (prefill s per prompt token, decode s per output token). A replica not
        measured yet is taken as the mean of those measured (so it gets traffic and a measurement);
        None when nothing is measured anywhere yet."""

        def known(attr: str) -> float | None:
            own = getattr(self.replicas[i], attr)
            if own is not None:
                return own
            vals = [getattr(r, attr) for r in self.replicas if getattr(r, attr) is not None]
            return sum(vals) / len(vals) if vals else None

        pf, dc = known("prefill_s"), known("decode_s")
        if pf is None and dc is None:
            return None
        return (pf if pf is not None else dc), (dc if dc is not None else pf)  # type: ignore[return-value]

    def service_s(self, i: int, req: Request) -> float:
        """Estimated seconds replica i needs for `req` alone: its prompt at the measured prefill cost
        plus its output at the measured decode cost, so prefill-heavy and decode-heavy requests are
        weighed by what each replica is actually fast at."""
        c = self._costs(i)
        if c is None:
            return float(req.tokens)  # nothing measured: every replica equal, i.e. balance tokens
        return req.prompt_tokens * c[0] + req.max_tokens * c[1]

    def _estimate(self, i: int, req: Request) -> float:
        # Completion estimate: the work already placed there, shared among the sequences the replica
        # runs concurrently (it reports its slots), then this request's own service time.
        rep = self.replicas[i]
        backlog = sum(self.service_s(i, q) for q in rep.outstanding.values()) / rep.slots
        return backlog + self.service_s(i, req)

    def _performance_optimized(self, req: Request, choices: list[int]) -> int:
        return min(choices, key=lambda i: (self._estimate(i, req), i))

    def _memory_aware(self, req: Request, choices: list[int]) -> int:
        return min(choices, key=lambda i: (self.replicas[i].kv_pressure(), self.replicas[i].outstanding_tokens, i))

    def _blend(self, req: Request, choices: list[int]) -> int:
        # Estimated completion, stretched as the replica's KV cache fills (a full cache means waiting).
        return min(choices, key=lambda i: (self._estimate(i, req) / max(0.05, 1 - self.replicas[i].kv_pressure()), i))
