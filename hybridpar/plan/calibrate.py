"""Calibration: the model's own modules timed on this machine, for hosts where FLOPs predict badly.

On a CPU, a small model's step is mostly the eager framework's per-operation work, not its matmuls'
FLOPs: the default model's decoder layer at 4 x 128 tokens runs at a few GFLOP/s where a 512 x 512
matmul reaches 40-90. So the probe times the real code, with one intra-op thread per process (as a
rank runs) and every rank timing at once (as a run's ranks compute: where they share cores, each
operation costs more CPU time than alone), at the shapes the planner asks for:

* a decoder layer: forward, the whole backward, and the zero-bubble split of it (B: input gradients,
  then W: weight gradients, through pipeline/split_backward.py), for each (tp, tokens per microbatch),
  per layer of a stack of the model's layers (at most `STACK`), forward and backward alternating on
  fresh input under the activation meter, as a step runs them;
  a tp > 1 shape runs the layer's local shard (the rank's heads and FFN columns, rowwise inputs cut
  likewise) without its collectives;
* the embedding (forward, backward) and the final norm, head and loss (forward, backward), unsharded;
* the optimizer: gradient clipping, AdamW's step and zeroing the gradients over one layer's parameters;
* `action_overhead_us`: one pipeline action's work around its compute. Here the cost of handing a tensor
  to autograd and back (detach, requires_grad, grad on a one-element graph) stands for it; the probe
  replaces it with the real runtime's, measured on a pipeline over its ranks (plan/in_place.py), ~20x more;
* `tp_all_reduce` (measured by the probe, every rank taking part, plan/in_place.py): what one
  tensor-parallel all-reduce of a microbatch's activations adds to a step, from the model's own sharded
  layers run with their collectives in groups of tp ranks, all groups at once. On a CPU host that is
  several times what latency and bandwidth of an idle link say (gloo's threads wake for each call and
  burn CPU the other ranks then lack; with more ranks than cores they wait for one). Beside it, the
  head's collectives (its logits' gather, its input gradient's all-reduce) from the model's own sharded
  head and loss run likewise.

`Calibration` is the optional `[calibration]` table of a hardware file (plan/hardware.py); the cost model
(plan/cost.py) uses it for a model of the same shape (`model`: the signature of the ModelConfig and
sequence length it was measured on) and fp32, and FLOPs otherwise. Each figure is the median of calls
timed back to back (the probe averages it over its ranks), in microseconds of the thread's CPU time: the
work itself, which the machine's other jobs do not change. What they do change, the share of a core a
computing rank gets, is `core_share` (the probe's CPU time over wall time of a rank computing alone; the
cost model divides by it), and how much of that several ranks get at once is the hardware's
`cores_per_node`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from hybridpar.config import ModelConfig


def signature(m: ModelConfig, seq_len: int) -> str:
    """What a layer's time depends on: the model's shape and the sequence length (not its depth)."""
    return (
        f"{m.family} dim={m.dim} heads={m.n_heads} kv_heads={m.kv_heads} ffn_dim={m.ffn_dim} "
        f"vocab={m.vocab_size} seq_len={seq_len}"
    )


@dataclass(frozen=True)
class LayerTime:
    """One decoder layer for a microbatch of `tokens` tokens on one of `tp` ranks, seconds."""

    tp: int
    tokens: int
    f: float
    b: float  # the whole backward (input and weight gradients)
    b_input: float  # zero-bubble B
    w: float  # zero-bubble W


@dataclass(frozen=True)
class EndTime:
    """The embedding's and the head's (with the final norm and the loss) times for `tokens` tokens."""

    tokens: int
    embed_f: float
    embed_b: float
    head_f: float
    head_b: float


@dataclass(frozen=True)
class CollectiveTime:
    """One tensor-parallel all-reduce of `tokens` tokens' activations in a group of `tp` ranks, and the
    head's collectives for a microbatch of them (its logits' gather, its input gradient's all-reduce; 0:
    not measured), seconds in place."""

    tp: int
    tokens: int
    all_reduce: float
    head: float = 0.0


@dataclass(frozen=True)
class Calibration:
    model: str  # signature() of what was measured
    layers: tuple[LayerTime, ...]
    ends: tuple[EndTime, ...]
    optimizer_layer_s: float  # clip + AdamW step + zero_grad over one decoder layer's parameters
    action_overhead_s: float  # per pipeline action, beside its compute
    core_share: float = 1.0  # of a core, what one rank computing alone got (foreign load): wall = CPU / share
    collectives: tuple[CollectiveTime, ...] = ()  # measured in place, wall seconds (none: link formulas)

    def fits(self, m: ModelConfig, seq_len: int | None = None) -> bool:
        """Measured on a model of m's shape (and at `seq_len`, unless None: the optimizer's times)."""
        if seq_len is not None:
            return self.model == signature(m, seq_len)
        return self.model.rsplit(" seq_len=", 1)[0] == signature(m, 0).rsplit(" seq_len=", 1)[0]

    def layer(self, tp: int, tokens: int) -> LayerTime | None:
        """The layer's times at `tokens` (`_interpolated`); None where no size was measured at this tp."""
        got = _interpolated((r for r in self.layers if r.tp == tp), tokens, ("f", "b", "b_input", "w"))
        return None if got is None else LayerTime(tp, tokens, *(x / self.core_share for x in got))

    def tp_all_reduce(self, tp: int, tokens: int) -> float | None:
        """Seconds of one tensor-parallel all-reduce of `tokens` tokens' activations at `tp` (`_interpolated`);
        None where none was measured at this tp. Wall time as measured: it already holds what sharing the
        cores costs."""
        got = _interpolated((r for r in self.collectives if r.tp == tp), tokens, ("all_reduce",))
        return None if got is None else max(0.0, got[0])

    def tp_head(self, tp: int, tokens: int) -> float | None:
        """Seconds of the head's collectives for a microbatch of `tokens` tokens at `tp` (`_interpolated`);
        None where they were not measured at this tp."""
        got = _interpolated((r for r in self.collectives if r.tp == tp and r.head > 0), tokens, ("head",))
        return None if got is None else max(0.0, got[0])

    def end(self, tokens: int) -> EndTime | None:
        got = _interpolated(self.ends, tokens, ("embed_f", "embed_b", "head_f", "head_b"))
        return None if got is None else EndTime(tokens, *(x / self.core_share for x in got))

    def to_toml(self) -> str:
        us = lambda x: round(x * 1e6, 2)  # noqa: E731
        layer = ", ".join(
            f"[{r.tp}, {r.tokens}, {us(r.f)}, {us(r.b)}, {us(r.b_input)}, {us(r.w)}]" for r in self.layers
        )
        ends = ", ".join(
            f"[{r.tokens}, {us(r.embed_f)}, {us(r.embed_b)}, {us(r.head_f)}, {us(r.head_b)}]" for r in self.ends
        )
        coll = ", ".join(f"[{r.tp}, {r.tokens}, {us(r.all_reduce)}, {us(r.head)}]" for r in self.collectives)
        return (
            f'\n[calibration]\nmodel = "{self.model}"\noptimizer_layer_us = {us(self.optimizer_layer_s)}\n'
            f"action_overhead_us = {us(self.action_overhead_s)}\ncore_share = {self.core_share!r}\n"
            f"# [tp, tokens, forward, backward, zero-bubble B, zero-bubble W] (us)\nlayer = [{layer}]\n"
            f"# [tokens, embedding forward, backward, head + loss forward, backward] (us)\nends = [{ends}]"
            + (
                "\n# [tp, tokens, one tensor-parallel all-reduce in place, the head's collectives in place] (us)"
                f"\ntp_all_reduce = [{coll}]"
                if coll
                else ""
            )
        )


