"""The replica's driver (rank pp=0, tp=0): batches requests continuously over the paged KV cache
(`scheduler.py`: requests join and leave between steps), keeps up to pp micro-batches in flight through
the pipeline, samples, and reports tokens, completions and measured status.

Requests and events are plain JSON-able dicts exchanged through a `Channel` (a pipe to the server, or
a list in tests). Everything reported is measured here: step wall times (launch to logits, so they
include the pipeline's waits), KV blocks actually held, queue depth, busy fraction, preemptions.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hybridpar.model.blocks import BlockAllocator
from hybridpar.serve.engine import OP_NOOP, OP_STEP, OP_STOP, StageRunner, Tick
from hybridpar.serve.sampling import make_generator, sample_token
from hybridpar.serve.scheduler import Scheduler, Seq, Step


class Channel(Protocol):
    def recv(self, timeout_s: float) -> list[dict[str, Any]]: ...
    def send(self, event: dict[str, Any]) -> None: ...


@dataclass
class Limits:
    max_batch: int = 8  # sequences per step (one micro-batch)
    max_groups: int = 4  # micro-batches: at most max_batch x max_groups sequences run at once
    kv_tokens: int = 32768  # KV-cache budget in tokens (rounded down to whole blocks)
    block_size: int = 16  # tokens per KV block
    max_step_tokens: int = 0  # tokens one step feeds at most (prefills chunked); 0 = no limit
    max_seq_len: int = 2048  # prompt + completion
    prefix_caching: bool = True  # share whole prompt blocks computed already
    heartbeat_s: float = 2.0  # an idle driver sends a NOOP tick this often (keeps waits bounded)
    status_every_s: float = 0.05

    @property
    def kv_blocks(self) -> int:
        return max(1, self.kv_tokens // self.block_size)


class Driver:
    def __init__(self, runner: StageRunner, channel: Channel, limits: Limits) -> None:
        self.r, self.ch, self.lim = runner, channel, limits
        # The pool's shape is the stages' (they allocated it): the driver only keeps its free list.
        self.alloc = BlockAllocator(runner.cache.n_blocks, runner.cache.block_size)
        self.sched = Scheduler(
            self.alloc, limits.max_batch, limits.max_groups, limits.max_step_tokens, limits.prefix_caching
        )
        self.in_flight: deque[tuple[Step, int, torch.Tensor | None]] = deque()
        self.seq = self.arrivals = 0
        self.max_in_flight = 0
        self.busy_s = 0.0
        self.completed = 0
        self._last_tick = self._last_status = time.perf_counter()
        self._busy_mark: float | None = None
        self._stopping = False

    # -- admission ---------------------------------------------------------------------------------
    def _admit(self, msg: dict[str, Any]) -> None:
        if msg.get("type") == "stop":
            self._stopping = True
            return
        if msg.get("type") == "cancel":  # a stop string matched, or the client left
            self._cancel(msg["id"])
            return
        prompt, n = list(msg["prompt"]), int(msg["max_tokens"])
        limit = min(self.lim.max_seq_len, self.alloc.n_blocks * self.alloc.block_size)
        if not prompt or n < 1 or len(prompt) + n > limit:
            self.ch.send(
                {
                    "type": "done",
                    "id": msg["id"],
                    "reason": "error",
                    "tokens": [],
                    "error": f"prompt of {len(prompt)} tokens + max_tokens={n} must be between 2 and "
                    f"{limit} tokens (max_seq_len and the KV-cache budget)",
                }
            )
            return
        seed = msg.get("seed")
        seed = int.from_bytes(os.urandom(8), "little") >> 1 if seed is None else int(seed)
        self.arrivals += 1
        self.sched.waiting.append(Seq(msg, make_generator(seed), time.perf_counter(), self.arrivals))

    def _cancel(self, rid: str) -> None:
        """Stop generating `rid`: a waiting request, or a running one not in the pipeline, ends now; one in
        the pipeline ends when its step comes back. Unknown ids (already finished) are ignored."""
        for s in self.sched.waiting:
            if s.rid == rid:
                self.sched.waiting.remove(s)
                self.alloc.release(s.table)
                self._finish(s, "cancelled", time.perf_counter())
                return
        for mb in self.sched.mbs:
            for s in mb.seqs:
                if s.rid == rid:
                    s.cancelled = True
                    if not mb.in_flight:
                        self.sched.leave(s)
                        self._finish(s, "cancelled", time.perf_counter())
                    return

    # -- ticks -------------------------------------------------------------------------------------
    def _issue(self, tick: Tick) -> torch.Tensor | None:
        self.r.broadcast_tick(tick)
        self._last_tick = time.perf_counter()
        return self.r.run(tick)

    def _launch(self, st: Step) -> None:
        x, meta = st.meta(self.r.cache.scratch)
        self.seq += 1
        tick = Tick(OP_STEP, self.seq, meta.to(self.r.device), x.to(self.r.device))
        if self.r.pp > 1:
            self.r.post_logits_recv(self.seq, len(st.rows))
        st.mb.in_flight, st.mb.launched_at = True, time.perf_counter()
        if self._busy_mark is None:
            self._busy_mark = st.mb.launched_at
        for s in st.rows:
            if s.scheduled is None:
                s.scheduled = st.mb.launched_at
        self.in_flight.append((st, self.seq, self._issue(tick)))
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))

    def _complete(self) -> None:
        st, seq, logits = self.in_flight.popleft()
        if logits is None:
            logits = self.r.wait_logits(seq)
        now = time.perf_counter()
        dt = now - st.mb.launched_at
        st.mb.in_flight = False
        if not self.in_flight and self._busy_mark is not None:
            self.busy_s += now - self._busy_mark
            self._busy_mark = None
        fed = sum(st.feeds)
        for i, s in enumerate(st.rows):
            if s.cancelled:
                self.sched.leave(s)
                self._finish(s, "cancelled", now)
                continue
            if st.prefill[i]:
                s.prefill_s, s.prompt_fed = s.prefill_s + dt, s.prompt_fed + fed
            else:
                s.decode_s, s.decode_steps = s.decode_s + dt, s.decode_steps + 1
            self.sched.ran(s, st.feeds[i])
            if s.new:
                continue  # a chunk of its prompt: no token yet
            q = s.req
            tok = sample_token(logits[i], float(q.get("temperature", 0.0)), float(q.get("top_p", 1.0)), s.gen)
            s.out.append(tok)
            self.ch.send({"type": "token", "id": s.rid, "token": tok})
            stopped = tok in (q.get("stop_tokens") or ())
            if stopped or len(s.out) >= int(q["max_tokens"]):
                self.sched.leave(s)
                # A stop token that is also the last allowed one is a stop (OpenAI's and vLLM's finish_reason).
                self._finish(s, "stop" if stopped else "length", now)

    def _finish(self, s: Seq, reason: str, now: float) -> None:
        self.completed += 1
        self.ch.send(
            {
                "type": "done",
                "id": s.rid,
                "reason": reason,
                "tokens": s.out,
                "prompt_tokens": len(s.req["prompt"]),
                "completion_tokens": len(s.out),
                "latency_s": now - s.arrived,
                # Waiting for a seat here (a request cancelled while it waited waited all its time).
                "queue_s": (s.scheduled if s.scheduled is not None else now) - s.arrived,
                # Measured per-token costs for the router: prefill seconds per token of its prefill step,
                # decode seconds per step (one token per row).
                "prefill_s_per_token": s.prefill_s / max(1, s.prompt_fed),
                "decode_s_per_token": s.decode_s / s.decode_steps if s.decode_steps else None,
            }
        )

    def status(self, now: float) -> dict[str, Any]:
        busy = self.busy_s + (now - self._busy_mark if self._busy_mark is not None else 0.0)
        bs = self.alloc.block_size
        return {
            "type": "status",
            "kv_used_tokens": self.alloc.used * bs,
            "kv_capacity_tokens": self.alloc.n_blocks * bs,
            "kv_bytes": self.r.kv_bytes(),
            "queue_depth": len(self.sched.waiting),
            "queued_tokens": sum(len(s.tokens) + int(s.req["max_tokens"]) - len(s.out) for s in self.sched.waiting),
            "running": len(self.sched.running),
            "busy_s": busy,
            "slots": self.lim.max_batch * self.lim.max_groups,
            "completed": self.completed,
            "preemptions": self.sched.preemptions,
            "prefix_hit_tokens": self.sched.prefix_hit_tokens,
            "prefix_query_tokens": self.sched.prefix_query_tokens,
            "max_in_flight": self.max_in_flight,
            "time": now,
        }

    # -- main loop ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        pp, sched = self.r.pp, self.sched
        while True:
            idle = not self.in_flight and not sched.running and not sched.waiting
            for msg in self.ch.recv(min(self.lim.heartbeat_s, self.lim.status_every_s * 4) if idle else 0.0):
                self._admit(msg)
            st = sched.next_step() if len(self.in_flight) < pp else None
            if st is not None:
                self._launch(st)
            elif self.in_flight:
                self._complete()
            elif self._stopping and not sched.waiting and not sched.running:
                break
            now = time.perf_counter()
            if now - self._last_tick > self.lim.heartbeat_s:
                self._issue(Tick(OP_NOOP))
            if now - self._last_status > self.lim.status_every_s:
                self.ch.send(self.status(now))
                self._last_status = now
        self._issue(Tick(OP_STOP))
        self.r.drain()
        final = self.status(time.perf_counter())
        self.ch.send(final)
        return final
