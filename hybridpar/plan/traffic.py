"""Count, do not guess: the memory traffic of hybridpar's own eager runtime outside its matmul and attention kernels.

The GPU cost model times GEMMs and attention at their FLOP rates (plan/gpu_model.py); everything else an eager
PyTorch step runs (autocast's casts, norms, rotary, SwiGLU, residual adds, the loss, gradient accumulation, the
optimizer) is memory-bound. Rather than a fixed count per token for "an unfused Llama block" (cost.py's
REPLICATED_ELEMENTS, which describes the fused kernels of the published clusters' software), this module runs the
model's own modules on the CPU under a `TorchDispatchMode` and adds up, per aten op, the bytes it reads and writes:
every tensor argument read, every argument the op's schema marks as written, every fresh output written; views
and allocations move nothing; matmuls (`MATMULS`) and attention kernels are left out. It also counts the ops
themselves, those left out apart: in eager mode each is at least one kernel launch on a GPU and one dispatch on
the host (the cost model's kernel floor and dispatch figures, plan/gpu_model.py).

The count is exact for the settings it runs (autocast bf16 over fp32 weights, bf16 working copies, fp32;
recompute none/selective/full; fused or foreach AdamW) at tiny sizes. Bytes are affine in the tokens of a pass
(per token: the activations; per pass: the weights' casts and the gradients' accumulation) and, at a fixed number
of heads, the per-token part is affine in the widths (dim, head_dim, ffn_dim, vocab_size scaled together: every
activation is one of those wide, a few per-token statistics are not) and the per-pass part in the parameters.
`traffic` therefore counts the model's shape scaled down by two factors at two token counts and solves for its
full size: a closed form the tests check against a direct count. A decoder layer is what a two-layer stage moves
beyond a one-layer stage; the ends (embedding, final norm, head, loss) the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from hybridpar.config import ModelConfig, TrainConfig
from hybridpar.model.optim import make_optimizer, takes_fused
from hybridpar.model.registry import build_stage, empty_stage, param_counts

aten = torch.ops.aten
# What the cost model times at FLOP rates (gpu_model.layer_times): the projections, the head, attention.
MATMULS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_backward.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_efficient_attention_backward.default,
    }
)
# Allocations: they launch no kernel and move no bytes.
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh"})
# Arguments a schema marks as written that the op leaves alone in our use: the fused AdamW kernels write the
# gradients only to unscale them by a grad_scale, which bf16 training does not pass.
UNWRITTEN = {"_fused_adamw_": {"grads"}, "_fused_adam_": {"grads"}}
# Arguments only written, never read: a copy's or a fill's destination.
UNREAD = {"copy_": {"self"}, "fill_": {"self"}, "zero_": {"self"}}
SEQ = (8, 16)  # the token counts of the two passes (one sequence each)


@dataclass(frozen=True)
class Tally:
    """Bytes read + written and ops run by the memory-bound (non-matmul) work of something, and the MATMULS ops
    it runs beside them (timed at their FLOP rates; counted for their dispatch)."""

    nbytes: float = 0.0
    ops: float = 0.0
    matmuls: float = 0.0

    def __add__(self, o: Tally) -> Tally:
        return Tally(self.nbytes + o.nbytes, self.ops + o.ops, self.matmuls + o.matmuls)

    def __sub__(self, o: Tally) -> Tally:
        return Tally(self.nbytes - o.nbytes, self.ops - o.ops, self.matmuls - o.matmuls)

    def times(self, k: float) -> Tally:
        return Tally(self.nbytes * k, self.ops * k, self.matmuls * k)


def footprint(t: torch.Tensor) -> int:
    """Bytes of memory `t` covers: a broadcast (stride-0) dimension is read once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride != 0 else 1
    return n * t.element_size()


def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def op_bytes(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """What one aten op reads and writes: its tensor arguments, those its schema writes (again), and outputs that
    are not views or in-place results of an argument."""
    schema = func._schema
    skip = UNWRITTEN.get(schema.name.split("::")[-1], set())
    values = dict(zip((a.name for a in schema.arguments), args)) | kwargs
    total, unread = 0, UNREAD.get(schema.name.split("::")[-1], set())
    for a in schema.arguments:
        ts = _tensors(values.get(a.name))
        total += 0 if a.name in unread else sum(footprint(t) for t in ts)
        if a.alias_info is not None and a.alias_info.is_write and a.name not in skip:
            total += sum(footprint(t) for t in ts)
    outs = [out] if len(schema.returns) == 1 else list(out or ())
    for r, o in zip(schema.returns, outs):
        if r.alias_info is None:
            total += sum(footprint(t) for t in _tensors(o))
    return total


class Counter(TorchDispatchMode):
    """Adds up `op_bytes` and the op count of every aten op outside MATMULS that moves data, and counts the
    MATMULS ops apart. With `skip`, MATMULS
    are not computed: their outputs are left uninitialised (shapes from the meta device), since what the count
    needs of the values is nothing (no op here branches on them), and the GEMMs would take most of its time."""

    def __init__(self, skip: bool = False) -> None:
        super().__init__()
        self.tally, self.skip = Tally(), skip

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in MATMULS:
            self.tally = self.tally + Tally(matmuls=1)
        if self.skip and func in MATMULS:
            meta = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
            shaped = func(*meta[0], **meta[1])
            return tree_map_only(
                torch.Tensor, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype), shaped
            )
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if func not in MATMULS and name not in ALLOCATIONS and not view:
            self.tally = self.tally + Tally(op_bytes(func, args, kwargs, out), 1)
        return out


