"""Published GPU training runs (docs/planner/published.toml) as data for the planner's cluster-scale check.

Pure: no processes. Each row's keys and cluster file are checked, its layout goes through our own config
validation, and where a source gives two throughput figures for one run they are checked against each other
under the source's own FLOP count. The derived columns of docs/planner/published.md (tokens/s per GPU, and the
MFU of that throughput by our FLOP count and the cluster file's peak) are computed here and must match the
page: `python tests/test_published_runs.py` prints them.
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridpar.config.families import FAMILIES
from hybridpar.config.sections import RECOMPUTE_MODES
from hybridpar.model.registry import param_counts
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.plan.published import (
    PLANNER_DOCS,
    load_cluster,
    load_runs,
    peak_tflops,
    row_config,
    source_flops_per_token,
    tokens_per_s_per_gpu,
)
from hybridpar.report.mfu import model_flops_per_token

# The row schema: key -> type (float keys accept ints, as TOML writes 8 for 8.0).
REQUIRED: dict[str, type] = {
    "id": str,
    "model": str,
    "family": str,
    "n_layers": int,
    "dim": int,
    "n_heads": int,
    "ffn_dim": int,
    "vocab_size": int,
    "seq_len": int,
    "global_batch": int,
    "cluster": str,
    "gpus": int,
    "precision": str,
    "tp": int,
    "pp": int,
    "dp": int,
    "flops_counted": str,
    "source": str,
    "notes": str,
}
REPORTED: dict[str, type] = {
    "reported_tflops_per_gpu": float,
    "reported_mfu": float,
    "reported_tokens_per_s": float,  # the whole run's, not per GPU
    "reported_s_per_step": float,
}
OPTIONAL: dict[str, type] = {
    "n_kv_heads": int,
    "virtual_stages": int,
    "chunks_as_run": int,  # chunks per rank the source ran with its embedding and head apart (bench EndChunks)
    "microbatch_size": int,
    "recompute": str,
    "bf16_weights": str,
    "zero": int,  # 1 where the source's run sharded the optimizer state over data parallelism (ZeRO-1 or more)
    "sequence_parallel": bool,  # true where the source's run split the norm regions' sequence over tp
    "cp": int,  # context-parallel ranks: the sequence split over them (docs/context-parallel.md)
    **REPORTED,
}
PRECISIONS = ("fp32", "bf16", "fp16")  # fp16 runs are planned as bf16: same tensor-core peak
FLOPS_COUNTED = ("megatron-2021", "model", "unstated")  # published.toml's header explains each

# The hardware schema shared with the planner's loader (hybridpar/plan/hardware.py).
CLUSTER_NUMBERS = ("nodes", "devices_per_node", "device_memory_gib")
CLUSTER_TABLES = {"peak_tflops": ("fp32", "bf16"), "intra_node": ("bandwidth_gbs", "latency_us")}
CLUSTER_TABLES["inter_node"] = CLUSTER_TABLES["intra_node"]

RUNS = load_runs()


def by_id(test: Any) -> Any:
    return pytest.mark.parametrize("row", RUNS, ids=[r["id"] for r in RUNS])(test)


def our_mfu(row: dict[str, Any]) -> float:
    """MFU of the published throughput by our FLOP count (report/mfu.py) and the cluster file's peak."""
    rate, _ = tokens_per_s_per_gpu(row)
    return rate * model_flops_per_token(row_config(row).model, row["seq_len"]) / (peak_tflops(row) * 1e12)


def params(row: dict[str, Any]) -> int:
    c = param_counts(row_config(row).model)
    return c.embed + row["n_layers"] * c.layer + c.head


def table() -> list[str]:
    """The derived table of docs/planner/published.md, one markdown line per row."""
    lines = [
        "| run | parameters | tokens/s per GPU | from | our MFU |",
        "|---|---:|---:|---|---:|",
    ]
    for row in RUNS:
        rate, basis = tokens_per_s_per_gpu(row)
        assumed = " (count assumed)" if row["flops_counted"] == "unstated" and basis in ("TFLOP/s", "MFU") else ""
        lines.append(
            f"| {row['id']} | {params(row) / 1e9:.1f}B | {rate:,.0f} | {basis}{assumed} | {our_mfu(row):.1%} |"
        )
    return lines


def plan_command(row: dict[str, Any]) -> str:
    """The planner's command line for the row: its cluster, world, batch and model, nothing of its layout."""
    m = row_config(row).model
    model = {k: getattr(m, k) for k in ("family", "n_layers", "dim", "n_heads", "ffn_dim", "vocab_size")}
    if "n_kv_heads" in row:
        model["n_kv_heads"] = row["n_kv_heads"]
    if row["family"] == "gpt2":
        model["n_positions"] = m.n_positions
    flags = " ".join(f"--model.{k} {v}" for k, v in model.items())
    return (
        f"hybridpar plan --hardware docs/planner/{row['cluster']} --world {row['gpus']} "
        f"--global-batch {row['global_batch']} --train.seq_len {row['seq_len']} "
        f"--train.precision {row_config(row).train.precision} {flags}"
    )


# -- the tests ---------------------------------------------------------------------------------------------------


