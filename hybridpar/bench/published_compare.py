"""The planner beside published GPU training runs (docs/planner/published.toml): for each row, on the row's
own cluster file, (a) the prediction for the layout the authors used and (b) the planner's own choice, in the
unit the source published (TFLOP/s per GPU counted the source's way, MFU, or seconds per step) and as tokens/s
per GPU. One cost model for every row; no constant is tuned per row.

    .venv/bin/hybridpar bench published_compare [--rows ID,ID] [--no-search] [--json FILE] [--markdown | --accuracy]

A row's published layout is scored as the source ran it: its tp x pp x dp, interleaved 1F1B where it names
virtual stages (else 1F1B), its microbatch size (else 1), its recomputation, its optimizer sharding (`zero`,
where the source's run sharded it), its sequence parallelism (`sequence_parallel`, where the source ran it),
its precision (fp16 as bf16). A row whose source ran chunks hybridpar's config cannot hold (`chunks_as_run`: Llama 3's
embedding and head as chunks of their own, one layer in each other chunk) is costed with them (`EndChunks`); its
memory counted with them too (`rank_memory`'s explicit stages); the planner's search stays on the row's
expressible `virtual_stages`. `fits` says whether our memory model (plan/memory_model.py) puts the layout as run
within the cluster file's device memory, messages through the process group as on GPUs;
where the planner finds no layout at all, `no_choice` says why (its one-line error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from hybridpar.bench import emit
from hybridpar.config import Config
from hybridpar.pipeline.partition import partition_uniform
from hybridpar.pipeline.schedules import stage_count, stages_per_rank
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.plan.cost import CostModel, Placement
from hybridpar.plan.hardware import Hardware, load_hardware
from hybridpar.plan.memory_model import rank_memory
from hybridpar.plan.published import (
    PLANNER_DOCS,
    load_runs,
    peak_tflops,
    row_config,
    source_flops_per_token,
    tokens_per_s_per_gpu,
)
from hybridpar.plan.search import GIB, Memory, plan
from hybridpar.plan.step import Prediction, predict

UNITS = {"TFLOP/s": "TFLOP/s per GPU", "MFU": "MFU", "s/step": "s per step", "tokens/s": "tokens/s"}


def in_published_unit(row: dict[str, Any], tokens_per_s_per_gpu_: float, basis: str) -> float:
    """A rate of tokens/s per GPU in the unit the row's figure was published in (`basis`)."""
    m = row_config(row).model
    if basis == "TFLOP/s":
        return tokens_per_s_per_gpu_ * source_flops_per_token(row, m) / 1e12
    if basis == "MFU":
        return tokens_per_s_per_gpu_ * source_flops_per_token(row, m) / (peak_tflops(row) * 1e12)
    if basis == "s/step":
        return row["global_batch"] * row["seq_len"] / (tokens_per_s_per_gpu_ * row["gpus"])
    return tokens_per_s_per_gpu_ * row["gpus"]


def published_figure(row: dict[str, Any], basis: str) -> float:
    key = {"TFLOP/s": "reported_tflops_per_gpu", "MFU": "reported_mfu", "s/step": "reported_s_per_step"}
    return row[key.get(basis, "reported_tokens_per_s")]


class EndChunks(CostModel):
    """The cost model over a partition whose first chunk holds only the embedding and whose last holds only the
    head and loss, the model's layers spread evenly over the chunks between: Llama 3's pipeline (arXiv:2407.21783,
    Sec. 3.3.2: "we reduce one Transformer layer each from the first and the last stages ... the first model
    chunk on the first stage has only the embedding, and the last model chunk on the last stage has only output
    projection and loss calculation"). hybridpar's config gives every stage a layer at least
    (config_rules._check_layout), so such a layout is costed here, for the published comparison only."""

    def parts(self, cfg: Config, pl: Placement) -> list[range]:
        return end_chunks(cfg)


