"""Derives the parameter criterion's factors (hybridpar/model/reference.py: TAIL, factor) and estimates its
false-alarm rate, on runs that are exact by construction: single-process training of the test models
(the tiny Llama, GPT-2, the odd shapes; fp32 and bf16), each step's batch shuffled by another seed and
accumulated over 1 to 6 microbatches — the same program, another order of the same sums. Each such run
is held to the yardstick of the K = 12 ORDERS runs, per tensor and statistic: the log of its distance to
the fp64 run over the references' largest. By exchangeability that ratio exceeds 1 with probability
1 / (K + 1); the exceedances' mean log is the decay length of an exponential tail, from which the factor
for a false-alarm rate follows. Prints JSON; `--kernels` runs it again under each kernel choice
(hybridpar/model/reference.py: KERNELS) in a fresh interpreter, since torch reads them at import.

    .venv/bin/hybridpar bench exactness [--kernels all] [--seeds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import torch

from hybridpar.bench import emit
from hybridpar.model import reference as ref


def models() -> dict:
    return {
        "tiny": ref.tiny_config(),
        "odd": ref.odd_config(tp=1, pp=1, dp=1),
        "gpt2": ref.gpt2_config(tp=1, pp=1, dp=1),
        "tiny-bf16": ref.tiny_config(train=dict(precision="bf16")),
    }


def log_ratios(seeds: int) -> dict:
    """Per model and statistic, every candidate tensor's log(distance / references' largest)."""
    out: dict = {}
    for name, cfg in models().items():
        stick = ref.yardstick(cfg)
        logs: dict[str, list[float]] = {s: [] for s in ref.STATS}
        for seed in range(2, 2 + seeds):
            for k in range(1, 7):
                state = ref.reference(cfg, torch.float32, k, order=seed)[2]
                for n, d in ref.distances(state, stick.ref64).items():
                    for i, s in enumerate(ref.STATS):
                        if stick.noise[n][i] > 0 and d[i] > 0:
                            logs[s].append(math.log(d[i] / stick.noise[n][i]))
        out[name] = logs
    return out


def chi2_lower(nu: float, z: float = -1.645) -> float:
    """chi-square's 5% quantile with nu degrees of freedom (Wilson-Hilferty)."""
    return nu * (1 - 2 / (9 * nu) + z * math.sqrt(2 / (9 * nu))) ** 3


def summarise(logs: dict, k: int) -> dict:
    """The tail fit per statistic, pooled over models (peaks over a threshold): the rate beyond
    ref.TAIL_FROM x the references' largest, the exceedances' decay length (mean log excess) and its 95%
    upper bound (exponential exceedances: 2 n mean / chi2_2n), the factor that bound gives for
    ref.FALSE_ALARM, and counts above a few ratios against the fit's prediction."""
    res = {}
    u = math.log(ref.TAIL_FROM)
    for s in ref.STATS:
        xs = [x for m in logs.values() for x in m[s]]
        over = [x - u for x in xs if x > u]
        n = len(over)
        decay = sum(over) / n
        upper = 2 * n * decay / chi2_lower(2 * n)
        rate = n / len(xs)

        def predicted(r: float) -> float:
            return len(xs) * rate * math.exp(-(math.log(r) - u) / decay)

        res[s] = {
            "comparisons": len(xs),
            "beyond_largest_reference": sum(x > 0 for x in xs) / len(xs),
            "expected_beyond_largest_reference": 1 / (k + 1),
            "tail_rate": rate,
            "decay": decay,
            "decay_upper_95": upper,
            "factor_from_upper": ref.TAIL_FROM * math.exp(upper * math.log(rate / ref.FALSE_ALARM)),
            "largest_ratio": math.exp(max(xs)),
            "per_model_largest_ratio": {m: math.exp(max(v[s])) for m, v in logs.items()},
            "counts_above": {
                str(r): {"observed": sum(x > math.log(r) for x in xs), "predicted": round(predicted(r), 2)}
                for r in (1.5, 2.0, 3.0, 5.0, ref.factor(s))
            },
        }
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench exactness", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default=None, help="'all' or a comma list of hybridpar.model.reference.KERNELS")
    ap.add_argument("--seeds", type=int, default=5, help="shuffle seeds per model (x 6 accumulations)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--raw", action="store_true", help="(internal) print this interpreter's log-ratios")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.raw:
        print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "logs": log_ratios(a.seeds)}))
        return 0
    names = list(ref.KERNELS) if a.kernels == "all" else (a.kernels or "native").split(",")
    per, pooled = {}, {}
    for kname in names:
        env = {**os.environ, **ref.KERNELS[kname]}
        cmd = [sys.executable, "-m", "hybridpar.cli", "bench", "exactness", "--seeds", str(a.seeds), "--raw"]
        got = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
        per[kname] = {"cpu_capability": got["cpu_capability"], "stats": summarise(got["logs"], len(ref.ORDERS))}
        for m, v in got["logs"].items():
            pooled[f"{kname}/{m}"] = v
    out = {
        "kernels": per,
        "pooled": summarise(pooled, len(ref.ORDERS)),
        "in_use": {s: {"tail": ref.TAIL[s], "factor": ref.factor(s)} for s in ref.STATS},
        "false_alarm": ref.FALSE_ALARM,
        "load_average": os.getloadavg(),
    }
    emit(out, a.json)
    return 0