def _interpolated(rows: Iterable[Any], tokens: int, fields: tuple[str, ...]) -> list[float] | None:
    """`fields` of measured `rows` (each with its `tokens`) at `tokens`: interpolated linearly between the
    measured sizes, extrapolated from the nearest two; None where there is no row."""
    got = sorted(rows, key=lambda r: r.tokens)
    if not got:
        return None
    k = _weights([r.tokens for r in got], tokens)
    return [sum(w * getattr(got[i], f) for i, w in k) for f in fields]


def _weights(xs: list[int], x: int) -> list[tuple[int, float]]:
    """Linear interpolation weights over sorted sizes `xs` at `x` (the nearest two; one size: scaled)."""
    if len(xs) == 1:
        return [(0, x / xs[0])]
    i = next((j for j in range(1, len(xs) - 1) if xs[j] >= x), len(xs) - 1)
    a, b = xs[i - 1], xs[i]
    t = (x - a) / (b - a)
    return [(i - 1, 1 - t), (i, t)]


def _rows(v: Any, width: int, key: str, where: str, optional: int = 0) -> list[list[float]]:
    """`v` as rows of `width` numbers >= 0 (the last `optional` of them may be left out: 0)."""
    ok = isinstance(v, list) and all(
        isinstance(r, list)
        and width - optional <= len(r) <= width
        and all(isinstance(x, (int, float)) and x >= 0 for x in r)
        for r in v
    )
    if not ok or not v:
        n = f"{width - optional}-{width}" if optional else f"{width}"
        raise ValueError(f"{where} [calibration]: {key} must be a non-empty list of [{n} numbers >= 0] rows")
    return [r + [0] * (width - len(r)) for r in v]


