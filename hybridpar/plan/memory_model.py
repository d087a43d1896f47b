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
  decoder layer, embedding and head+loss, derived from the ops each family runs, times the
  microbatches whose forward is done and backward is not at each point of the rank's action list
  (plan/activations.py).
- buffers: message memory (receive buffers; the rings of shared-memory send links, replayed from the
  simulated schedule) plus the largest transient: the data-parallel gradient buckets (the flat copies
  of the all-reduce; none under ZeRO, whose reduce-scatter and all-gather work inside the tensors,
  dataparallel/zero.py) and the tied-embedding sum.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import torch

from hybridpar.batching.order import pipeline_order
from hybridpar.batching.policy import plan_for
from hybridpar.config import Config, ModelConfig
from hybridpar.dataparallel.zero import slice_of
from hybridpar.model.registry import family
from hybridpar.model.tp import tp_dims
from hybridpar.pipeline.schedules import (
    add_communication,
    build_schedule,
    compute_schedule,
    schedule_spec,
    stage_count,
    stages_per_rank,
)
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.pipeline.sim_program import Program, compile_program
from hybridpar.plan.activations import F32, activation_peaks, seq_shards
from hybridpar.plan.messages import Replay, in_place, message_buffers, replay, transport
from hybridpar.plan.trace import Trace, activation_trace
from hybridpar.trainer.build import layer_partition


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