def end_chunks(cfg: Config) -> list[range]:
    """EndChunks' partition: the embedding and the head alone in the first and last chunk."""
    n, layers = stage_count(cfg.parallel), cfg.model.n_layers
    if not 2 < n <= layers + 2:
        raise ValueError(f"{n} chunks cannot hold the embedding and the head apart around {layers} layers")
    return [range(0, 0), *partition_uniform(layers, n - 2), range(layers, layers)]


def given_layout(row: dict[str, Any], hw: Hardware) -> tuple[Config, Prediction]:
    """The published layout and its prediction: the row's config, or where the source ran chunks the config
    cannot hold (`chunks_as_run`), that config with those chunks per rank on `EndChunks`."""
    cfg = row_config(row)
    if "chunks_as_run" not in row:
        return cfg, predict(CostModel(cfg.model, hw), cfg)
    cfg.parallel.virtual_stages = row["chunks_as_run"]
    return cfg, predict(EndChunks(cfg.model, hw), cfg)


def compare(row: dict[str, Any], top: int = 1, memory: Memory = rank_memory, search: bool = True) -> dict[str, Any]:
    """One row: the published figure, the prediction for its layout, the planner's choice (`memory`: the
    memory model, plan/memory_model.py's unless a test passes a quicker one; called with the stages' layers
    as a second argument for a layout as run that the config cannot hold; `search=False` skips the planner's
    search, the slow part at cluster scale, and leaves the choice fields None)."""
    hw = load_hardware(PLANNER_DOCS / row["cluster"])
    cfg = row_config(row)
    validate_config(cfg, row["gpus"])
    tokens = row["global_batch"] * row["seq_len"]
    rate, basis = tokens_per_s_per_gpu(row)
    run, given = given_layout(row, hw)
    # Memory of the layout as run: with the chunks the source ran, where the config cannot hold them.
    need = max(int(e.total) for e in (memory(run, end_chunks(run)) if "chunks_as_run" in row else memory(cfg)))
    given_rate = tokens / given.step_s / row["gpus"]
    p = run.parallel
    layout = f"tp{p.tp} pp{p.pp} dp{p.dp}" + (f" v{stages_per_rank(p)}" if stages_per_rank(p) > 1 else "")
    layout += " (embedding, head apart)" if "chunks_as_run" in row else ""
    layout += f" m{cfg.train.microbatches} recompute={cfg.train.recompute}" + (f" zero{p.zero}" if p.zero else "")
    layout += " sp" if p.sequence_parallel else ""
    layout += f" cp{p.cp}" if p.cp > 1 else ""
    layout += " bf16-copies" if cfg.train.bf16_weights == "copies" else ""
    out = {
        "id": row["id"],
        "cluster": hw.name,
        "gpus": row["gpus"],
        "unit": UNITS[basis],
        "published_layout": layout,
        "published": published_figure(row, basis),
        "published_tokens_per_s_per_gpu": rate,
        "predicted_for_published_layout": in_published_unit(row, given_rate, basis),
        "predicted_tokens_per_s_per_gpu": given_rate,
        "published_layout_gib_per_gpu": round(need / GIB, 2),
        "published_layout_fits": need <= hw.device_memory_bytes,
        "published_layout_breakdown_s": given.breakdown(),
        "choice": None,
        "choice_predicted": None,
        "choice_tokens_per_s_per_gpu": None,
        "choice_breakdown_s": None,
        "plan_s": None,
        "considered": None,
        "simulated": None,
    }
    if not search:
        return out
    t0 = time.perf_counter()
    try:
        result = plan(row_config(row), hw, memory, world=row["gpus"], top=top)  # the planner sets every knob
    except ValueError as e:  # e.g. no layout fits: a row to state, not a crash of the whole comparison
        return out | {"no_choice": str(e), "plan_s": time.perf_counter() - t0}
    best = result.candidates[0]
    best_rate = best.tokens_per_s / row["gpus"]
    return out | {
        "choice": best.label.strip(),
        "choice_predicted": in_published_unit(row, best_rate, basis),
        "choice_tokens_per_s_per_gpu": best_rate,
        "choice_breakdown_s": best.prediction.breakdown(),
        "plan_s": time.perf_counter() - t0,
        "considered": result.considered,
        "simulated": result.simulated,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | GPUs | unit | published layout | published | predicted, that layout | planner's choice | "
        "predicted, choice |",
        "|---|---:|---|---|---:|---:|---|---:|",
    ]
    for r in rows:
        fmt = (lambda x: f"{x:.1%}") if r["unit"] == "MFU" else (lambda x: f"{x:,.4g}")
        note = "" if r["published_layout_fits"] else f" (needs {r['published_layout_gib_per_gpu']:g} GiB)"
        lines.append(
            f"| {r['id']} | {r['gpus']:,} | {r['unit']} | {r['published_layout']} | {fmt(r['published'])} | "
            f"{fmt(r['predicted_for_published_layout'])}{note} | "
            + (
                f"{r['choice']} | {fmt(r['choice_predicted'])} |"
                if r["choice"]
                else f"({r.get('no_choice', 'search not run')}) | |"
            )
        )
    return "\n".join(lines)