def parse_calibration(d: Any, where: str) -> Calibration:
    """The `[calibration]` table of a hardware file; ValueError naming the key and its form."""
    known = {"model", "optimizer_layer_us", "action_overhead_us", "layer", "ends"}
    if not isinstance(d, dict) or not known <= set(d) <= known | {"core_share", "tp_all_reduce"}:
        got = sorted(d) if isinstance(d, dict) else repr(d)
        raise ValueError(
            f"{where} [calibration]: needs the keys {', '.join(sorted(known))} (and optionally core_share, "
            f"tp_all_reduce), got {got}"
        )
    share = d.get("core_share", 1.0)
    if not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"{where} [calibration]: core_share must be a number in (0, 1], got {share!r}")
    if not isinstance(d["model"], str):
        raise ValueError(f"{where} [calibration]: model must be the measured model's signature string")
    for k in ("optimizer_layer_us", "action_overhead_us"):
        if not isinstance(d[k], (int, float)) or d[k] < 0:
            raise ValueError(f"{where} [calibration]: {k} must be a number >= 0, got {d[k]!r}")
    layers = [LayerTime(int(r[0]), int(r[1]), *(x * 1e-6 for x in r[2:])) for r in _rows(d["layer"], 6, "layer", where)]
    ends = [EndTime(int(r[0]), *(x * 1e-6 for x in r[1:])) for r in _rows(d["ends"], 5, "ends", where)]
    coll = [
        CollectiveTime(int(r[0]), int(r[1]), r[2] * 1e-6, r[3] * 1e-6)
        for r in (_rows(d["tp_all_reduce"], 4, "tp_all_reduce", where, optional=1) if "tp_all_reduce" in d else [])
    ]
    return Calibration(
        d["model"],
        tuple(layers),
        tuple(ends),
        d["optimizer_layer_us"] * 1e-6,
        d["action_overhead_us"] * 1e-6,
        share,
        tuple(coll),
    )


def shapes_for(m: ModelConfig, global_batch: int, world: int) -> list[tuple[int, int]]:
    """The (tp, sequences per microbatch) a layout search over `world` ranks may ask for: tp dividing the
    world and the model's split sizes, microbatch sizes dividing the global batch."""
    sizes = (m.n_heads, m.kv_heads, m.ffn_dim, m.vocab_size)
    tps = [tp for tp in range(1, world + 1) if world % tp == 0 and all(x % tp == 0 for x in sizes)]
    return [(tp, b) for tp in tps for b in range(1, global_batch + 1) if global_batch % b == 0]


# -- measuring (torch) ------------------------------------------------------------------------------------
def _median_s(fn: Callable[[], Any], seconds: float, setup: Callable[[], Any] | None = None) -> float:
    """Median CPU seconds of `fn()` over calls for about `seconds` (after one warm-up); `setup()` runs
    untimed before each call and its result is passed on."""
    times: list[float] = []
    arg = setup() if setup else None
    fn(arg) if setup else fn()
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 5:
        arg = setup() if setup else None
        t0 = time.thread_time()
        out = fn(arg) if setup else fn()
        times.append(time.thread_time() - t0)
        del out  # after the clock: a forward's graph is freed by its backward in a step, not by the forward
    return statistics.median(times)


def _forward_backward_s(
    forward: Callable[[Any], Any], make_input: Callable[[], Any], g: Any, seconds: float
) -> tuple[float, float]:
    """Median CPU seconds of a forward on fresh input (made untimed) and of its backward, alternating
    as a step runs them, for about `seconds` (after one warm-up pair). Forwards timed back to back on
    one input read up to 60% higher with the meter's hooks on."""
    import torch

    torch.autograd.backward(forward(make_input()), g)
    fs: list[float] = []
    bs: list[float] = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(fs) < 5:
        x = make_input()
        t0 = time.thread_time()
        y = forward(x)
        t1 = time.thread_time()
        torch.autograd.backward(y, g)
        t2 = time.thread_time()
        fs.append(t1 - t0)
        bs.append(t2 - t1)
    return statistics.median(fs), statistics.median(bs)


def _local_shard(stage: Any, tp: int) -> None:
    """Cut `stage`'s tensor-parallel parameters to one rank's shard, in place (no collectives)."""
    import torch
    from torch import nn

    from hybridpar.model.tp import tp_dims

    for name, dim in tp_dims(stage).items():
        if dim is None:
            continue
        mod_name, _, attr = name.rpartition(".")
        mod = stage.get_submodule(mod_name)
        full = getattr(mod, attr)
        setattr(mod, attr, nn.Parameter(full.detach().chunk(tp, dim=dim)[0].clone()))
    torch.nn.Module.zero_grad(stage)


