"""The single-device reference every parallel layout is held to, for the equivalence tests and the GPU
check (`scripts/gpu_check.sh`): the tiny test model, plain one-process training of it (torch's AdamW
step by step, no pipeline, no sharding) and DESIGN.md's parameter criterion against an fp64 run."""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridpar.config import Config
from hybridpar.data.mixture import open_data
from hybridpar.model.documents import DocumentMask
from hybridpar.model.optim import lr_at, make_optimizer, set_lr
from hybridpar.model.registry import build_full_model

TOL = 1e-5  # loss of every step and validation, fp32 (DESIGN.md)
U_BF16 = 2.0**-9  # bfloat16's unit roundoff (8 significant bits)

# DESIGN.md's parameter criterion. Each parameter tensor is held to single-process runs of the same
# training that differ only in the order of their sums: the step's batch accumulated over 1 to 6
# balanced microbatches, in the data's order and shuffled by one seed (K = 12 equally valid runs).
# Their largest distance to an fp64 run, per tensor and per statistic, is that tensor's noise level.
ORDERS = tuple((k, seed) for seed in (None, 1) for k in range(1, 7))
# Two statistics per tensor: its largest element-wise difference (a defect confined to a few elements)
# and its root-mean-square difference (a small defect spread over the whole tensor, e.g. weight decay
# missing). The largest element alone is the wrong yardstick where it is the noise: Adam turns rounding
# noise in a near-zero gradient into a step, so one element scatters by up to 5x between equally valid runs.
STATS = ("largest", "rms")
# How far past the noise level a run may land, derived by `hybridpar/bench/exactness.py` (docs/exactness.md): a
# run exact by construction is another draw of the same noise, so it lands beyond the largest of the K
# references with probability 1 / (K + 1) = 0.077 per tensor and statistic (measured: 0.075-0.084; 0.11
# and 0.15 with scalar kernels, whose other orders scatter a little wider than accumulation does). Beyond
# TAIL_FROM x that largest, its log-ratio falls off exponentially (peaks over a threshold); TAIL holds,
# per statistic, the measured rate beyond TAIL_FROM and the 95% upper bound of the decay length (both
# rounded up) over the test models (tiny Llama, GPT-2, odd shapes; fp32 and bf16; 9,750 comparisons per
# kernel choice), from the kernel choice (KERNELS) with the heaviest tail: avx2 (native: 0.011 and 0.159
# for the largest element, 0.0051 and 0.155 for rms; scalar 0.014 and 0.132, 0.010 and 0.112). The
# factor puts a false alarm at FALSE_ALARM per comparison. A run of the whole suite makes about 13,000
# (some 90 layouts held to the criterion, about 75 tensors each, 2 statistics, the kernel lanes
# included): 1e-9 keeps a false alarm in a suite run below 1e-4 (1.3e-5), with room to grow sevenfold.
FALSE_ALARM = 1e-9
TAIL_FROM = 1.25
TAIL = {"largest": (0.0133, 0.208), "rms": (0.0090, 0.203)}  # -> factors 37.9 and 32.3


# Distances of a few units in the last place of a tensor's largest value are representation, not arithmetic
# (RMSNorm weights near 1 land on the same rounding in every run: their noise level can be 0).
FLOOR_ULPS = 4
# Kernel choices a machine can be limited to, each a set of environment variables torch's libraries read
# at start-up (measured on an AVX-512 machine with native bf16 and AMX: each changes the rounding):
# ATen's vector code (ATEN_CPU_CAPABILITY: fp32 and bf16), MKL's GEMMs (MKL_ENABLE_INSTRUCTIONS: fp32 and
# bf16), oneDNN's bf16 matmuls (ONEDNN_MAX_CPU_ISA: AMX tiles, native AVX-512 bf16 dots, or emulated).
# On a machine without an instruction set, a choice that names it runs what the machine has.
KERNELS: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512-no-amx": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "scalar": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
}


def factor(stat: str) -> float:
    """The multiple of the ORDERS runs' largest distance that an exact run exceeds with probability
    FALSE_ALARM: TAIL_FROM x exp(decay x log(rate / FALSE_ALARM))."""
    rate, decay = TAIL[stat]
    return TAIL_FROM * math.exp(decay * math.log(rate / FALSE_ALARM))


Result = tuple[list[float], list[tuple[int, float]], dict[str, torch.Tensor]]