def ratio(r: dict[str, Any], key: str = "predicted_tokens_per_s_per_gpu") -> float:
    """Predicted over published throughput (tokens/s per GPU): above 1, the model is optimistic."""
    return r[key] / r["published_tokens_per_s_per_gpu"]


def accuracy(rows: list[dict[str, Any]]) -> str:
    """The accuracy table: per row, published and predicted in the published unit and their throughput ratio
    (the choice's too, where searched), then the summary line. Every figure is leave-one-out by construction:
    no parameter of the cost model is derived from any row (the cluster files' calibration comes from outside
    sources), and a row's own published figure enters only its `published` columns."""
    lines = [
        "| run | unit | published | predicted | ratio | choice predicted | choice / published |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fmt = (lambda x: f"{x:.1%}") if r["unit"] == "MFU" else (lambda x: f"{x:,.4g}")
        chosen = r.get("choice_predicted") is not None
        lines.append(
            f"| {r['id']} | {r['unit']} | {fmt(r['published'])} | {fmt(r['predicted_for_published_layout'])} | "
            f"{ratio(r):.2f} | "
            + (f"{fmt(r['choice_predicted'])} | {ratio(r, 'choice_tokens_per_s_per_gpu'):.2f} |" if chosen else "| |")
        )
    q = sorted(ratio(r) for r in rows)
    off = sorted(abs(x - 1) for x in q)
    mid = lambda xs: (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2  # noqa: E731
    within = sum(x <= 0.2 for x in off)
    lines.append(
        f"\n{len(q)} rows: ratio median {mid(q):.2f}, range {q[0]:.2f}-{q[-1]:.2f}; median |ratio - 1| {mid(off):.3f}; "
        f"{within} of {len(q)} within +-0.20."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench published_compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", help="comma-separated row ids (default: every row)")
    ap.add_argument("--json", help="write the comparison here")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--accuracy", action="store_true", help="print the accuracy table (ratios and summary)")
    ap.add_argument("--no-search", action="store_true", help="only the published layouts' predictions (fast)")
    a = ap.parse_args(argv)
    runs = load_runs()
    wanted = a.rows.split(",") if a.rows else [r["id"] for r in runs]
    unknown = sorted(set(wanted) - {r["id"] for r in runs})
    if unknown:
        print(f"published_compare: unknown row ids {unknown}; the rows are {[r['id'] for r in runs]}", file=sys.stderr)
        return 2
    t0, cpu0 = time.perf_counter(), time.process_time()
    rows: list[dict[str, Any]] = []
    for row in runs:
        if row["id"] not in wanted:
            continue
        cpu = time.process_time()
        rows.append(
            compare(row, search=not a.no_search) | {"cpu_s": time.process_time() - cpu, "load_average": os.getloadavg()}
        )
        print(f"{row['id']}: done in {rows[-1]['cpu_s']:.1f} s CPU", file=sys.stderr)
        out = {"rows": rows, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0}
        emit(out, a.json, echo=False)  # after every row: a long run keeps what it has
    print(accuracy(rows) if a.accuracy else markdown(rows) if a.markdown else json.dumps(out, indent=1))
    return 0
