"""`hybridpar report RUN_DIR [--compare OTHER_RUN] [--out FILE]`: one self-contained HTML file about a
run — its figures as PNGs inside the page (base64), no script, nothing fetched from the network — with a
stability section that prints each figure's definition beside it. `--compare` overlays a second run."""

from __future__ import annotations

import base64
import html
import importlib.util
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from hybridpar.config.args import ArgParser
from hybridpar.report.rundata import Run, load_run
from hybridpar.report.stability import DEFINITIONS, STRAGGLER_PATIENCE, STRAGGLER_THRESHOLD, Stability

STYLE = """body{font-family:sans-serif;max-width:60em;margin:1em auto;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left}
td.n{text-align:right}img{max-width:100%}.def{color:#555;font-size:.9em}h2{margin-top:1.5em}"""


def _img(png: bytes | None, alt: str, missing: str) -> str:
    if png is None:
        return f"<p><em>{html.escape(missing)}</em></p>"
    data = base64.b64encode(png).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _fmt(v: Any, unit: str = "", digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}g}{unit}"
    return f"{v}{unit}"


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    h = "".join(f"<th>{html.escape(str(x))}</th>" for x in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def _mean(run: Run, key: str) -> float | None:
    vals = [r[key] for r in run.steps if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def summary(runs: Sequence[Run]) -> str:
    rows = [
        ["state", *(r.state for r in runs)],
        ["mesh (last start)", *(_mesh(r) for r in runs)],
        ["steps recorded", *(len(r.steps) for r in runs)],
        ["final loss", *(_fmt(r.steps[-1]["loss"], digits=5) for r in runs)],
        ["tokens/s, the steps' mean", *(_fmt(_mean(r, "tokens_per_s"), digits=4) for r in runs)],
        ["mean MFU", *(_fmt(None if (m := _mean(r, "mfu")) is None else 100 * m, " %") for r in runs)],
        ["mean measured bubble", *(_fmt(None if (b := _mean(r, "bubble")) is None else 100 * b, " %") for r in runs)],
        ["device peak", *(_peak(r) for r in runs)],
        ["params digest", *(((r.final or {}).get("params_digest") or "— (not finished)")[:16] for r in runs)],
    ]
    return _table(["", *(r.name for r in runs)], rows)


def _mesh(run: Run) -> str:
    """The mesh of the run's last start (resilience.jsonl), e.g. "tp2 cp2 pp1 dp1"; "—" where not recorded."""
    starts = [e["mesh"] for e in run.events if e.get("event") == "start" and "mesh" in e]
    return " ".join(f"{k}{v}" for k, v in starts[-1].items()) if starts else "—"


def _peak(run: Run) -> str:
    peak = next((r["device_peak"] for r in run.steps if "device_peak" in r), None)
    return "—" if peak is None else f"{peak['flops_per_s'] / 1e9:.1f} GFLOP/s ({peak['source']})"


def stability_section(runs: Sequence[Run], stabs: Sequence[Stability]) -> str:
    def eps(st: Stability) -> str:
        if not st.straggler_episodes:
            return "none"
        return "; ".join(
            f"rank {e.rank}, steps {e.first_step}-{e.last_step} (up to {e.peak_ratio:.2f}x)"
            for e in st.straggler_episodes
        )

    rows = [
        ("wall time", [_fmt(s.wall_s, " s") for s in stabs]),
        ("productive time", [_fmt(s.productive_s, " s") for s in stabs]),
        ("goodput", [_fmt(None if s.goodput is None else 100 * s.goodput, " %") for s in stabs]),
        ("interruptions", [s.interruptions for s in stabs]),
        ("MTTR", [_fmt(s.mttr_s, " s") for s in stabs]),
        ("MTBF", [_fmt(s.mtbf_s, " s") if s.interruptions else "no failure" for s in stabs]),
        ("recomputed steps", [s.recomputed_steps for s in stabs]),
        ("lost / duplicated samples", [f"{_fmt(s.lost_samples)} / {_fmt(s.duplicated_samples)}" for s in stabs]),
        ("step-time CV", [_fmt(s.step_time_cv) for s in stabs]),
        ("outliers", [", ".join(map(str, s.outlier_steps)) or "none" for s in stabs]),
        ("straggler episodes", [eps(s) for s in stabs]),
    ]
    defs = {k: v.format(threshold=STRAGGLER_THRESHOLD, patience=STRAGGLER_PATIENCE) for k, v in DEFINITIONS.items()}
    head = "".join(f"<th>{html.escape(r.name)}</th>" for r in runs)
    body = "".join(
        f"<tr><th>{html.escape(name)}</th>"
        + "".join(f'<td class="n">{html.escape(str(v))}</td>' for v in vals)
        + f'<td class="def">{html.escape(defs[name])}</td></tr>'
        for name, vals in rows
    )
    return f"<table><tr><th>figure</th>{head}<th>definition</th></tr>{body}</table>"


def balance_table(run: Run) -> str:
    decisions = [e for r in run.steps for e in r.get("balance", []) if e.get("event") == "rebalance"]
    if not decisions:
        return "<p><em>No balancer decision in this run (balance.mode off, or nothing to gain).</em></p>"
    rows = [
        [
            d["step"],
            "applied" if d.get("applied") else "logged",
            _fmt(1000 * d["predicted_step_before_s"], " ms"),
            _fmt(1000 * d["predicted_step_after_s"], " ms"),
            d.get("reason", ""),
        ]
        for d in decisions
    ]
    return _table(["step", "", "predicted before", "predicted after", "why"], rows)


def batching_table(run: Run) -> str:
    stats = (run.final or {}).get("batching") or next(
        (r["batching"] for r in reversed(run.steps) if "batching" in r), None
    )
    if not stats:
        return ""
    hist = stats.get("history") or []
    rows = [[h.get("split"), h.get("steps"), _fmt(h.get("mean_throughput"), digits=4)] for h in hist]
    policy, split = html.escape(str(stats.get("policy"))), html.escape(str(stats.get("current_split")))
    head = f"<p>policy {policy}, split now {split}</p>"
    cols = ["split measured", "steps", "mean tokens/s of the pipeline (optimizer step excluded)"]
    return head + (_table(cols, rows) if rows else "")


def faults_table(run: Run) -> str:
    if not run.faults and not run.watchdog:
        return "<p><em>No fault fired and the watchdog named no rank.</em></p>"
    t0 = min(run.starts, default=0.0)
    rows = [[f"{f['time'] - t0:.2f} s", "fault", f.get("rank"), f.get("fault")] for f in run.faults]
    rows += [[f"{w['time'] - t0:.2f} s", "watchdog", w.get("culprit"), w.get("reason", "")] for w in run.watchdog]
    return _table(["since the first start", "what", "rank", "detail"], sorted(rows, key=lambda r: float(r[0][:-2])))


def render(runs: Sequence[Run]) -> str:
    from hybridpar.report import plots  # matplotlib: imported only when a page is drawn (the `report` extra)

    stabs = [r.stability() for r in runs]
    main = runs[0]
    title = "hybridpar run " + " vs ".join(r.name for r in runs)
    parts = [
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
        "<p>" + "<br>".join(html.escape(str(r.path)) for r in runs) + "</p>",
        summary(runs),
        "<h2>Stability</h2>",
        stability_section(runs, stabs),
        "<h2>Loss</h2>",
        _img(plots.loss(runs), "loss and validation loss", ""),
        "<h2>Throughput and MFU</h2>",
        _img(plots.throughput(runs), "tokens per second and MFU", ""),
        "<h2>Step time</h2>",
        _img(plots.step_times(runs, stabs), "step-time series and distribution", ""),
        "<h2>One step, rank by rank</h2>",
        _img(plots.rank_timeline(main), "per-rank timeline of one step", "No step timeline recorded."),
        _img(plots.rank_summary(main), "per-rank compute, wait and comm", "No per-rank records."),
        "<h2>Memory</h2>",
        _img(plots.memory(main), "memory per rank", ""),
        "<h2>Load balancer</h2>",
        balance_table(main),
        _img(plots.balance(main), "predicted vs measured step time", "No measured outcome of a move."),
        "<h2>Microbatch policy</h2>",
        batching_table(main),
        _img(plots.microbatches(main), "microbatches per step", ""),
        "<h2>Restarts and faults</h2>",
        _img(plots.events(main), "restarts and faults on a timeline", ""),
        faults_table(main),
        "</body></html>",
    ]
    return "\n".join(parts)


def parser() -> ArgParser:
    """`hybridpar report`'s options."""
    ap = ArgParser(prog="hybridpar report", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="the --run-dir of a hybridpar train run")
    ap.add_argument("--compare", metavar="OTHER_RUN", help="a second run directory, overlaid")
    ap.add_argument("--out", help="the HTML file to write (default: RUN_DIR/report.html)")
    return ap


def main(argv: list[str]) -> int:
    try:
        args = parser().parse(argv)
        runs = [load_run(args.run_dir)] + ([load_run(args.compare)] if args.compare else [])
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("hybridpar report draws its plots with matplotlib: pip install 'hybridpar[report]'")
    except ValueError as e:
        print(f"hybridpar: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.run_dir) / "report.html"
    out.write_text(render(runs), encoding="utf-8")
    print(f"hybridpar: report written to {out}")
    return 0
