"""The tiny model the command-line tests train, as `hybridpar train` flags: each test adds only the flags
of what it is about (layout, checkpoints, restarts)."""

from __future__ import annotations


def tiny_flags(steps: int, val_every: int = 0, sample_tokens: int = 0) -> list[str]:
    """Two layers of width 32, 4 sequences of 16 tokens per step in 2 microbatches, 100 kB of corpus."""
    flags = {
        "model.dim": 32,
        "model.n_layers": 2,
        "model.n_heads": 2,
        "model.ffn_dim": 64,
        "train.steps": steps,
        "train.global_batch": 4,
        "train.microbatches": 2,
        "train.seq_len": 16,
        "train.val_every": val_every,
        "train.sample_tokens": sample_tokens,
        "data.max_tokens": 100_000,
        "sinks.peak_probe_s": 0.01,  # the MFU peak probe: a few products, not 0.2 s (nothing reads the figure)
    }
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]
