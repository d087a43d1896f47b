"""The report's figures, drawn with matplotlib's object API (Figure + Agg canvas, no pyplot state) and
returned as PNG bytes; None where the run recorded nothing to draw. Several runs overlay (--compare)."""

from __future__ import annotations

import io
import statistics
from typing import Any, Callable, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from hybridpar.report.rundata import Run
from hybridpar.report.stability import Stability

DPI = 80
COLOURS = ("tab:blue", "tab:orange")  # the run, the run compared with
CATEGORY_COLOURS = {"compute": "tab:green", "comm": "tab:purple", "wait": "tab:red"}


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return buf.getvalue()


def _series(run: Run, key: Callable[[dict[str, Any]], Any]) -> tuple[list[int], list[float]]:
    pts = [(r["step"], key(r)) for r in run.steps]
    pts = [(s, v) for s, v in pts if v is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def loss(runs: Sequence[Run]) -> bytes:
    fig = Figure(figsize=(8, 3))
    ax = fig.add_subplot()
    for run, c in zip(runs, COLOURS):
        ax.plot(*_series(run, lambda r: r["loss"]), color=c, label=f"{run.name} loss")
        x, y = _series(run, lambda r: r.get("val_loss"))
        if x:
            ax.plot(x, y, "o--", color=c, label=f"{run.name} validation loss")
    ax.set(xlabel="step", ylabel="loss")
    ax.legend(fontsize=8)
    return _png(fig)


def throughput(runs: Sequence[Run]) -> bytes:
    fig = Figure(figsize=(8, 3.5))
    tok, mfu = fig.subplots(1, 2)
    for run, c in zip(runs, COLOURS):
        tok.plot(*_series(run, lambda r: r["tokens_per_s"]), color=c, label=run.name)
        x, y = _series(run, lambda r: r.get("mfu"))
        mfu.plot(x, [100 * v for v in y], color=c, label=run.name)
    tok.set(xlabel="step", ylabel="tokens/s")
    mfu.set(xlabel="step", ylabel="MFU (%)")
    tok.legend(fontsize=8)
    fig.tight_layout()
    return _png(fig)


def step_times(runs: Sequence[Run], stabs: Sequence[Stability]) -> bytes:
    fig = Figure(figsize=(8, 3.5))
    series, hist = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    for run, st, c in zip(runs, stabs, COLOURS):
        x, y = _series(run, lambda r: r["step_time_s"])
        series.plot(x, y, ".-", color=c, label=f"{run.name} (CV {st.step_time_cv or 0:.3f})")
        out = [(s, v) for s, v in zip(x, y) if s in set(st.outlier_steps)]
        if out:
            series.plot([s for s, _ in out], [v for _, v in out], "x", color="red", ms=10, label="outlier")
        for r in run.steps:
            if any(e.get("event") == "rebalance" and e.get("applied") for e in r.get("balance", [])):
                series.axvline(r["step"], color=c, ls=":", lw=1)
        hist.hist(y, bins=min(30, max(5, len(y) // 3)), color=c, alpha=0.6)
    series.set(xlabel="step (dotted: a rebalance)", ylabel="step time (s)")
    series.legend(fontsize=8)
    hist.set(xlabel="step time (s)", ylabel="steps")
    fig.tight_layout()
    return _png(fig)


def rank_timeline(run: Run) -> bytes | None:
    tl = run.timeline
    if not tl or not tl.get("slices"):
        return None
    slices = tl["slices"]
    t0 = min(s["start_s"] for s in slices)
    ranks = sorted({s["track"] for s in slices})
    fig = Figure(figsize=(8, 0.5 + 0.45 * len(ranks)))
    ax = fig.add_subplot()
    for cat, colour in CATEGORY_COLOURS.items():
        for r in ranks:
            bars = [
                (1000 * (s["start_s"] - t0), 1000 * (s["end_s"] - s["start_s"]))
                for s in slices
                if s["track"] == r and s["cat"] == cat
            ]
            # Waits sit inside the F/B action that waited: drawn thinner, on top.
            height, y = (0.4, r - 0.2) if cat == "wait" else (0.8, r - 0.4)
            ax.broken_barh(bars, (y, height), color=colour, label=cat if r == ranks[0] else None)
    ax.set(xlabel="ms into the step (white: the bubble)", ylabel="rank", yticks=ranks)
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="upper right")
    return _png(fig)


def rank_summary(run: Run) -> bytes | None:
    recs = [r for r in run.steps if r.get("ranks")]
    if not recs:
        return None
    fig = Figure(figsize=(8, 3.5))
    bars, bub = fig.subplots(1, 2)
    n = len(recs[0]["ranks"]["compute_s"])
    ranks = [r for r in recs if len(r["ranks"]["compute_s"]) == n]  # a re-planned world changes n
    bottom = [0.0] * n
    for key, colour in (("compute_s", "tab:green"), ("wait_s", "tab:red"), ("comm_s", "tab:purple")):
        means = [1000 * statistics.fmean(r["ranks"][key][i] for r in ranks) for i in range(n)]
        bars.bar(range(n), means, bottom=bottom, color=colour, label=key.removesuffix("_s"))
        bottom = [b + m for b, m in zip(bottom, means)]
    span = [1000 * statistics.fmean(r["ranks"]["pipeline_s"][i] for r in ranks) for i in range(n)]
    bars.plot(range(n), span, "k_", ms=20, label="pipeline span")
    bars.set(xlabel="rank", ylabel="ms per step (mean)", xticks=range(n))
    bars.legend(fontsize=8)
    bub.plot(*_series(run, lambda r: None if r.get("bubble") is None else 100 * r["bubble"]), ".-")
    bub.set(xlabel="step", ylabel="measured bubble (%)")
    fig.tight_layout()
    return _png(fig)


def memory(run: Run) -> bytes | None:
    mon = [r for r in run.steps if r.get("monitor")]
    fig = Figure(figsize=(8, 3.5))
    used, act = fig.subplots(1, 2)
    if mon:
        n = max(len(r["monitor"]["memory_used_bytes"]) for r in mon)
        for rank in range(n):
            pts = [
                (r["step"], r["monitor"]["memory_used_bytes"][rank] / 2**20)
                for r in mon
                if rank < len(r["monitor"]["memory_used_bytes"]) and r["monitor"]["memory_used_bytes"][rank]
            ]
            used.plot([s for s, _ in pts], [v for _, v in pts], ".-", label=f"rank {rank}")
        used.legend(fontsize=7)
    else:
        used.text(0.5, 0.5, "no monitor records\n(train.monitor_every = 0)", ha="center", va="center")
    used.set(xlabel="step", ylabel="memory in use (MiB)")
    act.plot(*_series(run, lambda r: r.get("activation_peak_bytes", 0) / 2**20), ".-")
    act.set(xlabel="step", ylabel="activation peak, max over ranks (MiB)")
    fig.tight_layout()
    return _png(fig)


def balance(run: Run) -> bytes | None:
    measured = [e for r in run.steps for e in r.get("balance", []) if e.get("event") == "rebalance_measured"]
    if not measured:
        return None
    fig = Figure(figsize=(8, 3))
    ax = fig.add_subplot()
    keys = ("predicted_step_before_s", "predicted_step_after_s", "measured_step_before_s", "measured_step_after_s")
    colours = ("#9ecae1", "#3182bd", "#fdae6b", "#e6550d")
    width = 0.2
    for k, (key, colour) in enumerate(zip(keys, colours)):
        ax.bar(
            [i + (k - 1.5) * width for i in range(len(measured))],
            [1000 * e[key] for e in measured],
            width,
            color=colour,
            label=key.removesuffix("_s").replace("_", " "),
        )
    ax.set(xticks=range(len(measured)), xticklabels=[f"step {e['step']}" for e in measured], ylabel="step time (ms)")
    ax.legend(fontsize=8)
    return _png(fig)


def microbatches(run: Run) -> bytes:
    fig = Figure(figsize=(8, 3))
    ax = fig.add_subplot()
    ax.step(*_series(run, lambda r: len(r["microbatches"])), where="post", label="microbatches (rank 0's replica)")
    ax.step(*_series(run, lambda r: max(r["microbatches"])), where="post", label="largest microbatch (samples)")
    ax.set(xlabel="step")
    ax.legend(fontsize=8)
    return _png(fig)


def events(run: Run) -> bytes:
    everything = [*run.steps, *run.superseded]
    t0 = min([*run.starts, *(r["time"] - r["step_time_s"] for r in everything if "time" in r)])
    fig = Figure(figsize=(8, 3))
    ax = fig.add_subplot()
    for recs, colour, label in ((run.steps, "tab:green", "step (kept)"), (run.superseded, "grey", "step (redone)")):
        pts = [(r["time"] - t0, r["step"]) for r in recs if "time" in r]
        ax.plot([t for t, _ in pts], [s for _, s in pts], ".", color=colour, label=label)
    for i, t in enumerate(run.starts):
        ax.axvline(t - t0, color="tab:blue", ls="--", label="attempt start" if i == 0 else None)
    for i, f in enumerate(run.faults):
        ax.axvline(f["time"] - t0, color="red", label="fault" if i == 0 else None)
    for i, w in enumerate(run.watchdog):
        ax.axvline(w["time"] - t0, color="tab:orange", ls=":", label="watchdog" if i == 0 else None)
    ax.set(xlabel="seconds since the first attempt started", ylabel="step")
    ax.legend(fontsize=8)
    return _png(fig)
