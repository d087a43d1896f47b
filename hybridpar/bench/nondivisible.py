"""Throughput of a global batch that the microbatch count does not divide, against its divisible
neighbours, measured in one run (JSON).

    .venv/bin/hybridpar bench nondivisible [--rounds 2] [--repeats 5] [--pp 2] [--schedule 1f1b] [--json FILE]

Compute mode of `hybridpar bench pipeline` (the real Llama blocks), global batch 10 in 4 microbatches
(3,3,2,2: torch's schedules refuse it, ours runs it exactly) beside batch 8 and 12 in 4 and batch 10
in 5. The cases alternate over `--rounds` rounds, so machine noise hits them alike; each case's
tokens/s is the median over every round's repeats, and `ratio_vs_*` divides the non-divisible case's
tokens/s by each neighbour's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from hybridpar.bench import emit
from hybridpar.bench.pipeline import make_cases
from hybridpar.bench.pipeline import parse_args as pipeline_args
from hybridpar.bench.pipeline_case import run_case

TARGET = (10, 4)
NEIGHBOURS = ((8, 4), (12, 4), (10, 5))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench nondivisible", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per case and round")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        print(f"error: --rounds must be at least 1, got {a.rounds}", file=sys.stderr)
        return 2
    cases = {}
    for gb, m in (TARGET, *NEIGHBOURS):  # validated before any process starts
        (cases[(gb, m)],) = make_cases(
            pipeline_args(
                [
                    "--mode",
                    "compute",
                    "--pp",
                    str(a.pp),
                    "--schedules",
                    a.schedule,
                    "--global-batch",
                    str(gb),
                    "--microbatches",
                    str(m),
                    "--repeats",
                    str(a.repeats),
                ]
            )
        )
    runs: dict[tuple[int, int], list[dict]] = {k: [] for k in cases}
    for r in range(a.rounds):
        for (gb, m), c in cases.items():
            print(f"round {r + 1}/{a.rounds}: global batch {gb} in {m} microbatches ...", file=sys.stderr, flush=True)
            runs[(gb, m)].append(run_case(c))
    tok_s = {}
    for (gb, m), recs in runs.items():
        tokens = gb * cases[(gb, m)].seq_len
        tok_s[(gb, m)] = statistics.median(tokens * sps for rec in recs for sps in rec["hybridpar_steps_per_s_repeats"])
    summary = {
        "case": f"global batch {TARGET[0]} in {TARGET[1]} microbatches, pp={a.pp}, {a.schedule}, compute mode",
        "tokens_per_s": {f"gb{gb}_m{m}": v for (gb, m), v in tok_s.items()},
        **{f"ratio_vs_gb{gb}_m{m}": tok_s[TARGET] / tok_s[(gb, m)] for gb, m in NEIGHBOURS},
        "torch_error_nondivisible": runs[TARGET][0]["torch_error"],
        "losses_match_where_torch_runs": all(
            rec["loss_match"] for k, recs in runs.items() if k != TARGET for rec in recs
        ),
        "command": "hybridpar bench nondivisible " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(json.dumps(summary, indent=1))
    emit({"summary": summary, "runs": [rec for recs in runs.values() for rec in recs]}, a.json, echo=False)
    return 0
