"""activation_peaks over a schedule's trace (plan/trace.py) is the action-by-action walk it replaces: the
reference below walks every action, holding each stage's constant while any of its microbatches is held."""

from __future__ import annotations

import itertools

import pytest

from hybridpar.config import Config
from hybridpar.pipeline.schedules import SCHEDULES, Op, add_communication, compute_schedule
from hybridpar.plan.activations import (
    F32,
    activation_peaks,
    embedding_saved,
    ends_saved,
    layer_saved,
    step_saved,
    weight_casts,
    weight_held,
)
from hybridpar.plan.messages import buffered, in_place, message_bytes
from hybridpar.plan.trace import activation_trace


def _walk(terms: dict, actions: list[list], sizes: list[int], split: bool) -> list[int]:
    """Per rank, the peak of `live` walked action by action; `terms[(s, b)]` = (one, const, kept, inside, early):
    a B that frees its stage's constant frees `early` of it before its own high point."""
    peaks = []
    for acts in actions:
        live, held, peak = 0, {}, 0
        for a in acts:
            if a.op not in (Op.FORWARD, Op.BACKWARD, Op.WEIGHT):
                continue
            one, const, kept, inside, early = terms[a.stage, sizes[a.microbatch]]
            if a.op == Op.FORWARD:
                live += one + (const if not held.get(a.stage) else 0)
                held[a.stage] = held.get(a.stage, 0) + 1
            elif a.op == Op.BACKWARD:
                held[a.stage] -= 1
                if split:
                    peak = max(peak, live + inside - (early if not held[a.stage] else 0))
                live += kept - one - (const if not held[a.stage] else 0)
            else:
                live -= kept
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def _cfg(pp: int, recompute: str, schedule: str = "1f1b", v: int = 1) -> Config:
    cfg = Config()
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size = 64, 8, 4, 2, 96, 101
    cfg.parallel.pp, cfg.train.recompute, cfg.train.seq_len = pp, recompute, 16
    cfg.parallel.schedule, cfg.parallel.virtual_stages = schedule, v  # which stages share a rank
    return cfg


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_trace_peaks_match_the_walk(name: str) -> None:
    spec, checked = SCHEDULES[name], 0
    for pp, v, m in [(1, 1, 3), (2, 1, 4), (2, 2, 4), (4, 1, 8), (4, 2, 8), (3, 2, 6)]:
        if spec.virtual_stages is not None and v not in spec.virtual_stages:
            continue
        if spec.layout_problem(pp, v) or spec.count_problem(pp, m):
            continue
        compute = compute_schedule(name, pp, v, m)
        ranks = spec.stage_ranks(pp, v)
        full = add_communication(compute, pp, pp * v, 1, ranks=ranks)  # messages in the lists change nothing
        n = pp * v
        parts = [range(i * 8 // n, (i + 1) * 8 // n) for i in range(n)]
        sizes = [1 + (i % 3) for i in range(m)]  # unequal microbatches: the terms differ per size
        split = any(a.op == Op.WEIGHT for acts in compute for a in acts)
        # Distinct terms per (stage, size), so that a step priced with the wrong one would show.
        terms = {
            (s, b): (1000 * (s + 1) + 7 * b, 50 + s, 300 * b if split else 0, 11 * s - 5 * b, 3 * s + b)
            for s in range(n)
            for b in (1, 2, 3)
        }
        want = _walk(terms, compute, sizes, split)
        trace = activation_trace(sizes, full)
        assert _walk(terms, full, sizes, split) == want
        assert trace.split == split and len(trace.ranks) == pp
        got = _priced(trace, terms)
        assert got == want
        for recompute, precision in itertools.product(("none", "selective", "full"), ("fp32", "bf16")):
            cfg = _cfg(pp, recompute, name, v)  # the memory model's own terms, walked action by action
            cfg.train.precision = precision
            want = _walk(_model_terms(cfg, parts, sizes, split), full, sizes, split)
            assert activation_peaks(cfg, parts, sizes, compute) == want
            assert activation_peaks(cfg, parts, sizes, [], trace) == want
        checked += 1
    assert checked > 0


def _priced(trace, terms: dict) -> list[int]:  # noqa: ANN001 - the trace priced as activation_peaks prices it
    delta, above = [], []
    for op, s, b, edge in trace.steps:
        one, const, kept, inside, early = terms[s, b]
        d = one + const * edge if op == Op.FORWARD else (kept - one - const * edge if op == Op.BACKWARD else -kept)
        delta.append(d)
        above.append(inside - d - early * (edge and op == Op.BACKWARD))
    out = []
    for seq, bpos in zip(trace.ranks, trace.backwards):
        live, peak = 0, 0
        lives = []
        for x in seq:
            live += delta[x]
            lives.append(live)
            peak = max(peak, live)
        if trace.split:
            peak = max([peak] + [lives[i] + above[seq[i]] for i in bpos])
        out.append(peak)
    return out


def _model_terms(cfg: Config, parts: list[range], sizes: list[int], split: bool) -> dict:
    """(one, const, kept, inside, early) of every (stage, size) as plan/memory_model.py's docstrings define them."""
    n, replica, out = len(parts), sum(sizes), {}
    modes = cfg.train.recompute_modes(n)
    c = 2 if cfg.train.precision == "bf16" else F32
    ranks = SCHEDULES[cfg.parallel.schedule].stage_ranks(cfg.parallel.pp, n // cfg.parallel.pp)
    own = in_place(cfg) and buffered(cfg, split)  # a received message read where it landed: counted in buffers
    for s in range(n):
        first, last = s == 0, s == n - 1
        # autocast's weight casts: once per step where no stage of the rank recomputes, else per microbatch
        # (a recomputed layer's rerun makes its own).
        per_step = all(modes[o] == "none" for o in range(n) if ranks[o] == ranks[s])
        casts = weight_casts(cfg, len(parts[s]) if modes[s] == "none" else 0, last)
        const = step_saved(cfg, first, last, replica) + (casts if per_step else 0)
        for b in set(sizes):
            one = len(parts[s]) * layer_saved(cfg, b, modes[s]) + ends_saved(cfg, b, first, last)
            one += 0 if per_step else casts
            kept = weight_held(cfg, b, len(parts[s]), last) if split else 0
            # Under bf16 the fp32 inputs held for W beside their casts: the head's, and GPT-2's two per layer
            # (llama's layers read the norms' shared bf16 cast).
            per_layer = 2 * (modes[s] == "none") * (cfg.model.family != "llama")
            norms = per_layer * len(parts[s]) + last
            one += norms * b * cfg.train.seq_len * cfg.model.dim * F32 if split and c == 2 else 0
            bt_d = b * cfg.train.seq_len * cfg.model.dim
            # Recomputing, B's high point is the rerun of its first layer: every hold for W made, the stage's input
            # still saved, and what the embedding saved (its backward is B's last); the targets already freed
            # where B frees the stage's constant (the loss's backward is B's first).
            rerun = kept - one + bt_d * F32 + (embedding_saved(cfg, b) if first else 0)
            inside = (0 if last else bt_d * c) if modes[s] == "none" else rerun
            early = replica * cfg.train.seq_len * 8 if last and modes[s] != "none" else 0
            # The stage input read in place from a receive buffer, and under a split the gradient W keeps.
            recv = message_bytes(cfg, b) if own and s > 0 and ranks[s - 1] != ranks[s] else 0
            grad = message_bytes(cfg, b) if own and split and not last and ranks[s + 1] != ranks[s] else 0
            out[s, b] = (one - recv, const, kept - grad, inside - grad, early)
    return out