def tiny_config(**over: dict[str, Any]) -> Config:
    """The tiny model and run of the equivalence tests; `over` sets fields per section, e.g.
    tiny_config(parallel=dict(tp=2))."""
    cfg = Config()
    m, t = cfg.model, cfg.train
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim = 32, 8, 4, 2, 64  # GQA on
    t.steps, t.global_batch, t.microbatches, t.seq_len = 3, 11, 4, 16  # 11 samples: unequal splits
    # lr stays the default (3e-3): Adam turns fp32 reduction-order noise in near-zero gradients into
    # parameter differences proportional to lr.
    t.warmup_steps, t.val_every, t.val_batches, t.sample_tokens = 1, 3, 1, 0
    t.grad_clip = 0.5  # low enough that clipping is active
    cfg.data.max_tokens = 200_000
    # The MFU peak probe: 0.2 s of matmuls on every rank at the start of every run, which no test reads the
    # figure of; a few products measure it all the same (the suite trains a few hundred runs).
    cfg.sinks.peak_probe_s = 0.01
    for section, values in over.items():
        for k, v in values.items():
            setattr(getattr(cfg, section), k, v)
    return cfg


def gpt2_config(**parallel: Any) -> Config:
    """The tiny model of the grid as GPT-2: biases, LayerNorm, learned positions, tied embeddings."""
    return tiny_config(model=dict(family="gpt2", n_kv_heads=None, n_positions=24), parallel=parallel)


def odd_config(**parallel: Any) -> Config:
    """Shapes nothing divides evenly: 6 heads over 3 kv heads and a vocabulary of 258 (tp=3 splits
    each), 8 layers over 3 stages, 33-token sequences, 10 samples over 3 replicas (4, 3, 3), in 3
    microbatches (a layout whose schedule needs another count sets train.microbatches itself: the schedule
    registry sits above model/)."""
    cfg = tiny_config(
        model=dict(dim=48, n_heads=6, n_kv_heads=3, ffn_dim=96, vocab_size=258),
        train=dict(seq_len=33, global_batch=10, microbatches=3),
        parallel=parallel,
    )
    return cfg


