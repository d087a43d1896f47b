"""Published GPU training runs (docs/planner/published.toml) as the planner sees them: a row as a hybridpar
Config, its published throughput as tokens/s per GPU, and the training FLOPs per token as its source
counted them. Read by `hybridpar bench published_compare` and checked by tests/test_published_runs.py.
The rows and cluster files live in the source tree's docs/planner/, not in an installed package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridpar.config import Config, ModelConfig, load_toml
from hybridpar.report.mfu import model_flops_per_token

PLANNER_DOCS = Path(__file__).resolve().parents[2] / "docs" / "planner"


def load_runs() -> list[dict[str, Any]]:
    return load_toml(str(PLANNER_DOCS / "published.toml"))["run"]  # tomllib (tomli before Python 3.11)


def load_cluster(row: dict[str, Any]) -> dict[str, Any]:
    return load_toml(str(PLANNER_DOCS / row["cluster"]))


def microbatches(row: dict[str, Any]) -> int:
    """Microbatches per replica: the published microbatch size, else 1 (the most microbatches, the layout
    that validation is strictest about)."""
    return row["global_batch"] // (row["dp"] * row.get("microbatch_size", 1))


def row_config(row: dict[str, Any]) -> Config:
    """The row as a hybridpar Config: its model, its layout, its batch; everything else our defaults."""
    model = {k: row[k] for k in ("family", "n_layers", "dim", "n_heads", "ffn_dim", "vocab_size")}
    if "n_kv_heads" in row:
        model["n_kv_heads"] = row["n_kv_heads"]
    if row["family"] == "gpt2":  # learned positions: as many as the run's sequence
        model["n_positions"] = row["seq_len"]
    chunks = row.get("virtual_stages", 1)
    parallel = {k: row[k] for k in ("tp", "pp", "dp")} | {"zero": row.get("zero", 0)}
    parallel["sequence_parallel"] = row.get("sequence_parallel", False)
    parallel["cp"] = row.get("cp", 1)
    # Every row ran on GPUs: messages between stages go through the process group (NCCL), which the memory
    # model counts as such (plan/messages.transport), whatever machine computes the comparison.
    parallel["backend"] = "nccl"
    if chunks > 1:
        parallel.update(schedule="interleaved-1f1b", virtual_stages=chunks)
    train = {
        "global_batch": row["global_batch"],
        "microbatches": microbatches(row),
        "seq_len": row["seq_len"],
        "precision": "fp32" if row["precision"] == "fp32" else "bf16",
        "recompute": row.get("recompute", "none"),
        "bf16_weights": row.get("bf16_weights", "autocast"),
    }
    return Config.from_dict({"model": model, "parallel": parallel, "train": train})


def source_flops_per_token(row: dict[str, Any], m: ModelConfig) -> float:
    """Training FLOPs per token as the source counted them (published.toml's header)."""
    if row["flops_counted"] == "megatron-2021":
        # Narayanan et al. 2021, eq. 3 over the B s tokens of a step.
        layers, h, s, v = m.n_layers, m.dim, row["seq_len"], m.vocab_size
        return 96.0 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    return model_flops_per_token(m, row["seq_len"])


def peak_tflops(row: dict[str, Any]) -> float:
    peaks = load_cluster(row)["peak_tflops"]
    return peaks.get(row["precision"], peaks["bf16"])


def tokens_per_s_per_gpu(row: dict[str, Any]) -> tuple[float, str]:
    """(tokens per second per GPU, which published figure it comes from): a rate or a step time as they
    stand; TFLOP/s or MFU through the source's own FLOP count."""
    m, gpus = row_config(row).model, row["gpus"]
    if "reported_tokens_per_s" in row:
        return row["reported_tokens_per_s"] / gpus, "tokens/s"
    if "reported_s_per_step" in row:
        return row["global_batch"] * row["seq_len"] / row["reported_s_per_step"] / gpus, "s/step"
    per_token = source_flops_per_token(row, m)
    if "reported_tflops_per_gpu" in row:
        return row["reported_tflops_per_gpu"] * 1e12 / per_token, "TFLOP/s"
    return row["reported_mfu"] * peak_tflops(row) * 1e12 / per_token, "MFU"
