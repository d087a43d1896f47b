"""The replica's iteration-level scheduler (serve/scheduler.py), pure: requests join micro-batches between
steps while seats and blocks last, newcomers prefill beside decodes in one packed step, finished ones
leave and their blocks serve others at once, and when blocks run out the youngest sequence not in the
pipeline is preempted (blocks freed, back to the front of the queue with what it generated)."""

from __future__ import annotations

import torch

from hybridpar.model.blocks import BlockAllocator
from hybridpar.serve.scheduler import Scheduler, Seq


def seq(order: int, prompt_len: int, out: list[int] | None = None, first: int = 1) -> Seq:
    req = {"id": f"r{order}", "prompt": list(range(first, first + prompt_len)), "max_tokens": 100}
    return Seq(req, torch.Generator(), 0.0, order, out=list(out or []))


def run(sched: Scheduler, step) -> None:
    """What the driver does when a step's logits come back: everything fed is cached, one token more."""
    for s, n in zip(step.rows, step.feeds):
        sched.ran(s, n)
        if not s.new:
            s.out.append(7)


def test_requests_join_between_steps_and_prefill_beside_decodes() -> None:
    sched = Scheduler(BlockAllocator(16, 4), max_batch=2, max_groups=1)
    a = seq(1, 5)
    sched.waiting.append(a)
    st = sched.next_step()
    assert st.rows == [a] and st.prefill == [True] and a.table == [0, 1]  # 5 tokens: 2 blocks
    x, meta = st.meta(scratch=16)
    assert x.tolist() == [[1, 2, 3, 4, 5]] and meta[:, 0].tolist() == [0, 5, 0, 1]
    run(sched, st)
    b, c = seq(2, 3), seq(3, 2)
    sched.waiting.extend([b, c])
    st = sched.next_step()  # a decodes, b joins (one seat left), c waits
    assert st.rows == [a, b] and st.prefill == [False, True] and list(sched.waiting) == [c]
    x, meta = st.meta(scratch=16)
    assert x.tolist() == [[7, 1, 2, 3]]  # a's last token, then b's prompt: packed, no padding
    assert meta[:2].tolist() == [[5, 0], [1, 3]] and meta[2:, 1].tolist() == [2, 16]  # b's table padded
    run(sched, st)
    sched.leave(a)  # finished: its seat and blocks are free for the next step
    assert a.table == [] and sched.alloc.used == 1
    st = sched.next_step()
    assert st.rows == [b, c] and st.prefill == [False, True] and not sched.waiting


def test_micro_batches_fill_and_the_one_in_flight_is_left_alone() -> None:
    sched = Scheduler(BlockAllocator(16, 4), max_batch=2, max_groups=2)
    sched.waiting.extend(seq(i, 3) for i in range(1, 5))
    first = sched.next_step()
    first.mb.in_flight = True
    second = sched.next_step()
    assert first.mb is not second.mb and len(first.rows) == len(second.rows) == 2
    second.mb.in_flight = True
    assert sched.next_step() is None  # both in the pipeline
    assert len(sched.running) == 4


def test_preemption_frees_the_youngest_idle_sequence_and_requeues_it_first() -> None:
    sched = Scheduler(BlockAllocator(3, 4), max_batch=2, max_groups=2)
    old, young, busy = seq(1, 4), seq(3, 4), seq(2, 3)
    for s in (old, young):
        sched.waiting.append(s)
    st = sched.next_step()
    run(sched, st)  # old and young: 4 + 4 tokens in their 2 blocks, each block full
    other = sched.mbs[1]
    assert sched.alloc.grow(busy.table, 3)
    other.seqs.append(busy)
    busy.cached = 3
    other.in_flight = True  # the youngest overall is not `busy`'s business: it is in the pipeline
    nxt = sched.next_step()  # old needs a 2nd block, none free: young (idle, youngest) gives its block back
    assert sched.preemptions == 1 and nxt.rows == [old] and young.cached == 0 and young.table == []
    assert list(sched.waiting) == [young] and young.out == [7]  # keeps what it generated: recomputed later
    assert young.tokens == [1, 2, 3, 4, 7] and busy.table and len(old.table) == 2
    run(sched, nxt)
    sched.leave(old)
    other.in_flight = False
    st = sched.next_step()  # back in once blocks are free: prompt + generated to prefill again
    assert young in st.rows and st.prefill[st.rows.index(young)]
    x, meta = st.meta(scratch=3)
    # Its first block's content (tokens 1-4, its prompt and old's) is still registered: shared, so only
    # the generated token is computed again.
    assert meta[:2, st.rows.index(young)].tolist() == [4, 1] and sched.prefix_hit_tokens == 4


