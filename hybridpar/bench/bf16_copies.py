"""bf16 compute three ways on this machine: autocast over the fp32 weights with one autocast region per
microbatch (autocast's weight casts made again for each; what `train.precision bf16` ran before), the
same inside the runtime's step_casts (one cached bf16 copy of each weight for the whole step: what it
runs now), and bf16 working copies (a bf16 copy of every weight made once per step, before the step's
forwards; forward and backward in bf16 on the copies; each microbatch's weight gradients widened and
summed into the fp32 masters' gradients; AdamW on the masters). Step time of each, alternating. This is the
one-process prototype; the runtime trains working copies with `--train.bf16_weights copies`, which
`hybridpar bench step_time --precisions bf16,copies` times against autocast.

    .venv/bin/hybridpar bench bf16_copies [--repeats 5] [--microbatches 2] [--json FILE] [--model.dim N ...]

One process (one thread on a CPU; the GPU where there is one), the default model (full, on one device)
and its global batch cut into `--microbatches`; `--section.key VALUE` flags of `hybridpar train` change
the model and the batch. One round runs one step of each contender, their order rotating round by round;
the first round warms them up and is not counted. Reported: each contender's median step time, the
medians of the per-round ratios copies / autocast and autocast_step / autocast with their spreads, the
loss of each at the last step (autocast_step's equals autocast's bit for bit; working copies differ:
they compute the residual stream and the norms in bf16 too, autocast only the matmuls), and the load
average before and after.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F

from hybridpar.bench import emit
from hybridpar.config.parse import parse_args
from hybridpar.data.corpus import TokenData
from hybridpar.model.optim import make_optimizer
from hybridpar.model.registry import build_full_model
from hybridpar.pipeline.runtime import step_casts


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
    logits = model(x)  # (B, T, vocab)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum") / n


def autocast_step(model: torch.nn.Module, opt: torch.optim.Optimizer, mbs: list, n: int, span: bool = False) -> float:
    """One autocast region per microbatch, as the runtime's actions; `span`: inside the runtime's step_casts,
    so every microbatch uses one cached bf16 copy of each weight (what `train.precision bf16` runs now)."""
    total = 0.0
    with step_casts(mbs[0][0].device.type, torch.bfloat16, [model], span):
        for x, y in mbs:
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                loss = _loss(model, x, y, n)
            loss.backward()
            total += loss.item()
    opt.step()
    opt.zero_grad()
    return total


def copies_step(model: torch.nn.Module, work: torch.nn.Module, opt: torch.optim.Optimizer, mbs: list, n: int) -> float:
    masters, copies = list(model.parameters()), list(work.parameters())
    with torch.no_grad():
        for w, p in zip(copies, masters):
            w.copy_(p)  # the step's one cast of each weight
    total = 0.0
    for x, y in mbs:
        loss = _loss(work, x, y, n)
        loss.backward()
        total += loss.item()
        with torch.no_grad():  # fp32 accumulation across microbatches, as the masters' gradients
            for w, p in zip(copies, masters):
                p.grad = w.grad.float() if p.grad is None else p.grad.add_(w.grad)
                w.grad = None
    opt.step()
    opt.zero_grad()
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench bf16_copies", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="measured rounds (one step of each contender)")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the result to FILE")
    a, rest = ap.parse_known_args(argv)
    if a.repeats < 1 or a.microbatches < 1:
        ap.error(f"--repeats and --microbatches must be >= 1, got {a.repeats} and {a.microbatches}")
    torch.set_num_threads(1)
    cfg = parse_args(rest)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t = cfg.train
    data = TokenData.open(cfg.data.path, 2_000_000, t.seq_len, t.seed, cfg.data.val_fraction)
    names = ("autocast", "autocast_step", "copies")
    models = {k: build_full_model(cfg.model, t.seed).to(dev) for k in names}
    work = copy.deepcopy(models["copies"]).to(torch.bfloat16)
    opts = {k: make_optimizer(m.named_parameters(), t) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    losses: dict[str, float] = {}
    load_before = os.getloadavg()
    for r in range(a.repeats + 1):
        x, y = (v.to(dev) for v in data.step_samples(r, t.global_batch, 0, t.global_batch))
        mbs = list(zip(x.tensor_split(a.microbatches), y.tensor_split(a.microbatches)))
        n = y.numel()
        for k in names[r % 3 :] + names[: r % 3]:  # each contender in each place of the order in turn
            sync()
            t0 = time.perf_counter()
            if k == "copies":
                losses[k] = copies_step(models[k], work, opts[k], mbs, n)
            else:
                losses[k] = autocast_step(models[k], opts[k], mbs, n, span=k == "autocast_step")
            sync()
            if r > 0:
                times[k].append(time.perf_counter() - t0)
    ratios = [c / s for c, s in zip(times["copies"], times["autocast"])]
    spans = [c / s for c, s in zip(times["autocast_step"], times["autocast"])]
    out = {
        "bench": "bf16_copies",
        "device": str(dev),
        "overrides": rest,
        "model": f"{cfg.model.dim}d-{cfg.model.n_layers}L-ffn{cfg.model.ffn_dim}",
        "seq_len": t.seq_len,
        "global_batch": t.global_batch,
        "microbatches": a.microbatches,
        "repeats": a.repeats,
        "median_step_time_s": {k: statistics.median(v) for k, v in times.items()},
        "step_times_s": times,
        "copies_over_autocast": statistics.median(ratios),
        "copies_over_autocast_spread": [min(ratios), max(ratios)],
        "autocast_step_over_autocast": statistics.median(spans),
        "autocast_step_over_autocast_spread": [min(spans), max(spans)],
        "last_loss": losses,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    emit(out, a.json)
    return 0
