"""`hybridpar bench serve --scenario transformers`: our server's engine against `transformers`' `generate`
in one process — what a user tries first — on the same weights (ours exported to a Hugging Face
directory, fp32, CPU threads as the machine gives them).

- batch 1: the requests one after another, each alone (`generate` on one prompt; ours: one request in
  flight at a time through one replica);
- saturation: every request at once (`generate` on one batch of them; ours: a burst into the replica,
  batched continuously).
Prompts are of one length so that `generate` needs no padding and its greedy tokens must equal ours
(compared, reported). Generated tokens per second, ours over theirs, per repeat in alternating order.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys
import tempfile
import time
from typing import Any

from hybridpar.bench.serve_throughput import MODEL, serve_config


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


def _theirs(model: Any, prompts: list[list[int]], new: int, batch: bool) -> tuple[float, list[list[int]]]:
    import torch

    t0, outs = time.perf_counter(), []
    with torch.no_grad():
        groups = [prompts] if batch else [[p] for p in prompts]
        for g in groups:
            x = torch.tensor(g)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, pad_token_id=0)  # fmt: skip
            outs += [row[x.shape[1] :].tolist() for row in y]
    return len(prompts) * new / (time.perf_counter() - t0), outs


def _ours(svc: Any, prompts: list[list[int]], new: int, batch: bool, timeout_s: float) -> tuple[float, list]:
    def collect(p: Any) -> list[int]:
        out = []
        while (ev := p.events.get(timeout=timeout_s))[0] == "token":
            out.append(ev[1])
        return out

    t0 = time.perf_counter()
    if batch:
        outs = [collect(p) for p in [svc.submit(q, new, 0.0, 1.0, None) for q in prompts]]
    else:
        outs = [collect(svc.submit(q, new, 0.0, 1.0, None)) for q in prompts]
    return len(prompts) * new / (time.perf_counter() - t0), outs


def against_transformers(a: Any) -> dict[str, Any]:
    import transformers

    from hybridpar.model.registry import build_full_model, export_hf
    from hybridpar.serve.service import Service

    cfg = dataclasses.replace(serve_config(1, 1), max_groups=max(2, (a.requests + 7) // 8))
    d = tempfile.mkdtemp(prefix="hybridpar-bench-hf-")
    export_hf(build_full_model(MODEL, 0).state_dict(), MODEL, d)  # init:0, the weights the replica loads
    hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    prompts, new = _prompts(a.requests, 32, a.seed), 32
    svc = Service(cfg, MODEL, cfg.source)
    per: dict[str, list[float]] = {k: [] for k in ("ours_b1", "hf_b1", "ours_sat", "hf_sat")}
    equal = True
    try:
        _ours(svc, prompts[:4], 4, True, a.timeout_s)  # warm-up
        ref = _theirs(hf, prompts, new, True)[1]  # and the reference greedy tokens
        for rep in range(a.repeats):
            for who in ("ours", "hf") if rep % 2 == 0 else ("hf", "ours"):
                for mode, batch in (("b1", False), ("sat", True)):
                    if who == "ours":
                        run = _ours(svc, prompts, new, batch, a.timeout_s)
                    else:
                        run = _theirs(hf, prompts, new, batch)
                    per[f"{who}_{mode}"].append(run[0])
                    equal &= run[1] == ref
            print(f"repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in per.items()), file=sys.stderr)
    finally:
        svc.close()
    med = {k: statistics.median(v) for k, v in per.items()}
    return {
        "requests": a.requests,
        "new_tokens": new,
        "prompt_tokens": 32,
        **{f"{k}_tokens_per_s": v for k, v in med.items()},
        "ours_over_transformers_batch1": statistics.median(o / h for o, h in zip(per["ours_b1"], per["hf_b1"])),
        "ours_over_transformers_saturation": statistics.median(o / h for o, h in zip(per["ours_sat"], per["hf_sat"])),
        "greedy_outputs_equal": equal,
        "per_repeat": per,
        "transformers": transformers.__version__,
    }