def test_a_lone_sequence_without_a_block_preempts_itself_and_waits() -> None:
    sched = Scheduler(BlockAllocator(2, 2), max_batch=1, max_groups=2)
    a, b = seq(1, 2), seq(2, 2, first=50)  # prompts of their own: nothing to share
    sched.waiting.extend([a, b])
    sa = sched.next_step()
    run(sched, sa)
    sa.mb.in_flight = True
    sb = sched.next_step()  # b joins the other micro-batch: the last block
    run(sched, sb)
    assert sched.alloc.free == 0
    # b needs a block for its 3rd token; a (older) is in flight, so b itself gives way.
    assert sched.next_step() is None and list(sched.waiting) == [b] and b.table == []


def test_full_blocks_are_shared_by_the_same_prefix_and_kept_after_their_owner_leaves() -> None:
    from hybridpar.model.blocks import BlockAllocator as A

    a = A(6, 2)
    t1: list[int] = []
    assert a.grow(t1, 5) and a.commit(t1, [1, 2, 3, 4, 5], 0) == 2  # two full blocks registered
    assert a.match([1, 2, 3, 4, 9, 9]) == t1[:2] and a.used == 3  # shared: no new block taken
    assert a.match([1, 2, 3, 4]) == t1[:1]  # one token is always left to compute
    assert a.match([1, 2, 7, 7, 7]) == t1[:1] and a.match([2, 1, 3]) == []
    for _ in range(3):
        a.release(t1[:1] if _ else t1[:2])
    a.release(t1)
    assert a.free == 6 and a.match([1, 2, 3, 4, 5]) == [0, 1]  # freed, content kept until reused
    t2: list[int] = [0, 1]
    a.release(t2)
    t3: list[int] = []
    assert a.grow(t3, 12) and a.match([1, 2, 3, 4, 5]) == []  # every block handed out again: forgotten


def test_chunked_prefill_feeds_decodes_first_and_the_prompt_over_several_steps() -> None:
    sched = Scheduler(BlockAllocator(16, 4), max_batch=2, max_groups=1, max_step_tokens=4)
    a, b = seq(1, 2), seq(2, 9, first=50)
    sched.waiting.append(a)
    run(sched, sched.next_step())  # a: prompt in, first token out
    sched.waiting.append(b)
    feeds = []
    while b.new:
        st = sched.next_step()
        assert st.rows[0] is a and sum(st.feeds) <= 4  # a's decode first, then as much of b as fits
        feeds.append(st.feeds[1])
        run(sched, st)
    assert feeds == [3, 3, 3] and b.out == [7] and len(a.out) == 4  # b's first token after its last chunk
    assert sched.next_step().feeds == [1, 1]


def test_prefix_caching_off_computes_every_prompt_whole() -> None:
    for share, hit in ((True, 8), (False, 0)):
        sched = Scheduler(BlockAllocator(16, 4), max_batch=2, max_groups=1, share=share)
        sched.waiting.append(seq(1, 10))
        run(sched, sched.next_step())
        sched.waiting.append(seq(2, 10))  # the same prompt: two whole blocks computed already
        st = sched.next_step()
        assert st.feeds == [1, 10 - hit] and sched.prefix_hit_tokens == hit and sched.prefix_query_tokens == 20


