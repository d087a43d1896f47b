"""The serving core between HTTP and the replicas: tokenises, places each request with the router,
forwards it to its replica's driver, and turns the replica's events back into per-request streams.
Measured replica status and completion costs feed the router; counters feed /metrics.

When a replica dies, each request on it is placed again on a live replica: none is lost while a replica
lives. One whose client has seen nothing yet starts over there; one half-streamed resumes there from its
prompt plus the tokens its client already holds, for the tokens still owed (vLLM's recompute, across
replicas): a greedy continuation is the uninterrupted one, token for token (the model is the same); a
sampled one is a sample of the same model given what was sent, not the tokens the dead replica would
have drawn (its generator state died with it; the resumed part is seeded from the request's seed and
the count sent, so a seeded request resumes the same way every time). Events are taken only from the
live replica a request is placed on now (checked under the lock that moves it), so a dead replica's
late tokens can neither leak into a moved request's stream nor be sent twice."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from hybridpar.config import ModelConfig
from hybridpar.data.corpus import BYTE_VOCAB, encode
from hybridpar.data.tokenizer import StreamDecoder, Tokenizer
from hybridpar.serve.api import ApiError
from hybridpar.serve.chat import DEFAULT_TEMPLATE, ChatTemplate
from hybridpar.serve.config import ServeConfig
from hybridpar.serve.metrics import ServeMetrics
from hybridpar.serve.pool import ReplicaPool
from hybridpar.serve.prefix import block_hashes
from hybridpar.serve.router import Request, Router
from hybridpar.serve.text import ByteDetokenizer, NoText
from hybridpar.serve.worker import WorkerSpec


class EventQueue(queue.Queue):
    """A request's events. `listener`, when set, is called after each one is queued (from the queuing
    thread), so that an asyncio front end can wait for events without a thread per request."""

    def __init__(self) -> None:
        super().__init__()
        self.listener: Callable[[], None] | None = None

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        if (wake := self.listener) is not None:
            wake()


@dataclass
class Pending:
    """One request in flight: its events arrive on `events` (('token', id) ..., ('done', info))."""

    id: str
    prompt_tokens: int
    max_tokens: int
    msg: dict[str, Any] = field(default_factory=dict)  # what the replica's driver is sent
    created: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.monotonic)  # arrival, for the latency histograms
    sent_at: float | None = None  # handed to its replica (the router's queue time ends)
    last_token_at: float = 0.0
    sent: bool = False  # handed to its replica's driver
    streamed: int = 0  # tokens handed to the client
    tokens: list[int] = field(default_factory=list)  # those tokens: a resumed request's prompt goes on with them
    events: EventQueue = field(default_factory=EventQueue)

    resumed_at: int = 0  # tokens already streamed when it was last sent (its replica's counts start there)

    def message(self) -> dict[str, Any]:
        """What its replica is sent now: the request, or, after tokens were streamed from a replica that
        died, its continuation (prompt + those tokens, for the tokens still owed)."""
        self.resumed_at = n = len(self.tokens)
        if not n:
            return self.msg
        seed = self.msg["seed"]
        return {
            **self.msg,
            "prompt": self.msg["prompt"] + self.tokens,
            "max_tokens": self.max_tokens - n,
            "seed": None if seed is None else (seed + n) % 2**63,
        }

    def finish(self, ev: dict[str, Any]) -> dict[str, Any]:
        """Its replica's `done` as the client sees it: a resumed request's counts are of the whole request."""
        if not self.resumed_at or ev.get("reason") == "error":
            return ev
        return {
            **ev,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": ev.get("completion_tokens", 0) + self.resumed_at,
        }


class Service:
    def __init__(
        self,
        cfg: ServeConfig,
        model: ModelConfig,
        source: str,
        pool: Callable[[WorkerSpec, Callable[[int, dict[str, Any]], None]], Any] = ReplicaPool,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        tok = tokenizer
        self.chat = ChatTemplate(
            (tok.chat_template if tok else None) or DEFAULT_TEMPLATE,
            {k: tok.special(k) for k in ("bos_token", "eos_token")} if tok else {},
        )
        # A chat answer ends at the end-of-sequence token (ChatML's <|im_end|>), which is not text.
        eos = tok.token_id(tok.special("eos_token")) if tok else None
        self.chat_stop_tokens = [eos] if eos is not None else []
        self.router = Router(cfg.dp, cfg.router())
        self.lock = threading.Lock()
        self.inflight: dict[str, Pending] = {}
        self._cancelled: dict[str, bool] = {}  # cancelled, awaiting the replica's done: completed?
        self.counters: Counter = Counter()
        self.closing = False
        self.replica_status: dict[int, dict[str, Any]] = {}  # each replica's latest measured status
        self.metrics = ServeMetrics(cfg.model_name, self.statistics)
        limits = {
            "max_batch": cfg.max_batch,
            "max_groups": cfg.max_groups,
            "kv_tokens": cfg.kv_tokens,
            "block_size": cfg.block_size,
            "max_step_tokens": cfg.max_step_tokens,
            "prefix_caching": cfg.prefix_caching,
            "max_seq_len": cfg.max_seq_len,
        }
        spec = WorkerSpec(
            model=dataclasses.asdict(model),
            source=source,
            tp=cfg.tp,
            pp=cfg.pp,
            dp=cfg.dp,
            limits=limits,
            slowdown=cfg.slowdowns(),
            timeout_s=cfg.timeout_s,
            backend=cfg.backend,
            dtype=cfg.dtype,
        )
        self.pool = pool(spec, self._on_event)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt: text through the model's tokenizer, or as UTF-8 bytes for a byte-level
        model (vocabulary 256) without one; any other model cannot take text (ApiError 400)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is not None:
            return self.tokenizer.encode(prompt)
        if self.model.vocab_size != BYTE_VOCAB:
            raise ApiError(
                400,
                f"this model has {self.model.vocab_size} token ids and the server no tokenizer for them: "
                f"send token ids or give --tokenizer",
                "prompt",
            )
        return encode(prompt)

    def detokenizer(self) -> ByteDetokenizer | StreamDecoder | NoText:
        """A fresh incremental decoder of one request's tokens (NoText: the answer has token ids only)."""
        if self.tokenizer is not None:
            return StreamDecoder(self.tokenizer)
        return ByteDetokenizer() if self.model.vocab_size == BYTE_VOCAB else NoText()

    def submit(
        self,
        prompt: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        stop_tokens: list[int] | None = None,
    ) -> Pending:
        """Place a request (raises Overloaded when every replica and the waiting queue are full,
        Unavailable when no replica is alive)."""
        p = Pending(f"cmpl-{uuid.uuid4().hex[:24]}", len(prompt), max_tokens)
        p.msg = {
            "type": "generate",
            "id": p.id,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "stop_tokens": stop_tokens or [],
        }
        with self.lock:
            req = Request(p.id, len(prompt), max_tokens, block_hashes(prompt, self.cfg.block_size))
            placed = self.router.submit(req, time.monotonic())
            self.inflight[p.id] = p
            self.counters["requests_total"] += 1
        self._send(placed)
        return p

    def _send(self, placed: list[tuple[Request, int]]) -> None:
        placed = list(placed)
        while placed:
            req, rep = placed.pop(0)
            p = self.inflight.get(req.id)
            if p is None:  # cancelled while it waited: free the place it was just given
                with self.lock:
                    placed += self.router.finished(req.id, time.monotonic()) if req.id in self.router.where else []
                    if self._cancelled.pop(req.id, None) is False:
                        self.counters["requests_cancelled"] += 1
                continue
            with self.lock:
                msg = p.message()
            # Its replica died after its last token (all it was owed, or its stop token), before its done:
            # resent, it would generate past its end.
            stopped = bool(p.tokens) and p.tokens[-1] in (msg.get("stop_tokens") or ())
            if stopped or msg["max_tokens"] < 1:
                self._on_event(rep, {"type": "done", "id": req.id, "reason": "stop" if stopped else "length"})
            elif self.pool.send(rep, msg):
                p.sent, p.sent_at = True, time.monotonic()
            else:  # the replica died before it got the request: place it again
                placed += self._replica_down(rep)

    def _replica_down(self, rep: int) -> list[tuple[Request, int]]:
        """Replica `rep` is dead: re-place its requests (returns those placements, to be sent: from the
        start, or resumed after what was streamed); with no replica left, fail the waiting requests."""
        with self.lock:
            held = self.router.down(rep)
            again = [rid for rid in held if rid in self.inflight]
            for rid in again:
                p = self.inflight[rid]
                if p.sent:
                    p.sent = False
                    self.counters["requests_resumed" if p.tokens else "requests_retried"] += 1
            placed = [pl for rid in again for pl in self.router.requeue(rid)]
            stranded = self.router.abandon()
        for rid in held:
            if rid not in again:
                self._fail(rid, f"replica {rep} stopped")
        for req in stranded:
            self._fail(req.id, f"no replica is running (the last one, replica {rep}, stopped)")
        return placed

    def _fail(self, rid: str, why: str) -> None:
        with self.lock:
            p = self.inflight.pop(rid, None)
            # One its client had ended (a stop string matched, or it timed out) did not fail: its done was lost.
            done_by_client = self._cancelled.pop(rid, None)
            # Freeing its place may place waiting requests: they must be sent, not forgotten.
            placed = self.router.finished(rid, time.monotonic()) if rid in self.router.where else []
            self.counters[
                "requests_failed"
                if done_by_client is None
                else "requests_completed"
                if done_by_client
                else "requests_cancelled"
            ] += 1
        if p is not None:
            p.events.put(("done", {"reason": "error", "error": why}))
        self._send(placed)

    def cancel(self, rid: str, completed: bool = False) -> None:
        """The request is over for its client: a stop string matched (`completed`), or it timed out.
        Stop tracking it and tell its replica to stop generating it; the replica's `done` (reason
        "cancelled") then frees its place in the router and counts it as completed or cancelled."""
        with self.lock:
            p = self.inflight.pop(rid, None)
            rep = self.router.where.get(rid)
            if p is not None:
                self._cancelled[rid] = completed
        if p is not None and p.sent and rep is not None:
            self.pool.send(rep, {"type": "cancel", "id": rid})

    def _current(self, rep: int, rid: str) -> bool:
        """Whether `rep` is alive and holds `rid`: only its events count (a dead one's late tokens would
        be streamed twice, once from it and once resumed elsewhere)."""
        return self.router.where.get(rid) == rep and self.router.replicas[rep].alive

    def _on_event(self, rep: int, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        if kind in ("token", "done") and not self._current(rep, ev["id"]):
            return  # from a replica the request is no longer on (it died and the request moved)
        if kind == "token":
            with self.lock:  # against _replica_down: a token is streamed, or the request moves without it
                p = self.inflight.get(ev["id"])
                if p is None or not self._current(rep, ev["id"]):
                    return
                now = time.monotonic()
                (self.metrics.itl if p.streamed else self.metrics.ttft).observe(now - (p.last_token_at or p.t0))
                p.streamed, p.last_token_at = p.streamed + 1, now
                p.tokens.append(ev["token"])
                p.events.put(("token", ev["token"]))
        elif kind == "done":
            with self.lock:
                p = self.inflight.pop(ev["id"], None)
                ev = p.finish(ev) if p is not None else ev
                placed = (
                    self.router.finished(
                        ev["id"], time.monotonic(), ev.get("prefill_s_per_token"), ev.get("decode_s_per_token")
                    )
                    if ev["id"] in self.router.where
                    else []
                )
                done_by_client = self._cancelled.pop(ev["id"], None)
                self.counters[
                    "requests_failed"
                    if ev.get("reason") == "error"
                    else "requests_cancelled"
                    if done_by_client is False
                    else "requests_completed"
                ] += 1
                self.counters["prompt_tokens_total"] += ev.get("prompt_tokens", 0)
                self.counters["completion_tokens_total"] += ev.get("completion_tokens", 0)
            if p is not None:
                if ev.get("reason") != "error":
                    now = time.monotonic()
                    queued = (p.sent_at or now) - p.t0 + ev.get("queue_s", 0.0)
                    n_in, n_out = ev.get("prompt_tokens", 0), ev.get("completion_tokens", 0)
                    self.metrics.finished(now - p.t0, queued, n_in, n_out)
                p.events.put(("done", ev))
            self._send(placed)
        elif kind == "status":
            with self.lock:
                last = self.replica_status.get(rep, {})
                self.metrics.prefix(
                    ev.get("prefix_query_tokens", 0) - last.get("prefix_query_tokens", 0),
                    ev.get("prefix_hit_tokens", 0) - last.get("prefix_hit_tokens", 0),
                )
                self.replica_status[rep] = ev
                self.router.report(
                    rep,
                    ev["kv_used_tokens"],
                    ev["kv_capacity_tokens"],
                    ev["queue_depth"],
                    ev["queued_tokens"],
                    ev["busy_s"],
                    time.monotonic(),
                    ev["slots"],
                )
        elif kind == "replica_failed" and not self.closing:
            self._send(self._replica_down(rep))

    def alive(self) -> int:
        return sum(self.pool.alive)

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of /health: 200 while every worker of every replica runs, else 503 naming
        the workers that died (the pool watches each one, pipeline stages and tp shards alike)."""
        alive = self.alive()
        ok = alive == self.cfg.dp
        return (200 if ok else 503), {
            "status": "ok" if ok else "degraded",
            "replicas_alive": alive,
            "replicas": self.cfg.dp,
            "failed_workers": list(self.pool.failures),
        }

    def statistics(self) -> dict[str, Any]:
        with self.lock:
            st = self.router.statistics()
            live = [self.replica_status.get(i, {}) for i, r in enumerate(st["replicas"]) if r["alive"]]
            return {
                **st,
                "counters": dict(self.counters),
                "replicas_alive": self.alive(),
                "running": sum(r.get("running", 0) for r in live),
                "waiting": st["pending"] + sum(r.get("queue_depth", 0) for r in live),
            }

    def close(self) -> None:
        self.closing = True
        self.pool.close()
