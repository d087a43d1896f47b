"""The paged KV cache (model/kvcache.py): the allocator's free list and block tables, and logits of
paged prefills and decodes over scattered blocks, several sequences of different lengths in one step, equal
to those of the same sequence laid out contiguously (blocks 0, 1, 2, ...), alone, and close to the
full forward without a cache."""

from __future__ import annotations

import pytest
import torch

from hybridpar.config import ModelConfig
from hybridpar.model.blocks import BlockAllocator
from hybridpar.model.registry import build_full_model

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
GPT2 = ModelConfig(family="gpt2", dim=32, n_layers=2, n_heads=4, ffn_dim=64, n_positions=64)
BS = 4


def test_allocator_grows_tables_frees_and_refuses_when_out_of_blocks() -> None:
    a = BlockAllocator(5, BS)
    t1, t2 = [], []
    assert a.grow(t1, 1) and t1 == [0] and a.grow(t1, 4) and t1 == [0]  # one block holds 4 tokens
    assert a.grow(t1, 5) and t1 == [0, 1] and a.blocks_for(9) == 3
    assert a.grow(t2, 12) and t2 == [2, 3, 4] and a.free == 0 and a.used == 5
    assert not a.grow(t1, 9) and t1 == [0, 1]  # refused: unchanged
    a.release(t2)
    assert t2 == [] and a.free == 3 and a.grow(t1, 9) and len(t1) == 3
    with pytest.raises(AssertionError, match="freed twice"):
        a.release([t1[0], t1[0]])
    with pytest.raises(ValueError, match="n_blocks >= 1"):
        BlockAllocator(0, 16)


def _cache(model):
    return model.new_cache(12, BS, torch.device("cpu"), torch.float32)


def _run(model, cache, rows: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """One step: rows of (tokens, start position, block table), packed into one row -> logits (R, V)."""
    NB = max(len(r[2]) for r in rows)
    x = torch.tensor([[t for r in rows for t in r[0]]])
    tables = torch.full((len(rows), NB), cache.scratch, dtype=torch.int64)
    for i, (_, _, table) in enumerate(rows):
        tables[i, : len(table)] = torch.tensor(table)
    pos = torch.tensor([r[1] for r in rows])
    n = torch.tensor([len(r[0]) for r in rows])
    return model.forward_cached(x, cache, pos, n, tables)


def _generate(model, cache, seqs: dict[str, list[int]], tables: dict[str, list[int]], steps: int) -> dict:
    """Prefill every sequence in one step, then `steps` greedy decodes of all at once -> logits per step."""
    names = list(seqs)
    logits = {k: [] for k in names}
    out = _run(model, cache, [(seqs[k], 0, tables[k]) for k in names])
    toks = {k: seqs[k] + [int(out[i].argmax())] for i, k in enumerate(names)}
    for i, k in enumerate(names):
        logits[k].append(out[i])
    for _ in range(steps):
        out = _run(model, cache, [([toks[k][-1]], len(toks[k]) - 1, tables[k]) for k in names])
        for i, k in enumerate(names):
            logits[k].append(out[i])
            toks[k].append(int(out[i].argmax()))
    return logits


@pytest.mark.parametrize("cfg", [CFG, GPT2], ids=["llama", "gpt2"])
def test_paged_decode_over_scattered_blocks_equals_contiguous_layout(cfg: ModelConfig) -> None:
    model = build_full_model(cfg, 5).eval()
    seqs = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [1, 2], "c": list(range(20, 33))}
    steps = 6
    # Scattered, interleaved blocks: each sequence's table out of order and between the others'.
    scattered = {"a": [7, 2, 11, 1], "b": [4, 9, 6], "c": [0, 10, 3, 8, 5]}
    batched = _generate(model, _cache(model), seqs, scattered, steps)
    for k, prompt in seqs.items():
        contiguous = list(range(len(scattered[k])))
        want = _generate(model, _cache(model), {k: prompt}, {k: contiguous}, steps)[k]
        paged = _generate(model, _cache(model), {k: prompt}, {k: scattered[k]}, steps)[k]
        # Alone, scattered blocks give bit for bit what contiguous ones give: the same values, the same mask.
        assert all(torch.equal(g, w) for g, w in zip(paged, want)), k
        # Packed beside other sequences (their keys masked out) only the kernels' summation order changes.
        assert all(torch.allclose(g, w, atol=1e-5, rtol=1e-5) for g, w in zip(batched[k], want)), k
        # And the cache is right: the full forward of the same tokens agrees to fp32 rounding.
        toks = prompt + [int(w.argmax()) for w in want[:-1]]
        full = model(torch.tensor([toks]))[0, len(prompt) - 1 :]
        assert torch.allclose(torch.stack(want), full, atol=1e-5, rtol=1e-5), k