def working_copy(model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    """The module the forward runs: `model` itself, or under train.bf16_weights=copies a bf16 copy of it (its
    gradients fp32: torch widens and sums each backward's bf16 gradient into them), refreshed by
    `step_masters` after each step — what the trainer's MasterAdamW keeps (dataparallel/copies.py)."""
    if cfg.train.precision != "bf16" or cfg.train.bf16_weights != "copies":
        return model
    work = copy.deepcopy(model).to(torch.bfloat16)
    for w, p in zip(work.parameters(), model.parameters()):
        w.grad_dtype = p.dtype
    return work


def step_masters(model: torch.nn.Module, work: torch.nn.Module, opt: torch.optim.Optimizer, clip: float) -> None:
    """Clip and step `model`'s parameters by the gradients `work` accumulated, then round them into `work`."""
    with torch.no_grad():
        for w, p in zip(work.parameters(), model.parameters()):
            if w is not p:
                p.grad, w.grad = w.grad, None
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        for w, p in zip(work.parameters(), model.parameters()):
            if w is not p:
                w.copy_(p)


def reference(
    cfg: Config,
    dtype: torch.dtype = torch.float32,
    accumulate: int = 1,
    device: str | torch.device = "cpu",
    order: int | None = None,
) -> Result:
    """Plain single-process training: (step losses, (step, val_loss) pairs, final parameters on the CPU).
    `dtype` is the parameters' (fp64: the same initial values, widened); with train.precision bf16 the
    forward runs under bfloat16 autocast over fp32 parameters, as the trainer does (with train.bf16_weights
    copies on a bf16 working copy instead: `working_copy`, `step_masters`). With `accumulate` > 1
    each step's gradient is summed over that many balanced microbatches (another order of the same sums:
    an equally valid run). With `order` each step's samples are shuffled by that seed first: the same
    mean, summed in another order (again an equally valid run)."""
    t, dev = cfg.train, torch.device(device)
    data = open_data(cfg.data.path, cfg.data.max_tokens, t.seq_len, t.seed, cfg.data.val_fraction)
    model = build_full_model(cfg.model, t.seed).to(dtype).to(dev)
    opt = make_optimizer(model.named_parameters(), t)
    work = working_copy(model, cfg)

    def mixed() -> contextlib.AbstractContextManager:
        bf16 = t.precision == "bf16" and work is model
        return torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def loss_of(
        x: torch.Tensor, y: torch.Tensor, reduction: str = "mean", d: torch.Tensor | None = None
    ) -> torch.Tensor:
        with mixed():  # d: each position's document (data.document_mask)
            logits = work(x.to(dev)) if d is None else work(x.to(dev), DocumentMask(d.to(dev)))  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1).to(dtype), y.to(dev).flatten(), reduction=reduction)

    losses, val_losses = [], []
    docs, n_val = cfg.data.document_mask, t.val_batches * t.global_batch
    vx, vy = data.val_samples(n_val)
    vd = data.val_documents(n_val) if docs else None
    for step in range(t.steps):
        set_lr(opt, lr_at(step, t))
        x, y = data.step_samples(step, t.global_batch, 0, t.global_batch)
        d = data.step_documents(step, t.global_batch, 0, t.global_batch) if docs else None
        if order is not None:
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(order * 100_003 + step))
            x, y, d = x[perm], y[perm], (d if d is None else d[perm])
        if accumulate == 1:
            loss = loss_of(x, y, d=d)
            loss.backward()
        else:
            loss = torch.zeros((), dtype=dtype, device=dev)
            ds = [None] * accumulate if d is None else d.tensor_split(accumulate)
            for xs, ys, dm in zip(x.tensor_split(accumulate), y.tensor_split(accumulate), ds):
                part = loss_of(xs, ys, "sum", dm) / y.numel()
                part.backward()
                loss += part.detach()
        step_masters(model, work, opt, t.grad_clip)
        losses.append(loss.item())
        if t.val_every and (step == 0 or (step + 1) % t.val_every == 0 or step == t.steps - 1):
            with torch.no_grad():
                val_losses.append((step, loss_of(vx, vy, d=vd).item()))
    return losses, val_losses, {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def distances(state: dict[str, torch.Tensor], ref64: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Each parameter's distance to the fp64 run: (largest element-wise difference, root-mean-square)."""
    out = {}
    for n, r in ref64.items():
        d = state[n].double() - r
        out[n] = (d.abs().max().item(), d.pow(2).mean().sqrt().item())
    return out


@dataclass(frozen=True)
class Yardstick:
    """The fp64 run and, per parameter and statistic, the largest distance to it among the ORDERS runs:
    what a run of the same training is held to (`margins`, `failures`)."""

    ref64: dict[str, torch.Tensor]
    noise: dict[str, tuple[float, float]]

    @classmethod
    def of(cls, ref64: dict[str, torch.Tensor], singles: list[dict[str, torch.Tensor]]) -> Yardstick:
        runs = [distances(s, ref64) for s in singles]
        assert len(runs) >= 5, "the noise level needs at least 5 runs that differ only in order"
        return cls(ref64, {n: tuple(max(r[n][i] for r in runs) for i in range(len(STATS))) for n in ref64})

    def bounds(self, name: str) -> tuple[float, float]:
        floor = FLOOR_ULPS * 2.0**-23 * self.ref64[name].abs().max().item()
        return tuple(factor(s) * self.noise[name][i] + floor for i, s in enumerate(STATS))

    def margins(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        """Per parameter, its worst statistic's distance over its bound (the criterion holds where every
        margin is <= 1)."""
        return {n: max(x / b for x, b in zip(d, self.bounds(n))) for n, d in distances(state, self.ref64).items()}

    def failures(self, state: dict[str, torch.Tensor]) -> list[str]:
        """A line per parameter and statistic over its bound, naming the numbers."""
        out = []
        for n, d in distances(state, self.ref64).items():
            for i, (x, b) in enumerate(zip(d, self.bounds(n))):
                if x > b:
                    out.append(
                        f"{n}: {STATS[i]} difference {x:.3g} from the fp64 run > bound {b:.3g} "
                        f"({factor(STATS[i]):.2f} x the {len(ORDERS)} single-process runs' {self.noise[n][i]:.3g})"
                    )
        return out


def yardstick(cfg: Config, device: str | torch.device = "cpu", runs: Any = None) -> Yardstick:
    """The yardstick of `cfg`'s training (fp32 or bf16 as cfg.train.precision says): its fp64 run and the
    ORDERS runs. `runs(cfg, dtype, accumulate, order)` computes a run (default: `reference`, a cache may
    stand in)."""
    runs = runs or (lambda c, dt, k, o: reference(c, dt, k, device, o))
    fp64 = Config.from_dict(cfg.to_dict())
    fp64.train.precision, fp64.train.bf16_weights = "fp32", "autocast"  # one fp64 run for both bf16 modes
    return Yardstick.of(runs(fp64, torch.float64, 1, None)[2], [runs(cfg, torch.float32, k, o)[2] for k, o in ORDERS])