def _simulate(seed: int) -> None:
    """One random replica (pool, block size, seats, step budget, pipeline depth, prompts sharing prefixes)
    driven as the driver drives it, the cache modelled as what each block slot holds: every step must read
    the tokens it attends to at their positions, write no shared block, and every request must end with the
    tokens it would get alone, its blocks all free again."""
    import random
    from collections import deque

    rng = random.Random(seed)
    bs, n_blocks, max_batch, pp = rng.choice([1, 2, 4]), rng.randint(3, 12), rng.randint(1, 3), rng.randint(1, 3)
    alloc = BlockAllocator(n_blocks, bs)
    sched = Scheduler(
        alloc, max_batch, rng.randint(1, 3), rng.choice([0, max_batch + 1, max_batch + 3]), rng.random() < 0.8
    )
    room = n_blocks * bs  # what the driver admits: prompt + max_tokens within the pool
    pattern = [1, 2, 3, 1, 2, 3, 4, 4]
    reqs = []
    for i in range(rng.randint(1, 8)):
        n = rng.randint(1, room - 1)
        prompt = [pattern[j % 8] if rng.random() < 0.7 else rng.randint(0, 4) for j in range(n)]
        reqs.append({"id": f"r{i}", "prompt": prompt, "max_tokens": rng.randint(1, room - n)})

    def next_token(tokens: list[int]) -> int:  # greedy: a function of the tokens so far
        return hash(tuple(tokens)) % 5

    slots: dict[tuple[int, int], int] = {}  # (block, offset) -> the token whose keys/values it holds
    todo, done, in_flight = deque(reqs), {}, deque()
    for _ in range(20_000):
        if todo and rng.random() < 0.3:
            sched.waiting.append(Seq(todo.popleft(), torch.Generator(), 0.0, len(reqs) - len(todo)))
        st = sched.next_step() if len(in_flight) < pp else None
        if st is not None:
            assert not sched.max_step_tokens or sum(st.feeds) <= sched.max_step_tokens, f"seed {seed}: over budget"
            st.mb.in_flight = True
            for s, n in zip(st.rows, st.feeds):
                tokens = s.tokens
                assert len(s.table) * bs >= s.cached + n, f"seed {seed}: {s.rid}'s table is short"
                for t in range(s.cached, s.cached + n):
                    at = (s.table[t // bs], t % bs)
                    assert alloc._refs[at[0]] == 1 or slots.get(at) == tokens[t], f"seed {seed}: shared block written"
                    slots[at] = tokens[t]
                got = [slots.get((s.table[t // bs], t % bs)) for t in range(s.cached + n)]
                assert got == tokens[: s.cached + n], f"seed {seed}: {s.rid} attends to stale keys/values"
            in_flight.append(st)
        elif in_flight:
            st = in_flight.popleft()
            st.mb.in_flight = False
            for s, n in zip(st.rows, st.feeds):
                sched.ran(s, n)
                if not s.new:
                    s.out.append(next_token(s.tokens))
                    if len(s.out) == s.req["max_tokens"]:
                        sched.leave(s)
                        done[s.rid] = s.out
        elif not todo:
            break
    assert alloc.free == n_blocks and not sched.waiting and not sched.running, f"seed {seed}: stuck or leaked"
    for r in reqs:
        tokens = list(r["prompt"])
        for _ in range(r["max_tokens"]):
            tokens.append(next_token(tokens))
        assert done[r["id"]] == tokens[len(r["prompt"]) :], f"seed {seed}: {r['id']} generated other tokens"


def test_random_replicas_keep_every_cache_read_exact_and_finish_every_request() -> None:
    """Preemption, prefix sharing and chunked prefill together, in random pools too small for their
    requests: nothing read stale, nothing shared overwritten, nothing left waiting, nothing leaked."""
    for seed in range(300):
        _simulate(seed)