@dataclass(frozen=True)
class Settings:
    """What the runtime runs: train.precision, train.bf16_weights, train.recompute, fused AdamW or foreach."""

    precision: str = "bf16"
    weights: str = "autocast"
    recompute: str = "none"
    fused: bool = True

    @staticmethod
    def of(t: TrainConfig, recompute: str, device: str = "cuda") -> Settings:
        fused = takes_fused(t.fused_adamw, device)
        # Selective recomputation reruns the same non-matmul ops as full (it keeps only matmul outputs): the two
        # count the same bytes (counted so on the default model and the 1B one), so one count serves both.
        again = "full" if recompute == "selective" else recompute
        return Settings(t.precision, t.bf16_weights if t.precision == "bf16" else "autocast", again, fused)


@dataclass(frozen=True)
class Pass:
    """A forward and its backward."""

    forward: Tally
    backward: Tally


def count_stage(m: ModelConfig, s: Settings, layers: int, tokens: int) -> Pass:
    """The counted forward and backward (loss included) of a stage of `layers` layers with the embedding and the
    head, on one sequence of `tokens` tokens, as every microbatch after a step's first runs it: its tables made
    (a forward before, without gradients) and its backward summing into existing gradients."""
    stage = empty_stage(m, range(layers), True, True, torch.device("cpu"))  # values: none needed (`Counter`)
    stage.recompute = s.recompute
    bf16 = s.precision == "bf16"
    if bf16 and s.weights == "copies":  # bf16 weights whose gradients widen into fp32 (model/reference.py)
        stage.to(torch.bfloat16)
        for p in stage.parameters():
            p.grad_dtype = torch.float32
    mixed = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 and s.weights == "autocast" else None
    x = torch.randint(0, m.vocab_size, (1, tokens))
    y = torch.randint(0, m.vocab_size, (1, tokens))
    with torch.no_grad(), mixed or contextlib.nullcontext(), Counter(skip=True):
        stage(x)
    for p in stage.parameters():
        p.grad = torch.empty_like(p, dtype=getattr(p, "grad_dtype", None) or p.dtype)
    with Counter(skip=True) as fwd:
        with mixed or contextlib.nullcontext():
            logits = stage(x)  # (1, T, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
    with Counter(skip=True) as bwd:
        loss.backward()
    return Pass(fwd.tally, bwd.tally)


def count_optimizer(m: ModelConfig, s: Settings) -> tuple[float, float]:
    """(Bytes per parameter, ops per parameter tensor) of one optimizer step over a layer: gradient clipping
    (torch's foreach norm and scale), AdamW (fused, or torch's foreach), and under working copies the rounding of
    the fp32 masters into the bf16 weights. Counted on its second step (the moments exist)."""
    layer = build_stage(m, range(1), False, False, 0, torch.device("cpu"))
    params = list(layer.parameters())
    t = dataclasses.replace(TrainConfig(), fused_adamw="on" if s.fused else "off")
    opt = make_optimizer(layer.named_parameters(), t)
    low = [p.detach().to(torch.bfloat16) for p in params] if s.weights == "copies" and s.precision == "bf16" else []
    counter = Counter(skip=True)
    for counting in (False, True):
        for p in params:
            p.grad = torch.ones_like(p)
        with counter if counting else contextlib.nullcontext():
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
            with torch.no_grad():
                for w, p in zip(low, params):
                    w.copy_(p)
    return counter.tally.nbytes / sum(p.numel() for p in params), counter.tally.ops / len(params)


@dataclass(frozen=True)
class Affine:
    """A pass's tally at `tokens` tokens: per_token x tokens + per_pass."""

    per_token: Tally
    per_pass: Tally

    def at(self, tokens: float) -> Tally:
        return self.per_token.times(tokens) + self.per_pass


