"""The replica's driver (rank pp=0, tp=0): admits requests into groups, keeps up to pp groups in
flight through the pipeline, samples, and reports tokens, completions and measured status.

Requests and events are plain JSON-able dicts exchanged through a `Channel` (a pipe to the server, or
a list in tests). Everything reported is measured here: step wall times (launch to logits, so they
include the pipeline's waits), KV-cache slots actually allocated, queue depth, busy fraction.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hybridpar.serve.engine import OP_DECODE, OP_FREE, OP_NOOP, OP_PREFILL, OP_STOP, StageRunner, Tick
from hybridpar.serve.sampling import make_generator, sample_token


class Channel(Protocol):
    def recv(self, timeout_s: float) -> list[dict[str, Any]]: ...
    def send(self, event: dict[str, Any]) -> None: ...


@dataclass
class Limits:
    max_batch: int = 8  # sequences per group
    max_groups: int = 4  # groups holding a KV cache at once
    kv_tokens: int = 32768  # KV-cache budget in token slots (per group: rows × its longest sequence)
    max_seq_len: int = 2048  # prompt + completion
    heartbeat_s: float = 2.0  # an idle driver sends a NOOP tick this often (keeps waits bounded)
    status_every_s: float = 0.05


@dataclass
class _Row:
    req: dict[str, Any]
    gen: torch.Generator
    arrived: float
    out: list[int] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False  # the server no longer wants it: finished at its group's next step


@dataclass
class _Group:
    gid: int
    rows: list[_Row]
    max_len: int
    lens: torch.Tensor  # (B,) tokens in the cache per row
    prefilled: bool = False
    in_flight: bool = False
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    launched_at: float = 0.0

    @property
    def slots(self) -> int:
        return len(self.rows) * self.max_len


class Driver:
    def __init__(self, runner: StageRunner, channel: Channel, limits: Limits) -> None:
        self.r, self.ch, self.lim = runner, channel, limits
        self.pending: deque[_Row] = deque()
        self.groups: dict[int, _Group] = {}
        self.in_flight: deque[tuple[_Group, int, torch.Tensor | None]] = deque()
        self.next_gid = self.seq = 0
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
        limit = min(self.lim.max_seq_len, self.lim.kv_tokens)
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
        self.pending.append(_Row(msg, make_generator(seed), time.perf_counter()))

    def _cancel(self, rid: str) -> None:
        """Stop generating `rid`: a waiting request ends now; a running one ends at its group's next
        completed step (rows only finish there, where the group's cache is freed with its last row).
        Unknown ids (already finished) are ignored."""
        for row in self.pending:
            if row.req["id"] == rid:
                self.pending.remove(row)
                self.ch.send(
                    {
                        "type": "done",
                        "id": rid,
                        "reason": "cancelled",
                        "tokens": [],
                        "prompt_tokens": len(row.req["prompt"]),
                        "completion_tokens": 0,
                    }
                )
                return
        for g in self.groups.values():
            for row in g.rows:
                if row.req["id"] == rid and not row.done:
                    row.cancelled = True

    def kv_used(self) -> int:
        return sum(g.slots for g in self.groups.values())

    def _form_groups(self) -> None:
        while self.pending and len(self.groups) < self.lim.max_groups:
            rows: list[_Row] = []
            max_len = 0
            for row in list(self.pending)[: self.lim.max_batch]:
                need = len(row.req["prompt"]) + int(row.req["max_tokens"])
                if self.kv_used() + (len(rows) + 1) * max(max_len, need) > self.lim.kv_tokens:
                    break
                rows.append(row)
                max_len = max(max_len, need)
            if not rows:
                return  # no KV room yet: requests wait in `pending` (reported as queue depth)
            for _ in rows:
                self.pending.popleft()
            lens = torch.tensor([len(r.req["prompt"]) for r in rows], dtype=torch.int64)
            self.groups[self.next_gid] = _Group(self.next_gid, rows, max_len, lens)
            self.next_gid += 1

    # -- ticks -------------------------------------------------------------------------------------
    def _issue(self, tick: Tick) -> torch.Tensor | None:
        self.r.broadcast_tick(tick)
        self._last_tick = time.perf_counter()
        return self.r.run(tick)

    def _launch(self, g: _Group) -> None:
        B, dev = len(g.rows), self.r.device
        if not g.prefilled:
            T = int(g.lens.max())
            x = torch.zeros(B, T, dtype=torch.int64)
            for i, row in enumerate(g.rows):
                x[i, : len(row.req["prompt"])] = torch.tensor(row.req["prompt"], dtype=torch.int64)
            meta = torch.stack([torch.zeros(B, dtype=torch.int64), g.lens])
            op = OP_PREFILL
        else:
            # (A row cancelled before its first token has no last token: any id does, its output is ignored.)
            x = torch.tensor([[r.out[-1] if r.out else 0] for r in g.rows], dtype=torch.int64)
            # A finished row keeps rewriting its last slot: its output is ignored, its cache stays in bounds.
            pos = torch.tensor([int(g.lens[i]) - (1 if r.done else 0) for i, r in enumerate(g.rows)])
            meta = torch.stack([pos, torch.ones(B, dtype=torch.int64)])
            op = OP_DECODE
        self.seq += 1
        tick = Tick(op, g.gid, self.seq, g.max_len, meta.to(dev), x.to(dev))
        if self.r.pp > 1:
            self.r.post_logits_recv(self.seq, B)
        g.in_flight, g.launched_at = True, time.perf_counter()
        if self._busy_mark is None:
            self._busy_mark = g.launched_at
        self.in_flight.append((g, self.seq, self._issue(tick)))
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))

    def _complete(self) -> None:
        g, seq, logits = self.in_flight.popleft()
        if logits is None:
            logits = self.r.wait_logits(seq)
        now = time.perf_counter()
        dt = now - g.launched_at
        g.in_flight = False
        if not self.in_flight and self._busy_mark is not None:
            self.busy_s += now - self._busy_mark
            self._busy_mark = None
        if not g.prefilled:
            g.prefilled, g.prefill_s = True, dt
        else:
            g.decode_s += dt
            g.decode_steps += 1
            g.lens += torch.tensor([0 if r.done else 1 for r in g.rows])
        for i, row in enumerate(g.rows):
            if row.done:
                continue
            if row.cancelled:
                row.done = True
                self._finish(g, row, "cancelled", now)
                continue
            q = row.req
            tok = sample_token(logits[i], float(q.get("temperature", 0.0)), float(q.get("top_p", 1.0)), row.gen)
            row.out.append(tok)
            self.ch.send({"type": "token", "id": q["id"], "token": tok})
            if len(row.out) >= int(q["max_tokens"]) or tok in (q.get("stop_tokens") or ()):
                row.done = True
                self._finish(g, row, "length" if len(row.out) >= int(q["max_tokens"]) else "stop", now)
        if all(r.done for r in g.rows):
            del self.groups[g.gid]
            self._issue(Tick(OP_FREE, g.gid))

    def _finish(self, g: _Group, row: _Row, reason: str, now: float) -> None:
        self.completed += 1
        prompt_tokens = sum(len(r.req["prompt"]) for r in g.rows)
        self.ch.send(
            {
                "type": "done",
                "id": row.req["id"],
                "reason": reason,
                "tokens": row.out,
                "prompt_tokens": len(row.req["prompt"]),
                "completion_tokens": len(row.out),
                "latency_s": now - row.arrived,
                # Measured per-token costs for the router: prefill seconds per prompt token of the group,
                # decode seconds per step (one token per row).
                "prefill_s_per_token": g.prefill_s / max(1, prompt_tokens),
                "decode_s_per_token": g.decode_s / g.decode_steps if g.decode_steps else None,
            }
        )

    def status(self, now: float) -> dict[str, Any]:
        busy = self.busy_s + (now - self._busy_mark if self._busy_mark is not None else 0.0)
        return {
            "type": "status",
            "kv_used_tokens": self.kv_used(),
            "kv_capacity_tokens": self.lim.kv_tokens,
            "kv_bytes": self.r.kv_bytes(),
            "queue_depth": len(self.pending),
            "queued_tokens": sum(len(r.req["prompt"]) + int(r.req["max_tokens"]) for r in self.pending),
            "running": sum(len(g.rows) for g in self.groups.values()),
            "busy_s": busy,
            "slots": self.lim.max_batch * self.lim.max_groups,
            "completed": self.completed,
            "max_in_flight": self.max_in_flight,
            "time": now,
        }

    # -- main loop ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        pp = self.r.pp
        while True:
            ready = [g for g in self.groups.values() if not g.in_flight]
            wait = 0.0 if (ready or self.in_flight) else min(self.lim.heartbeat_s, self.lim.status_every_s * 4)
            for msg in self.ch.recv(wait):
                self._admit(msg)
            self._form_groups()
            ready = [g for g in self.groups.values() if not g.in_flight]
            if ready and len(self.in_flight) < pp:
                # The group that has waited longest goes next (a new group, never launched, first).
                self._launch(min(ready, key=lambda g: g.launched_at))
            elif self.in_flight:
                self._complete()
            elif self._stopping and not self.pending:
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
