"""The analytic memory model: bytes each pipeline rank holds at its step's peak, from the configuration
alone (no tensor is allocated). The planner ranks layouts with it; `hybridpar bench memory_accuracy` checks it
against what the trainer counts from its tensors (trainer/held.py), component by component.

Components, each at its own high point in the step (their sum bounds the step's peak from above):
- params: the rank's stages, tensor-parallel shards by the family's plan; a head tied to the embedding
  is a second copy on the last stage when the two sit on different stages, one tensor otherwise.
- bf16 working copies (train.bf16_weights copies, dataparallel/copies.py): the parameters are bf16 (2 bytes
  each), the gradients fp32, and the optimizer holds fp32 masters beside the moments (12 bytes per
  parameter of the rank's dp slice, sliced at ZeRO 0 too), all-gathered as bf16; no weight casts; the
  residual stream and the norms' inputs and outputs are bf16, and each microbatch's forward casts the
  rotary tables to bf16 once per stage (`working_copies`).
- grads: one fp32 gradient per parameter (bf16 keeps fp32 masters and accumulates in fp32), whole while
  the step's microbatches accumulate, ZeRO-2 included (it reduces once per step). `grads_at_rest` (not
  part of the total): what the rank holds from the reduction through the optimizer step — under ZeRO-2
  its 1/dp slice of each gradient (dp rank 0's, the largest), else the whole gradients.
- optimizer: AdamW's two fp32 moments and a 4-byte step count per parameter; under ZeRO-1, 2 and 3 for the
  rank's slice only (dataparallel/zero.py's rule; the slice it steps is a view of the parameter, under
  ZeRO-3 a tensor of its own counted with the parameters).
- ZeRO-3 (dataparallel/zero3.py): params at the peak are the rank's slices plus the most it gathers at
  once (per microbatch: a stage's parameters outside its layers and two layers; per step: its stages
  whole); `params_at_rest` (not in the total) the slices alone. Under working copies both are bf16 (2 bytes),
  the fp32 master slices counted with the optimizer state.
- activations: what autograd saves for backward (the meter's quantity, pipeline/activation_meter.py), per
  decoder layer, embedding and head+loss, derived from the ops each family runs (below), times the
  microbatches whose forward is done and backward is not at each point of the rank's action list.
- buffers: message memory (receive buffers; the rings of shared-memory send links, replayed from the
  simulated schedule) plus the largest transient: the data-parallel gradient buckets (the flat copies
  of the all-reduce; none under ZeRO, whose reduce-scatter and all-gather work inside the tensors,
  dataparallel/zero.py) and the tied-embedding sum.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

import torch

from hybridpar.batching.order import pipeline_order
from hybridpar.batching.policy import plan_for
from hybridpar.config import Config, ModelConfig
from hybridpar.dataparallel.zero import slice_of
from hybridpar.model.registry import family
from hybridpar.model.tp import tp_dims
from hybridpar.pipeline.schedules import (
    Op,
    add_communication,
    build_schedule,
    compute_schedule,
    schedule_spec,
    stage_count,
    stages_per_rank,
)
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.pipeline.sim_program import Program, compile_program
from hybridpar.plan.messages import Replay, buffered, in_place, message_buffers, message_bytes, replay, transport
from hybridpar.plan.trace import Trace, activation_trace
from hybridpar.trainer.build import layer_partition

F32, I64 = 4, 8


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes held by one rank at its step's peak, by component."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    grads_at_rest: int = 0  # after the step's reduction (ZeRO-2: the dp slices); not in `total`
    params_at_rest: int = 0  # between steps (ZeRO-3: the dp slices, else `params`); not in `total`

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


Shape = tuple[tuple[int, ...], int | None]  # tp-local shape, the dimension tp shards (None: replicated)


def stage_shapes(cfg: Config, parts: list[range], s: int, cache: dict | None = None) -> list[Shape]:
    """Tensor-parallel rank 0's parameter shapes of stage s (torch.chunk: the first shard is the largest).
    `cache`: a dict kept across calls (MemoryModel's), since building a stage on the meta device is slow."""
    m, n = cfg.model, len(parts)
    # The families' decoder layers are alike (model/llama.py, model/gpt2.py): a stage's shapes, in order,
    # depend on how many layers it holds and on its ends, not on which layers, so stages of equal size share one build.
    key = (_model_key(m), cfg.parallel.tp, len(parts[s]), s == 0, s == n - 1)
    if cache is not None and key in cache:
        return list(cache[key])
    # One decoder layer is built and its shapes repeated (building every layer on the meta device is what
    # costs), where the layers' parameters come as one block between the ends' (else the whole stage).
    r = parts[s]
    one = _built_shapes(cfg, r[:1], s == 0, s == n - 1)
    inside = [i for i, (name, _) in enumerate(one) if name.startswith(family(m).stage.LAYERS + ".")]
    if inside and inside == list(range(inside[0], inside[-1] + 1)):
        block = [x for _, x in one[inside[0] : inside[-1] + 1]]
        out = [x for _, x in one[: inside[0]]] + block * len(r) + [x for _, x in one[inside[-1] + 1 :]]
    else:
        out = [x for _, x in _built_shapes(cfg, r, s == 0, s == n - 1)]
    if cache is not None:
        cache[key] = tuple(out)
    return out


def _built_shapes(cfg: Config, layers: range, first: bool, last: bool) -> list[tuple[str, Shape]]:
    """(name, shape) of each parameter of the stage holding `layers`, built on the meta device."""
    m = cfg.model
    with torch.device("meta"):
        stage = family(m).stage(m, layers, first, last)
    dims = tp_dims(stage) if cfg.parallel.tp > 1 else {}
    out = []
    for name, p in stage.named_parameters():
        shape, d = list(p.shape), dims.get(name)
        if d is not None:
            shape[d] = -(-shape[d] // cfg.parallel.tp)
        out.append((name, (tuple(shape), d)))
    return out


def _model_key(m: ModelConfig) -> tuple:
    return tuple((f.name, getattr(m, f.name)) for f in dataclasses.fields(m))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _cut(shape: tuple[int, ...], d: int | None, dp: int, cache: dict | None) -> tuple[bool, int]:
    """ZeRO's cut of one tensor among dp ranks (zero.slice_of): (sliced, elements of dp rank 0's slice: the
    largest). `d` (the tp-sharded dimension) does not change the cut. `cache`: kept across calls, since the
    layers repeat the same few shapes."""
    key = (shape, dp)
    if cache is not None and key in cache:
        return cache[key]
    sl = slice_of(torch.Size(shape), d, dp)
    out = (sl.dim is not None, _numel(shape) if sl.dim is None else _numel(shape) // shape[0] * sl.sizes[0])
    if cache is not None:
        cache[key] = out
    return out


def optimizer_bytes(shapes: list[Shape], dp: int, zero: int, cache: dict | None = None, masters: bool = False) -> int:
    """AdamW's state of dp rank 0: the moments of its slices and a step count per tensor. `masters`: bf16
    working copies' MasterAdamW, an fp32 master beside the moments of every slice."""
    per = 3 if masters else 2
    if not zero:
        return sum(per * F32 * _numel(s) + F32 for s, _ in shapes)
    counts = Counter(shapes)  # equal shapes add equal terms: once each, times count
    return sum(n * (per * F32 * _cut(shape, d, dp, cache)[1] + F32) for (shape, d), n in counts.items())


def bucket_bytes(stages: list[list[Shape]], dp: int, zero: int, cache: dict | None = None, cp: int = 1) -> int:
    """Bytes of the data-parallel gradient buckets, all in flight by the end of the backward (dataparallel/grads.py's
    grouping: each stage's parameters in reverse order, a new bucket past BUCKET_BYTES): a flat copy of
    each bucket for the all-reduce. Under ZeRO the sliced gradients (every tensor at dp > 1) are
    reduce-scattered in place: no copy. Context-parallel peers sum their gradients too (over dp x cp): at
    dp = 1 and cp > 1 the flat copies are there all the same."""
    if dp * cp == 1:
        return 0
    zero = zero if dp > 1 else 0  # ZeRO's slices are cut over dp
    # Every tensor is copied once into some bucket and every bucket is in flight: how the tensors are grouped
    # does not change the sum, so equal tensors are counted once each, times their count.
    total = 0
    for shapes in stages:
        for (shape, d), count in Counter(shapes).items():
            sliced = _cut(shape, d, dp, cache)[0] if zero else False
            total += 0 if sliced else count * _numel(shape) * F32
    return total


def table_casts(cfg: Config, has_layers: bool) -> int:
    """Under working copies, a stage's forward casts the rotary tables to the residual stream's bf16 once per
    microbatch (llama.py's forward), and its layers' rotations save that cast (autocast saves the fp32 tables
    themselves, once per step: step_saved)."""
    m = cfg.model
    on = cfg.train.working_copies and has_layers and m.family == "llama" and cfg.parallel.cp == 1
    return 2 * seq_len(cfg) * m.head_dim * 2 if on else 0


def seq_len(cfg: Config) -> int:
    """Tokens of one sample on one rank: the sequence, or under context parallelism its 1/cp (every
    per-token term below scales with it)."""
    return cfg.train.seq_len // cfg.parallel.cp


def ring_attention_saved(cfg: Config, bt: int, b: int) -> int:
    """What ring attention (parallel.cp > 1, model/ring_attention.py) saves instead of the fused kernel's:
    its q, and k, v of the kv heads only (the rank's own block), its fp32 output and log-sum-exp, and the
    output projection's input: the output itself in fp32 (laid out tokens-major, so the projection's
    input is a view of it), its bf16 cast under bf16. Llama's q and k come out of the rotary product
    with fp32 tables, so they are fp32 under autocast too (the ring computes in fp32); under working copies
    the tables' rows are cast to bf16 first, and q and k stay bf16."""
    m, t, tp = cfg.model, cfg.train, cfg.parallel.tp
    hq, hk, hd = m.n_heads // tp, m.kv_heads // tp, m.head_dim
    c = 2 if t.precision == "bf16" else F32
    qk = F32 if m.family == "llama" and not cfg.train.working_copies else c
    out = bt * hq * hd * F32 + b * hq * seq_len(cfg) * F32
    return bt * (hq + hk) * hd * qk + bt * hk * hd * c + out + (bt * hq * hd * c if c != F32 else 0)


def seq_shards(cfg: Config) -> int:
    """The sequence's slices under sequence parallelism (model/tp.py): tp with it, else 1. The norms'
    own tensors, a layer's input and the messages between stages hold 1/seq_shards of the tokens; what
    the tp-sharded matmuls save (their gathered inputs, their outputs) holds all of them."""
    p = cfg.parallel
    return p.tp if p.sequence_parallel and p.tp > 1 else 1


def regathers(cfg: Config, mode: str) -> bool:
    """Whether a layer's column-parallel projections keep only the 1/tp slice of their gathered input
    (parallel.sp_backward = "regather", model/regather.py): under sequence parallelism, where the layer is not
    recomputed or compiled and no zero-bubble W keeps the input anyway."""
    p = cfg.parallel
    split = schedule_spec(p.schedule).splits_backward
    return (
        seq_shards(cfg) > 1 and p.sp_backward == "regather" and mode == "none" and not split and not cfg.train.compile
    )


def rebuilds(cfg: Config, mode: str) -> bool:
    """Whether a layer's blocks rebuild cheap saved tensors in the backward (train.rebuild_saved,
    model/regather.py): where the layer is not recomputed or compiled and no zero-bubble W keeps the inputs
    anyway (as `regathers`)."""
    split = schedule_spec(cfg.parallel.schedule).splits_backward
    t = cfg.train
    return t.rebuild_saved and mode == "none" and not split and not t.compile


def layer_saved(cfg: Config, b: int, mode: str) -> int:
    """Bytes autograd saves for one decoder layer's backward, microbatch of b samples (tp rank's share).
    Counted per op from what each backward reads; checked against the meter by tests/test_memory_model.py."""
    m, t, tp = cfg.model, cfg.train, cfg.parallel.tp
    bt, d, hd = b * seq_len(cfg), m.dim, m.head_dim
    bs = bt // seq_shards(cfg)  # tokens of the sequence-sharded regions (all of them without SP)
    bg = bs if regathers(cfg, mode) else bt  # tokens of the projections' gathered inputs as kept
    hq, hk, f = m.n_heads // tp, m.kv_heads // tp, m.ffn_dim // tp
    low, copies = t.precision == "bf16", cfg.train.working_copies
    c = 2 if low else F32  # bytes of what the matmuls produce (autocast's dtype)
    r = 2 if copies else F32  # the residual stream's (bf16 under working copies)
    x = bs * d * r  # the layer's input: all that full recomputation keeps
    if mode == "full":
        return x
    llama = m.family == "llama"
    rb = rebuilds(cfg, mode)
    ins = 0 if rb and bg == bs else bg  # tokens of the projections' inputs kept (not rebuilt from the norm)
    if mode == "selective":  # the input and every matmul output
        outs = (hq + 2 * hk) * hd + 2 * d + (2 * f if llama else f)
        return x + bt * outs * c
    attn = 4 * bt * hq * hd * c + b * hq * seq_len(cfg) * F32  # attention's q, k, v, output; log-sum-exp (fp32)
    attn = ring_attention_saved(cfg, bt, b) if cfg.parallel.cp > 1 else attn
    if llama:
        # RMSNorm keeps its input and 1/rms (fp32; llama._RMSNorm); the projections keep their
        # input: the norm's output itself in fp32, under autocast its bf16 cast, one shared by q, k, v and
        # one by gate, up (llama.shared_casts; the weights' casts: weight_casts). SwiGLU keeps gate and up
        # (llama._SwiGLU recomputes silu(gate)), the down projection the product. Under working copies the
        # norm's input is bf16 and its output, bf16 too, is what the projections keep (the casts' bytes).
        # Rebuilt instead (model/regather.py): the projections' inputs (not a gathered whole kept as it is: SP,
        # sp_backward saved), the product, and of k, v repeated to the query heads all but one head of each group.
        norms = 2 * (bs * d * r + bs * F32 + (0 if low else ins * d * F32))
        casts = 2 * ins * d * 2 if low else 0
        if rb and cfg.parallel.cp == 1:
            attn -= 2 * bt * (hq - hk) * hd * c
        return norms + casts + attn + (2 if rb else 3) * bt * f * c
    # GPT-2: LayerNorm keeps input, mean and 1/std; q, k, v share the fused projection's output. The inputs of
    # the fused qkv and the first MLP projection (the norms' outputs, gathered) and the second's (gelu's output)
    # are kept, or rebuilt from the norms' inputs and the first's output (model/regather.py). Under working
    # copies the norms' input, mean and 1/std are bf16 (the residual stream's dtype: torch's CPU LayerNorm keeps
    # its statistics in the input's dtype where the weights share it; CUDA's keep them fp32, 4 bytes more a token).
    norms = 2 * (bs * d + 2 * bs) * r
    attn = bt * 3 * hq * hd * c + b * hq * seq_len(cfg) * F32 + bt * hq * hd * c
    attn = ring_attention_saved(cfg, bt, b) if cfg.parallel.cp > 1 else attn
    return norms + 2 * ins * d * c + attn + (1 if rb else 2) * bt * f * c


def weight_casts(cfg: Config, layers: int, last: bool) -> int:
    """autocast's bf16 copies of the linear weights a stage's matmuls save (`layers` decoder layers, the head
    on the last stage; tp rank's shards): made once per step where the rank's step spans autocast's cache
    (pipeline/runtime.py's step_casts: no stage of the rank recomputes), else once per microbatch."""
    m, tp = cfg.model, cfg.parallel.tp
    if cfg.train.precision != "bf16" or cfg.train.working_copies:  # working copies: the weights are bf16, no casts
        return 0
    d, hd, hq, hk, f = m.dim, m.head_dim, m.n_heads // tp, m.kv_heads // tp, m.ffn_dim // tp
    if m.family == "llama":  # q, k, v; o; gate, up, down
        per_layer = (hq + 2 * hk) * hd * d + hq * hd * d + 3 * d * f
    else:  # the fused qkv; the output projection; the MLP's two
        per_layer = 3 * hq * hd * d + hq * hd * d + 2 * d * f
    return 2 * (layers * per_layer + ((m.vocab_size // tp) * d if last else 0))


def ends_saved(cfg: Config, b: int, first: bool, last: bool) -> int:
    """Per microbatch, what the embedding (first stage) and the final norm, head and loss (last) save."""
    m, t = cfg.model, cfg.train
    bt, d, low = b * seq_len(cfg), m.dim, t.precision == "bf16"
    out = embedding_saved(cfg, b) if first else 0
    if cfg.parallel.cp > 1 and m.family == "llama":  # each microbatch's rows of the rotary tables (cos, sin)
        out += 2 * bt * m.head_dim * (2 if cfg.train.working_copies else F32)  # working copies: their bf16 cast
    if last:
        # The final norm as in the layers, the head's input (its cast under autocast; the weight's cast:
        # weight_casts), the fp32 log-softmax over the whole vocabulary, the loss's total weight.
        bs = bt // seq_shards(cfg)  # the final norm runs on the rank's slice of the sequence
        r = 2 if cfg.train.working_copies else F32  # the residual stream's bytes
        norm = bs * d * r + (bs * F32 if m.family == "llama" else 2 * bs * r)
        head_in = bt * d * 2 if low else bt * d * F32
        out += norm + head_in + bt * m.vocab_size * F32 + F32
    return out


def embedding_saved(cfg: Config, b: int) -> int:
    """Per microbatch of b samples, what the first stage's embedding saves: under a vocabulary-parallel lookup
    the shifted ids and the outside-the-shard mask (one rank: the ids themselves, a view of the replica's
    batch, counted once per step in `step_saved`); GPT-2's positions looked up."""
    bt = b * seq_len(cfg)
    return (bt * (I64 + 1) if cfg.parallel.tp > 1 else 0) + (seq_len(cfg) * I64 if cfg.model.family == "gpt2" else 0)


def held_through_b(cfg: Config, b: int, first: bool, has_layers: bool) -> int:
    """Recomputing, what of a microbatch's saved bytes its B frees only at its end, past its high point (the
    rerun of the stage's first layer): what the embedding saves, which its backward, B's last, frees; under
    working copies the rotary tables' bf16 cast, an input of every layer's rerun, freed with the first's."""
    return (embedding_saved(cfg, b) if first else 0) + table_casts(cfg, has_layers)


def step_saved(cfg: Config, first: bool, last: bool, replica: int) -> int:
    """Saved once per stage while any of its microbatches is held: the rotary tables (one storage per
    stage), the replica's token ids (first stage, one rank) and targets (last stage)."""
    m = cfg.model
    rope = 2 * seq_len(cfg) * m.head_dim * F32 if m.family == "llama" and cfg.parallel.cp == 1 else 0
    rope = 0 if cfg.train.working_copies else rope  # their bf16 casts, per microbatch: table_casts
    ids = replica * seq_len(cfg) * I64
    return rope + (ids if first and cfg.parallel.tp == 1 else 0) + (ids if last else 0)


def weight_held(cfg: Config, b: int, layers: int, last: bool) -> int:
    """What a zero-bubble split keeps from B until W for one microbatch (split_backward.py): each linear
    layer's input and output gradient — per decoder layer the two norm outputs (fp32), the attention
    output and the MLP's last input, the projections' output gradients; on the last stage the head's
    input and its (vocabulary shard of the) logits' gradient. The same whatever the recomputation: a
    recomputed layer's rerun in B hands over the same tensors."""
    m, t, tp = cfg.model, cfg.train, cfg.parallel.tp
    bt, d, hd, f = b * seq_len(cfg), m.dim, m.head_dim, m.ffn_dim // tp
    hq, hk = m.n_heads // tp, m.kv_heads // tp
    c = 2 if t.precision == "bf16" else F32
    # llama's projections read the norms' shared bf16 cast; GPT-2's the norm's output, fp32 under autocast
    # and bf16 under working copies
    shared = c if m.family == "llama" or cfg.train.working_copies else F32
    inputs = 2 * bt * d * shared + bt * hq * hd * c + bt * f * c
    grads = bt * (hq + 2 * hk) * hd * c + 2 * bt * d * c + (2 if m.family == "llama" else 1) * bt * f * c
    head = bt * d * (2 if cfg.train.working_copies else F32) + bt * (m.vocab_size // tp) * c if last else 0
    return layers * (inputs + grads) + head


def activation_peaks(
    cfg: Config, parts: list[range], sizes: list[int], actions: list[list], trace: Trace | None = None
) -> list[int]:
    """Per rank, the most saved bytes alive at once: a forward adds its microbatch's, its backward (B)
    frees them, the per-stage constants count while any microbatch of the stage is held. Where B and W
    are split, B trades the saved tensors for what W needs (weight_held), held until W; inside B the
    first output gradient is held before anything is freed (no recomputation), or every hold is
    in place while the stage's first layer input is still saved (recomputation: the rerun makes them), with
    what B frees only at its end (held_through_b), the last stage's targets gone (the loss's backward runs first).
    `trace`: the lists' `activation_trace` for these sizes, where the caller keeps it."""
    trace = trace or activation_trace(sizes, actions)
    n, replica = len(parts), sum(sizes)
    modes = cfg.train.recompute_modes(n)
    split = trace.split
    ranks = schedule_spec(cfg.parallel.schedule).stage_ranks(cfg.parallel.pp, stages_per_rank(cfg.parallel))
    spans = [all(modes[o] == "none" for o in range(n) if ranks[o] == ranks[s]) for s in range(n)]
    c = 2 if cfg.train.precision == "bf16" else F32
    own = in_place(cfg) and buffered(cfg, split)  # received messages read where they landed, in the rank's buffers
    terms: dict[tuple[int, int], tuple[int, int, int, int, int]] = {}

    def term(s: int, b: int) -> tuple[int, int, int, int, int]:
        """(saved per microbatch, per-stage constant, kept from B to W, B's own high point above `live`, what of
        the constant a B that frees it frees before that point) of stage s, microbatch of b samples: the same
        for every action of the pair, so counted once."""
        first, last = s == 0, s == n - 1
        one = len(parts[s]) * layer_saved(cfg, b, modes[s]) + ends_saved(cfg, b, first, last)
        one += table_casts(cfg, bool(parts[s]))
        const = step_saved(cfg, first, last, replica)
        # A recomputed layer saves no weight casts (its rerun makes them); the head is never recomputed.
        casts = weight_casts(cfg, len(parts[s]) if modes[s] == "none" else 0, last)  # per step or microbatch
        one, const = (one, const + casts) if spans[s] else (one + casts, const)
        kept = weight_held(cfg, b, len(parts[s]), last) if split else 0
        # W's inputs are held from F on (a recomputed layer's from B); under autocast GPT-2's linear
        # layers' fp32 inputs (the norms' outputs) are not what autograd saves (their bf16 casts), so
        # they come on top: two per layer, and the head's (never recomputed); llama's layers read the
        # saved shared cast (llama.shared_casts), so only its head's.
        per_layer = 2 * (modes[s] == "none") * (cfg.model.family != "llama")
        norms = per_layer * len(parts[s]) + last
        widened = split and c == 2 and not cfg.train.working_copies  # working copies: W holds what autograd saves
        one += norms * b * seq_len(cfg) * cfg.model.dim * F32 if widened else 0
        bt_d = b * seq_len(cfg) * cfg.model.dim // seq_shards(cfg)  # a stage's input and output
        # Recomputing, B holds all W needs while the stage's input (the residual stream's dtype) is still saved.
        r = 2 if cfg.train.working_copies else F32
        rerun = kept - one + bt_d * r + held_through_b(cfg, b, first, bool(parts[s]))
        inside = (0 if last else bt_d * c) if modes[s] == "none" else rerun
        # ... while the loss's backward, B's first, has freed the targets (one storage per step) where B frees it.
        targets = replica * seq_len(cfg) * I64 if last and modes[s] != "none" else 0
        # A message read in place from a receive buffer is the buffer itself, which `buffers` counts
        # (plan/messages.py): the stage input its first layer saves, and under a split the output gradient
        # W keeps (B's first hold, the gradient the residual stream hands through unchanged).
        recv = message_bytes(cfg, b) if own and s > 0 and ranks[s - 1] != ranks[s] else 0
        grad = message_bytes(cfg, b) if own and split and not last and ranks[s + 1] != ranks[s] else 0
        return one - recv, const, kept - grad, inside - grad, targets

    # Per distinct step: what it adds to `live`, and (B, split) how far above `live` after it B peaks inside.
    delta, above = [], []
    for op, s, b, edge in trace.steps:
        key = (s, b)
        one, const, kept, inside, early = terms[key] if key in terms else terms.setdefault(key, term(*key))
        if op == Op.FORWARD:
            d = one + (const if edge else 0)
        elif op == Op.BACKWARD:
            d = kept - one - (const if edge else 0)
        else:
            d = -kept
        delta.append(d)
        above.append(inside - d - (early if op == Op.BACKWARD and edge else 0))  # B's peak: live before it + inside
    peaks = []
    for seq, bpos in zip(trace.ranks, trace.backwards):
        live = list(accumulate(map(delta.__getitem__, seq)))
        peak = max(live, default=0)
        if split:
            peak = max([peak] + [live[i] + above[seq[i]] for i in bpos])
        peaks.append(max(peak, 0))
    return peaks


class MemoryModel:
    """`rank_memory` with caches for one search: the planner asks for many layouts that share their stages
    (dp, ZeRO, precision and schedule do not change them), their schedule (tp, dp, ZeRO, precision,
    recomputation do not change its action lists or their replay) or all of their activations (ZeRO and dp
    do not change them). Each part is computed once per distinct input and looked up after, so the
    answers are `rank_memory`'s exactly. Owned by its caller (the planner makes one per search).

    `validate_schedules=False` skips re-checking the registry's action lists (build_schedule's validation,
    which dominated a search over many microbatch counts; the lists are the same, and the registry's
    schedules are validated by their tests and by the runtime)."""

    def __init__(self, validate_schedules: bool = True) -> None:
        self.validate_schedules = validate_schedules
        self._shapes: dict[tuple, tuple[Shape, ...]] = {}
        self._parts: dict[tuple, list[range]] = {}
        self._actions: dict[tuple, list[list]] = {}
        self._compute: dict[tuple, list[list]] = {}
        self._cuts: dict[tuple, tuple] = {}
        self._programs: dict[tuple, Program] = {}
        self._replays: dict[tuple, Replay] = {}
        self._messages: dict[tuple, list[int]] = {}
        self._activations: dict[tuple, list[int]] = {}
        self._static: dict[tuple, list[tuple[int, ...]]] = {}
        self._ranks: dict[tuple, tuple[int, ...]] = {}
        self._traces: dict[tuple, Trace] = {}

    def __call__(self, cfg: Config, parts: list[range] | None = None) -> list[MemoryEstimate]:
        """`parts`: the stages' layers where the config cannot say them (a stage without layers: Llama 3's
        embedding and head as chunks of their own, bench/published_compare.py), taken as given."""
        p, t = cfg.parallel, cfg.train
        if parts is None:
            validate_config(cfg)  # a bad configuration is named before anything is computed
            mk, parts, ranks = self._layout(cfg)
        else:
            mk, ranks = _model_key(cfg.model), tuple(schedule_spec(p.schedule).stage_ranks(p.pp, stages_per_rank(p)))
            if len(parts) != len(ranks):
                raise ValueError(f"{len(parts)} stages given for a layout of {len(ranks)}")
        sizes, sched = self._sizes(cfg)
        actions = self._get(self._actions, sched, lambda: self._lists(*sched))
        acts = self._activations_of(cfg, mk, parts, sizes, sched)
        rep = self._get(self._replays, (sched, ranks), lambda: replay(actions, p.pp, ranks, self.program(*sched)))
        messages = self._get(
            self._messages,
            (
                mk,
                sched,
                ranks,
                transport(cfg),
                in_place(cfg),
                t.precision,
                t.seq_len // seq_shards(cfg),
                p.cp,
                tuple(sizes),
            ),
            lambda: message_buffers(cfg, sizes, actions, ranks, rep),
        )
        static = self._static_of(cfg, mk, parts, ranks)
        return [
            MemoryEstimate(w, gr, opt, acts[r], messages[r] + rest, g, w0)
            for r, (w, gr, opt, rest, g, w0) in enumerate(static)
        ]

    def lower_bound(self, cfg: Config, enough: int | None = None) -> int:
        """No more than `max(e.total for e in self(cfg))`: the fullest rank's parameters, gradients,
        optimizer state, activations and largest transient buffer (the message buffers, never negative,
        left out), without the schedule's communication or its replay — the planner's cheap test of
        layouts that cannot fit. Where the parameters, gradients, optimizer state and transient alone
        exceed `enough`, their bytes (the activations not asked)."""
        mk, parts, ranks = self._layout(cfg)
        static = self._static_of(cfg, mk, parts, ranks)
        held = max(w + gr + opt + rest for w, gr, opt, rest, _, _ in static)
        if enough is not None and held > enough:
            return held
        acts = self._activations_of(cfg, mk, parts, *self._sizes(cfg))
        return max(w + gr + opt + rest + a for (w, gr, opt, rest, _, _), a in zip(static, acts))

    def _sizes(self, cfg: Config) -> tuple[list[int], tuple]:
        """(dp rank 0's microbatch sizes in the pipeline's order, the schedule's key)."""
        p, t = cfg.parallel, cfg.train
        count = len(t.microbatch_sizes) if t.microbatch_sizes and cfg.batching.policy == "fixed" else t.microbatches
        sizes = pipeline_order(plan_for(cfg, count).sizes[0], p.schedule, p.pp, stages_per_rank(p))
        return sizes, (p.schedule, p.pp, stages_per_rank(p), len(sizes), p.recv_lookahead)

    def _activations_of(self, cfg: Config, mk: tuple, parts: list[range], sizes: list[int], sched: tuple) -> list[int]:
        # The compute lists are enough: messages save nothing (activation_peaks skips them).
        p, t = cfg.parallel, cfg.train
        key = (
            mk,
            p.tp,
            p.sequence_parallel,
            p.cp,
            t.precision,
            t.bf16_weights,
            transport(cfg),
            t.seq_len,
            tuple(t.recompute_modes(len(parts))),
            tuple(parts),
        )
        key += (tuple(sizes),)
        compute = lambda: self.compute(*sched[:4])  # noqa: E731
        trace = lambda: self._get(self._traces, (sched, tuple(sizes)), lambda: activation_trace(sizes, compute()))  # noqa: E731
        return self._get(self._activations, key + sched, lambda: activation_peaks(cfg, parts, sizes, [], trace()))

    def _static_of(self, cfg: Config, mk: tuple, parts: list[range], ranks: tuple) -> list[tuple[int, ...]]:
        p = cfg.parallel
        key = (mk, p.tp, p.pp, p.dp, p.zero, p.zero3_regather, cfg.train.working_copies, tuple(parts), ranks)
        return self._get(self._static, key, lambda: self._held(cfg, parts, ranks))

    def program(self, name: str, pp: int, chunks: int, count: int, lookahead: int) -> Program:
        """The schedule's action lists lowered for the simulator (sim_program.py), once: the replay here and
        the planner's predictions simulate the same lists."""
        key = (name, pp, chunks, count, lookahead)
        ranks = schedule_spec(name).stage_ranks(pp, chunks)
        lists = lambda: self._get(self._actions, key, lambda: self._lists(*key))  # noqa: E731
        return self._get(self._programs, key, lambda: compile_program(lists(), pp, pp * chunks, ranks))

    def compute(self, name: str, pp: int, chunks: int, count: int) -> list[list]:
        """The schedule's compute lists, built once (the planner's step bounds read the same lists)."""
        return self._get(self._compute, (name, pp, chunks, count), lambda: compute_schedule(name, pp, chunks, count))

    def _layout(self, cfg: Config) -> tuple[tuple, list[range], tuple[int, ...]]:
        """(the model's key, the stages' layers, each stage's rank)."""
        p, mk = cfg.parallel, _model_key(cfg.model)
        costs = tuple(p.layer_costs) if p.layer_costs is not None else None
        layers = tuple(p.stage_layers) if p.stage_layers is not None else None
        parts = self._get(self._parts, (mk, p.partition, stage_count(p), costs, layers), lambda: layer_partition(cfg))
        return mk, parts, tuple(schedule_spec(p.schedule).stage_ranks(p.pp, stages_per_rank(p)))

    def _lists(self, name: str, pp: int, chunks: int, count: int, lookahead: int) -> list[list]:
        if self.validate_schedules:
            return build_schedule(name, pp, chunks, count, lookahead)
        ranks = schedule_spec(name).stage_ranks(pp, chunks)  # build_schedule's steps, less its validation
        compute = self.compute(name, pp, chunks, count)
        return add_communication(compute, pp, pp * chunks, lookahead, ranks=ranks)

    @staticmethod
    def _get(cache: dict, key: tuple, make):  # noqa: ANN001, ANN205 - one lookup rule for every cache
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def _held(self, cfg: Config, parts: list[range], ranks: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Per pipeline rank: (parameter bytes, gradient bytes, optimizer bytes, largest transient buffer,
        gradient bytes at rest, parameter bytes at rest)."""
        p, n, out = cfg.parallel, len(parts), []
        mk = _model_key(cfg.model)
        for r in range(p.pp):
            mine = [s for s in range(n) if ranks[s] == r]
            # A rank's bytes depend on its stages' shapes only: ranks of equal stage sizes are counted once.
            key = (mk, p.tp, p.pp, p.dp, p.cp, p.zero, p.zero3_regather, cfg.train.working_copies)
            key += tuple((len(parts[s]), s == 0, s == n - 1) for s in mine)
            out.append(self._get(self._ranks, key, lambda: self._rank_held(cfg, parts, mine)))
        return out

    def _rank_held(self, cfg: Config, parts: list[range], mine: list[int]) -> tuple[int, ...]:
        p = cfg.parallel
        per_stage = [stage_shapes(cfg, parts, s, self._shapes) for s in mine]
        shapes = [x for st in per_stage for x in st]
        params = sum(_numel(s) for s, _ in shapes) * F32
        copies = cfg.train.working_copies  # bf16 parameters; fp32 masters sliced over dp at any ZeRO
        opt = optimizer_bytes(shapes, p.dp, max(p.zero, copies), self._cuts, copies)
        embed = (cfg.model.vocab_size // p.tp, cfg.model.dim)  # (a shard of) the tied embedding
        if p.zero >= 2 and p.dp > 1:  # the kept gradient slices are summed, slice by slice (sync_tied_embeddings)
            embed = (_cut(embed, 0 if p.tp > 1 else None, p.dp, self._cuts)[1],)
        tie = _numel(embed) * F32 if cfg.model.tied and p.pp > 1 else 0
        grads, rest = params, params
        params = at_rest = params // 2 if copies else params
        if p.zero >= 2 and p.dp > 1:  # ZeRO-2 and 3 keep dp rank 0's slice of each gradient (zero.keep_slice)
            rest = sum(n * _cut(shape, d, p.dp, self._cuts)[1] for (shape, d), n in Counter(shapes).items()) * F32
        if p.zero == 3 and p.dp > 1:  # the slices at rest, plus what the step gathers at once (zero3.py)
            at_rest = rest // 2 if copies else rest  # working copies keep bf16 slices (their masters: opt)
            params = at_rest + self._gathered(cfg, parts, mine, per_stage, 2 if copies else F32)
        buffers = max(bucket_bytes(per_stage, p.dp, p.zero, self._cuts, p.cp), tie)
        return params, grads, opt, buffers, rest, at_rest

    def _gathered(
        self, cfg: Config, parts: list[range], mine: list[int], per_stage: list[list[Shape]], width: int
    ) -> int:
        """ZeRO-3's most whole parameters at once (zero3.Zero3.peak), of `width` bytes each: under
        regather=step every stage of the rank; per microbatch, one stage at a time (the runtime frees after
        each action) with its parameters outside layers and two layers (the one running and the next one's
        prefetch)."""
        whole = [sum(_numel(s) for s, _ in st) * width for st in per_stage]
        if cfg.parallel.zero3_regather == "step":
            return sum(whole)
        one = [x for _, x in _built_shapes(cfg, range(1), False, False)]  # a middle stage of one layer: a layer
        layer = sum(_numel(s) for s, _ in one) * width
        return max(w - (len(parts[s]) - min(2, len(parts[s]))) * layer for w, s in zip(whole, mine))


def rank_memory(cfg: Config, parts: list[range] | None = None) -> list[MemoryEstimate]:
    """One estimate per pipeline rank (index = pp rank) for the run `cfg` describes as given: model,
    tp/pp/dp, schedule, virtual stages, partition, microbatches/sizes, seq_len, precision, zero,
    recompute. Ranks that differ only in tp/dp coordinate hold the same (up to shard rounding): this is
    tp rank 0 and dp rank 0, the largest shards. One call, nothing kept: a search asks a `MemoryModel`.
    `parts`: as `MemoryModel.__call__`'s."""
    return MemoryModel()(cfg, parts)