@by_id
def test_row_has_the_schema(row: dict[str, Any]) -> None:
    schema = {**REQUIRED, **OPTIONAL}
    assert not set(REQUIRED) - set(row), f"missing keys: {sorted(set(REQUIRED) - set(row))}"
    assert not set(row) - set(schema), f"unknown keys: {sorted(set(row) - set(schema))}"
    for key, value in row.items():
        want = schema[key]
        ok = isinstance(value, want) if want is not float else isinstance(value, (int, float))
        assert ok and isinstance(value, bool) == (want is bool), f"{key}={value!r} is not a {want.__name__}"
        if want in (int, float):
            assert value > 0, f"{key}={value!r} must be positive"
    assert row["family"] in FAMILIES
    assert row["precision"] in PRECISIONS
    assert row["flops_counted"] in FLOPS_COUNTED
    assert row.get("recompute", "none") in RECOMPUTE_MODES
    assert set(REPORTED) & set(row), "no throughput figure"
    assert 0 < row.get("reported_mfu", 0.5) < 1
    assert row["family"] == "llama" or "n_kv_heads" not in row, "n_kv_heads is a llama option"


def test_ids_are_unique() -> None:
    ids = [r["id"] for r in RUNS]
    assert len(ids) == len(set(ids))


@by_id
def test_cluster_file_has_the_hardware_schema(row: dict[str, Any]) -> None:
    cluster = load_cluster(row)
    assert isinstance(cluster["name"], str) and isinstance(cluster["source"], str)
    for key in CLUSTER_NUMBERS:
        assert cluster[key] > 0, f"{row['cluster']}: {key}={cluster[key]!r}"
    for table_name, keys in CLUSTER_TABLES.items():
        for key in keys:
            value = cluster[table_name][key]
            assert isinstance(value, (int, float)) and value > 0, f"{row['cluster']}: {table_name}.{key}={value!r}"
    assert row["gpus"] <= cluster["nodes"] * cluster["devices_per_node"]
    assert row["precision"] in cluster["peak_tflops"] or row["precision"] == "fp16"


def test_cluster_files_load_in_the_planner() -> None:
    """The planner's own loader reads every cluster file (skipped until hybridpar/plan/ exists)."""
    hardware = pytest.importorskip("hybridpar.plan.hardware")
    for path in sorted((PLANNER_DOCS / "clusters").glob("*.toml")):
        assert hardware.load_hardware(path).devices > 0


def test_every_cluster_file_is_used() -> None:
    used = {r["cluster"] for r in RUNS}
    files = {f"clusters/{p.name}" for p in (PLANNER_DOCS / "clusters").glob("*.toml")}
    assert used == files


@by_id
def test_layout_covers_the_gpus_and_the_batch(row: dict[str, Any]) -> None:
    assert row["tp"] * row["pp"] * row["dp"] * row.get("cp", 1) == row["gpus"]
    mbs = row.get("microbatch_size", 1)
    assert row["global_batch"] % (row["dp"] * mbs) == 0, "replicas would get unequal microbatch counts"


@by_id
def test_row_passes_our_config_validation(row: dict[str, Any]) -> None:
    validate_config(row_config(row), world_size=row["gpus"])


@by_id
def test_published_figures_agree(row: dict[str, Any]) -> None:
    """Two figures of one run must tell the same story under the source's own FLOP count: TFLOP/s against
    the step time (and, for a source that counts as we do, within 3% of our count), MFU against TFLOP/s over
    the peak, MFU against the step time."""
    m = row_config(row).model
    timed = "reported_s_per_step" in row or "reported_tokens_per_s" in row
    rate, _ = tokens_per_s_per_gpu(row)
    if timed and "reported_tflops_per_gpu" in row and row["flops_counted"] != "unstated":
        implied = rate * source_flops_per_token(row, m) / 1e12
        assert implied == pytest.approx(row["reported_tflops_per_gpu"], rel=0.03)
    if "reported_mfu" in row and "reported_tflops_per_gpu" in row:
        assert row["reported_tflops_per_gpu"] / peak_tflops(row) == pytest.approx(row["reported_mfu"], rel=0.05)
    if timed and "reported_mfu" in row and row["flops_counted"] == "model":
        assert our_mfu(row) == pytest.approx(row["reported_mfu"], rel=0.03)


def test_recompute_counting_explains_the_gap_to_our_count() -> None:
    """Where a source counts the recomputed forward (eq. 3), its TFLOP/s exceed ours by about 4/3 for
    the same tokens/s: the gap is the count, and our MFU column uses our count throughout."""
    rows = [r for r in RUNS if r["flops_counted"] == "megatron-2021"]
    assert rows
    for row in rows:
        m = row_config(row).model
        ratio = source_flops_per_token(row, m) / model_flops_per_token(m, row["seq_len"])
        assert 1.25 < ratio < 4 / 3 + 1e-9, (row["id"], ratio)


def test_rows_span_the_sizes_and_gpus_the_check_needs() -> None:
    sizes = {round(params(r) / 1e9) for r in RUNS}
    assert min(sizes) <= 2 and max(sizes) >= 100 and len(sizes) >= 5, sorted(sizes)
    names = " ".join(load_cluster(r)["name"] for r in RUNS)
    assert "A100" in names and "H100" in names


def test_page_carries_the_derived_table() -> None:
    page = (PLANNER_DOCS / "published.md").read_text(encoding="utf-8")
    missing = [line for line in table() if line not in page]
    assert not missing, "docs/planner/published.md is stale; regenerate with python tests/test_published_runs.py:\n" + (
        "\n".join(missing)
    )


if __name__ == "__main__":
    import sys

    print("\n".join(plan_command(r) for r in RUNS) if sys.argv[1:] == ["--commands"] else "\n".join(table()))