@dataclass(frozen=True)
class Traffic:
    """hybridpar's eager memory-bound work for one model shape and `Settings`, at full size: a decoder layer's
    forward and backward (the backward's recomputation and gradient accumulation included) and the ends'
    (embedding, final norm, head, loss). The optimizer step: `count_optimizer`."""

    layer_f: Affine
    layer_b: Affine
    ends_f: Affine
    ends_b: Affine


def _heads(m: ModelConfig) -> int:
    """The factor the heads (query and key/value alike) are divided by: the largest power of 2 dividing every width
    that leaves at least 4 of each (the rotary tables, read per head_dim, then weigh as little as 1.3% more in the
    1B model than counted whole; a single head's transposes would be free)."""
    h = 1
    while all(v % (2 * h) == 0 for v in (m.dim, m.ffn_dim, m.vocab_size)) and min(m.n_heads, m.kv_heads) % (8 * h) == 0:
        h *= 2
    return h


def scales(m: ModelConfig) -> tuple[int, ...]:
    """Two factors (s, 2s) to divide dim, ffn_dim and vocab_size by: the heads by `_heads` in both, head_dim by the
    rest, halved between the two (its own per-token work, the rotary tables' reads, then scales as the widths do);
    each width whole, head_dim even (the rotary halves) and at least 8: the smallest shapes that count. () where
    head_dim does not halve (the shape is then counted as it is)."""
    h, s = _heads(m), 1
    while (
        all(v % (2 * s * h) == 0 for v in (m.dim, m.ffn_dim, m.vocab_size))
        and (m.head_dim // 2) % (2 * s) == 0
        and m.head_dim >= 16 * s
    ):
        s *= 2
    return (h * s // 2, h * s) if s >= 2 else ()


def _scaled(m: ModelConfig, s: int) -> ModelConfig:
    """`m` with its widths divided by `s` (a multiple of `_heads`, which divides the heads)."""
    h = _heads(m)
    kv = None if m.n_kv_heads is None else m.n_kv_heads // h
    return dataclasses.replace(
        m, dim=m.dim // s, ffn_dim=m.ffn_dim // s, vocab_size=m.vocab_size // s, n_heads=m.n_heads // h, n_kv_heads=kv
    )


def scaled_for_optimizer(m: ModelConfig) -> ModelConfig:
    """The smallest shape of `scales`: the optimizer's bytes per parameter and ops per tensor do not depend on it."""
    return _scaled(m, scales(m)[-1]) if scales(m) else m


def _affine(m: ModelConfig, s: Settings) -> tuple[Affine, ...]:
    """(layer forward, layer backward, ends forward, ends backward) of `m` as counted at the token counts SEQ."""
    at = {(n, t): count_stage(m, s, n, t) for n in (1, 2) for t in SEQ}
    parts = []
    for t in SEQ:
        one, two = at[1, t], at[2, t]
        layer = Pass(two.forward - one.forward, two.backward - one.backward)
        parts.append((layer.forward, layer.backward, one.forward - layer.forward, one.backward - layer.backward))
    out = []
    for lo, hi in zip(*parts):
        per_token = (hi - lo).times(1 / (SEQ[1] - SEQ[0]))
        out.append(Affine(per_token, lo - per_token.times(SEQ[0])))
    return tuple(out)


def _extend(a: Tally, b: Tally, xa: float, xb: float, x: float) -> Tally:
    """The affine function through (xa, a) and (xb, b) at x."""
    return a + (a - b).times((x - xa) / (xa - xb))


def traffic(m: ModelConfig, s: Settings) -> Traffic:
    """`Traffic` of `m` under `s`: counted at two scaled-down shapes (`scales`) and solved for the full one (per
    token affine in 1 / scale, per pass affine in the parameters the pass touches), or counted directly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # nothing is computed (`Counter`): more threads would only spin
    try:
        return _traffic(m, s)
    finally:
        torch.set_num_threads(threads)


def _traffic(m: ModelConfig, s: Settings) -> Traffic:
    if not scales(m):
        return Traffic(*_affine(m, s))
    (sa, sb), full = scales(m), param_counts(m)
    ca, cb = param_counts(_scaled(m, sa)), param_counts(_scaled(m, sb))
    ends = (ca.embed + ca.head, cb.embed + cb.head, full.embed + full.head)
    params = [(ca.layer, cb.layer, full.layer)] * 2 + [ends] * 2
    out = []
    for a, b, (pa, pb, p) in zip(_affine(_scaled(m, sa), s), _affine(_scaled(m, sb), s), params):
        tok = _extend(a.per_token, b.per_token, 1 / sa, 1 / sb, 1.0)
        out.append(Affine(tok, _extend(a.per_pass, b.per_pass, pa, pb, p)))
    return Traffic(*out)