def _metered(module: Any) -> Callable[[Any], Any]:
    """`module`'s forward as the runtime runs it: every tensor autograd saves passes through the
    activation meter's hooks (pipeline/activation_meter.py), and the backward through their unpacking. Timed
    without them, a layer's forward read ~7% low against a training step's."""
    from hybridpar.pipeline.activation_meter import ActivationMeter

    meter = ActivationMeter()
    meter.reset(module.parameters())

    def run(*args: Any) -> Any:
        with meter.measuring():
            return module(*args)

    return run


STACK = 8  # most layers a calibration times at once (its cost grows with them)


def _layer_times(m: ModelConfig, seq_len: int, tp: int, batch: int, seconds: float) -> LayerTime:
    import torch

    from hybridpar.model.registry import build_stage
    from hybridpar.pipeline.split_backward import WeightGradDeferral

    # A stack of the model's layers (up to STACK), per layer: a step's working set is about the whole
    # model's activations whatever the layout (1F1B: stage s of pp holds pp - s microbatches of its
    # L / pp layers), and a layer timed alone runs in caches a step does not leave it: 4 layers of
    # the default model take 15% more per layer in the forward than 1.
    depth = min(m.n_layers, STACK)
    stage = build_stage(m, list(range(depth)), False, False, 0, torch.device("cpu"))
    _local_shard(stage, tp)
    x = torch.randn(batch, seq_len, m.dim, requires_grad=True)
    g = torch.randn(batch, seq_len, m.dim)
    forward = _metered(stage)
    f, b = _forward_backward_s(forward, lambda: torch.randn_like(x).requires_grad_(True), g, seconds)
    split = WeightGradDeferral(stage)
    keys = iter(range(1 << 30))

    def forward_and_b() -> int:
        k = next(keys)
        split.key = k
        y = forward(x)
        split.key = None
        split.backward_input(y, g, x, k)
        return k

    def fresh_b() -> tuple[int, Any]:
        k = next(keys)
        split.key = k
        y = forward(x)
        split.key = None
        return k, y

    b_input = _median_s(lambda ky: split.backward_input(ky[1], g, x, ky[0]), seconds, fresh_b)
    w = _median_s(lambda k: split.weight(k), seconds, forward_and_b)
    return LayerTime(tp, batch * seq_len, f / depth, b / depth, b_input / depth, w / depth)


def _end_times(m: ModelConfig, seq_len: int, batch: int, seconds: float) -> EndTime:
    import torch

    from hybridpar.model.registry import build_stage
    from hybridpar.pipeline.runtime import token_cross_entropy

    embed = _metered(build_stage(m, [], True, False, 0, torch.device("cpu")))
    head = _metered(build_stage(m, [], False, True, 0, torch.device("cpu")))
    ids = torch.randint(0, m.vocab_size, (batch, seq_len))
    g = torch.randn(batch, seq_len, m.dim)
    hidden = lambda: torch.randn(batch, seq_len, m.dim, requires_grad=True)  # noqa: E731
    loss = lambda h: token_cross_entropy(head(h), ids, 1.0)  # noqa: E731
    return EndTime(
        batch * seq_len,
        *_forward_backward_s(embed, lambda: ids, g, seconds),
        *_forward_backward_s(loss, hidden, None, seconds),
    )


def _optimizer_s(m: ModelConfig, seconds: float) -> float:
    import torch

    from hybridpar.config import TrainConfig
    from hybridpar.model.optim import make_optimizer
    from hybridpar.model.registry import build_stage

    stage = build_stage(m, [0], False, False, 0, torch.device("cpu"))
    opt = make_optimizer(list(stage.named_parameters()), TrainConfig())
    params = list(stage.parameters())

    def fill() -> None:
        for p in params:
            p.grad = torch.ones_like(p)

    def step(_: None) -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _median_s(step, seconds, fill)


def _action_overhead_s(seconds: float) -> float:
    import torch

    x = torch.ones(1)

    def hand_off() -> None:
        y = x.detach().requires_grad_(True)
        torch.autograd.grad(y * 1.0, y, torch.ones(1))

    return _median_s(hand_off, seconds)


def calibrate(m: ModelConfig, seq_len: int, shapes: list[tuple[int, int]], seconds: float = 0.05) -> Calibration:
    """Time the model's own modules at each (tp, sequences per microbatch) of `shapes`, `seconds` per figure."""
    layers = tuple(_layer_times(m, seq_len, tp, b, seconds) for tp, b in shapes)
    ends = tuple(_end_times(m, seq_len, b, seconds) for b in sorted({b for _, b in shapes}))
    return Calibration(signature(m, seq_len), layers, ends, _optimizer_s(m, seconds), _action_overhead_s(seconds))
