"""Iteration-level scheduling of one replica (continuous batching, Orca, Yu et al. 2022; over a paged KV
cache, vLLM, Kwon et al. 2023): the pure bookkeeping of which sequences run in which step.

The replica's running sequences are spread over `max_groups` micro-batches of at most `max_batch`
sequences each; up to pp micro-batches are in the pipeline at once (the driver keeps it full). Each time
a micro-batch is about to be launched its step is formed anew: sequences that finished have left, then

- every running sequence gets a block for its next token if its last one is full. When blocks run out,
  the youngest sequence not in the pipeline is preempted by recomputation: its blocks are freed and it
  goes back to the front of the queue with its prompt and what it generated so far, to be prefilled again
  (vLLM's recompute preemption) — greedy outputs do not change;
- waiting requests join (oldest first) while seats and blocks for their prompts last; whole blocks of a
  prompt that some sequence computed already are shared, not computed again (`model/blocks.py`);
- the step runs every sequence of the micro-batch: the newcomers' prefills beside the others' one-token
  decodes, their tokens packed into one row without padding (`model/kvcache.KVStep`), so a newcomer
  costs its own tokens, not a pipeline step of its own. Prefills are chunked (Sarathi, Agrawal et al.
  2024): a step feeds at most `max_step_tokens` tokens, decodes first, so a long prompt joining does
  not stall the others' decodes for its whole length; a prompt cut short goes on at the next step and
  yields its first token when its last chunk is in.

Nothing here touches torch.distributed: the driver turns a step into a tick.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridpar.model.blocks import BlockAllocator


@dataclass
class Seq:
    """One request while the replica holds it."""

    req: dict[str, Any]
    gen: torch.Generator
    arrived: float
    order: int  # arrival order: the largest is the youngest (the first preempted)
    out: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)  # its KV blocks
    cached: int = 0  # tokens whose keys/values are in its blocks
    committed: int = 0  # its full blocks registered for prefix sharing
    new: bool = True  # admitted, its first step (its prefill) not yet run
    cancelled: bool = False
    prefill_s: float = 0.0
    prompt_fed: int = 0  # tokens of its (last) prefill
    decode_s: float = 0.0
    decode_steps: int = 0
    scheduled: float | None = None  # when its first step was launched (the end of its queue time)

    @property
    def tokens(self) -> list[int]:
        return list(self.req["prompt"]) + self.out

    @property
    def rid(self) -> str:
        return self.req["id"]


@dataclass
class MicroBatch:
    seqs: list[Seq] = field(default_factory=list)
    in_flight: bool = False
    launched_at: float = 0.0


@dataclass
class Step:
    """What one tick runs: each row fed `feeds[i]` tokens of `tokens[cached:]` from position `cached`."""

    mb: MicroBatch
    rows: list[Seq]
    prefill: list[bool]  # per row: still prefilling (admitted, its prompt not all in the cache)
    feeds: list[int]

    def meta(self, scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (1, N): the rows' new tokens packed, meta (2 + NB, R): start, new tokens, block table padded
        with `scratch`)."""
        feeds = [s.tokens[s.cached : s.cached + n] for s, n in zip(self.rows, self.feeds)]
        R, NB = len(self.rows), max(len(s.table) for s in self.rows)
        x = torch.tensor([[t for f in feeds for t in f]], dtype=torch.int64)
        meta = torch.full((2 + NB, R), scratch, dtype=torch.int64)
        for i, (s, f) in enumerate(zip(self.rows, feeds)):
            meta[0, i], meta[1, i] = s.cached, len(f)
            meta[2 : 2 + len(s.table), i] = torch.tensor(s.table, dtype=torch.int64)
        return x, meta


class Scheduler:
    def __init__(
        self, alloc: BlockAllocator, max_batch: int, max_groups: int, max_step_tokens: int = 0, share: bool = True
    ) -> None:
        # Every decode of a full micro-batch fits a step, with a token to spare for a prefill.
        assert max_step_tokens == 0 or max_step_tokens > max_batch, "max_step_tokens must exceed max_batch"
        self.alloc, self.max_batch, self.max_step_tokens, self.share = alloc, max_batch, max_step_tokens, share
        self.waiting: deque[Seq] = deque()
        self.mbs = [MicroBatch() for _ in range(max_groups)]
        self.preemptions = 0
        self.prefix_hit_tokens = 0  # prompt tokens taken from shared blocks instead of computed
        self.prefix_query_tokens = 0  # prompt tokens looked up in the shared blocks (vLLM's queries)

    @property
    def running(self) -> list[Seq]:
        return [s for mb in self.mbs for s in mb.seqs]

    def leave(self, s: Seq) -> None:
        """`s` finished (or was cancelled): its seat and blocks are free for the next step."""
        for mb in self.mbs:
            if s in mb.seqs:
                mb.seqs.remove(s)
        self.alloc.release(s.table)

    def ran(self, s: Seq, fed: int) -> None:
        """`s`'s step came back: the `fed` tokens it fed are in the cache, and its full blocks can be shared.
        `s.new` stays True while its prompt is not all in (a chunked prefill: no token to sample yet)."""
        s.cached += fed
        s.new = s.cached < len(s.tokens)
        s.committed = self.alloc.commit(s.table, s.tokens[: s.cached], s.committed)

    def _admit(self, mb: MicroBatch) -> None:
        while self.waiting and len(mb.seqs) < self.max_batch:
            s = self.waiting[0]
            # A prefix someone computed already: shared, not recomputed (unless prefix caching is off).
            s.table = self.alloc.match(s.tokens) if self.share else []
            s.committed = len(s.table)
            if not self.alloc.grow(s.table, len(s.tokens)):
                self.alloc.release(s.table)
                return  # not enough blocks yet: it waits (first in line) for some to free
            s.cached = s.committed * self.alloc.block_size
            self.prefix_hit_tokens += s.cached
            self.prefix_query_tokens += len(s.tokens)
            s.new = True
            mb.seqs.append(self.waiting.popleft())

    def _preempt_youngest(self) -> Seq | None:
        idle = [s for mb in self.mbs if not mb.in_flight for s in mb.seqs]
        if not idle:
            return None
        victim = max(idle, key=lambda s: s.order)
        self.leave(victim)
        victim.cached = victim.committed = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return victim

    def step(self, mb: MicroBatch) -> Step | None:
        """Form `mb`'s next step (None when it has nothing to run)."""
        assert not mb.in_flight
        for s in sorted(mb.seqs, key=lambda s: s.order):  # the oldest get blocks first
            while s in mb.seqs and not s.new and not self.alloc.grow(s.table, s.cached + 1):
                if self._preempt_youngest() is None:
                    break
        self._admit(mb)
        budget = self.max_step_tokens or 1 << 62
        rows, feeds = [], []
        for s in sorted(mb.seqs, key=lambda s: s.new):  # decodes first: they always fit
            n = min(len(s.tokens) - s.cached, budget)
            if n > 0:
                rows.append(s)
                feeds.append(n)
                budget -= n
        return Step(mb, rows, [s.new for s in rows], feeds) if rows else None

    def next_step(self) -> Step | None:
        """The next step to launch: of the micro-batch not in flight that was launched longest ago."""
        for mb in sorted((m for m in self.mbs if not m.in_flight), key=lambda m: m.launched_at):
            if (st := self.step(mb)) is not None:
                return st
        return None
