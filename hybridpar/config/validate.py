"""`Config.validate`: every rule of a run configuration that needs nothing above config/. Each failure
raises one ValueError naming the dotted key, its numbers and what would be right.

The rules run in a fixed order and the first failure wins, so the order is part of the behaviour: value
ranges first (every later rule divides by or compares against those numbers), then checkpoint,
resilience, learning rate, choices and load balancing, then the layout against the world size and the
rules that relate sections (model shape x tp, batch split, microbatch policy, layer costs).

The rules that ask the schedule registry (the schedule's name and constraints, and every count of
stages, which depends on the schedule's default virtual stages) are in
hybridpar/pipeline/schedules/config_rules.py, above config/; `validate_config` there runs both, and the
pre-flight check (run/preflight.py) calls it before any process starts.
"""

from __future__ import annotations

import os
import typing
from typing import TYPE_CHECKING, Any

from hybridpar.config.families import OPTIONS, rules, tp_split_sizes
from hybridpar.config.keys import _is_int, _is_num, _known_keys, _owner, _suggest
from hybridpar.config.sections import (
    RECOMPUTE_MODES,
    CheckpointConfig,
    ModelConfig,
    ParallelConfig,
    ResilienceConfig,
    TrainConfig,
)

if TYPE_CHECKING:  # config.py imports this module; the name is needed for annotations only
    from hybridpar.config.config import Config


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Raise ValueError naming the first bad field (dotted key), its numbers and what would be right."""
    _check_ranges(cfg)
    _check_checkpoint(cfg.checkpoint)
    _check_resilience(cfg.resilience)
    _check_lr(cfg.train)
    _check_choices(cfg)
    _check_balance(cfg)
    _check_world_size(cfg.parallel, world_size)
    _check_model(cfg.model, cfg.parallel, cfg.train)
    _check_recompute(cfg.train)
    _check_batch_split(cfg.train, cfg.parallel)
    _check_context(cfg)
    _check_batching(cfg)
    _check_layer_costs(cfg.parallel, cfg.model)
    _check_grad_sum(cfg)
    _check_copies(cfg)
    _check_planned(cfg)
    for key in ("profile.steps", "profile.trace_steps"):
        step_range(getattr(cfg.profile, key.split(".")[1]), key)
    profiled = step_range(cfg.profile.steps)
    _require(
        not cfg.profile.memory or bool(profiled),
        "profile.memory records the allocator over profile.steps, which is empty: add e.g. --profile.steps 5-7",
    )
    traced = step_range(cfg.profile.trace_steps)
    _require(  # a range cut by the end still traces the steps it reaches; one past the end, nothing
        cfg.trace is None or not traced or traced[0] < cfg.train.steps,
        f"--trace records profile.trace_steps={cfg.profile.trace_steps!r}, which starts past the run's last step "
        f"{cfg.train.steps - 1} (train.steps={cfg.train.steps}; steps count from 0): the trace would be empty",
    )
    _require(
        not profiled or profiled[-1] < cfg.train.steps,
        f"profile.steps={cfg.profile.steps!r} reaches past the run's last step {cfg.train.steps - 1} "
        f"(train.steps={cfg.train.steps}; steps count from 0)",
    )


def step_range(text: str, key: str = "steps") -> range:
    """'5-7' -> range(5, 8), '3' -> range(3, 4), '' -> an empty range; ValueError naming `key` otherwise."""
    if text == "":
        return range(0)
    lo, sep, hi = text.partition("-")
    if lo.strip().isdigit() and (not sep or hi.strip().isdigit()):
        first, last = int(lo), int(hi) if sep else int(lo)
        if first <= last:
            return range(first, last + 1)
    raise ValueError(f"{key}={text!r} must be a step or a range of steps like '5-7' (first <= last, from 0)")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_ranges(cfg: Config) -> None:
    # Ranges first: every later rule divides by or compares against these numbers.
    count, non_negative = (lambda v: _is_int(v) and v >= 1), (lambda v: _is_int(v) and v >= 0)
    ranges: list[tuple[str, typing.Callable[[Any], bool], str]] = [
        (
            "model.vocab_size model.dim model.n_layers model.n_heads model.ffn_dim model.rope_original_max_positions "
            "parallel.tp parallel.pp "
            "parallel.dp parallel.cp train.steps train.global_batch train.microbatches "
            "train.seq_len train.val_batches train.progress_every checkpoint.keep",
            count,
            "a positive integer",
        ),
        ("resilience.max_restarts", non_negative, "a non-negative integer"),
        ("resilience.hang_timeout_s", lambda v: _is_num(v) and v >= 0, ">= 0 (0 disables the watchdog)"),
        ("resilience.heartbeat_s resilience.slow_phase_timeout_s", lambda v: _is_num(v) and v > 0, "> 0"),
        (
            "model.n_kv_heads model.n_positions parallel.virtual_stages",
            lambda v: v is None or count(v),
            "a positive integer or none",
        ),
        ("model.tie_embeddings", lambda v: v is None or isinstance(v, bool), "true, false or none"),
        (
            "batching.microbatch_size emulate.memory_limit data.max_tokens",
            lambda v: v is None or count(v),
            "a positive integer or none",
        ),
        ("batching.steps_per_candidate", count, "a positive integer"),
        ("batching.warmup_steps batching.cooldown_steps", non_negative, "a non-negative integer"),
        (
            "batching.memory_budget",
            lambda v: v is None or (_is_num(v) and v > 0),
            "> 0 (bytes if > 1, a fraction of device memory if <= 1) or none",
        ),
        ("batching.switch_margin", lambda v: _is_num(v) and 0 <= v < 1, "in [0, 1)"),
        ("batching.drift_margin", lambda v: _is_num(v) and 0 < v < 1, "in (0, 1)"),
        (
            "train.warmup_steps train.val_every train.monitor_every train.sample_tokens"
            " parallel.recv_lookahead checkpoint.every",
            non_negative,
            "a non-negative integer",
        ),
        (
            "train.lr train.eps parallel.timeout_s model.norm_eps model.init_std model.rope_theta model.rope_factor "
            "model.rope_low_freq_factor model.rope_high_freq_factor sinks.peak_probe_s",
            lambda v: _is_num(v) and v > 0,
            "> 0",
        ),  # `v > 0` is False for NaN, so NaN is rejected too
        ("train.grad_clip", lambda v: _is_num(v) and v >= 0, ">= 0 (0 disables clipping)"),
        ("train.beta1 train.beta2", lambda v: _is_num(v) and 0 <= v < 1, "in [0, 1)"),
        ("data.val_fraction", lambda v: _is_num(v) and 0 < v < 0.5, "in (0, 0.5)"),
    ]
    for keys, ok, what in ranges:
        for key in keys.split():
            _require(ok(value := getattr(*_owner(cfg, key))), f"{key} must be {what}, got {value!r}")


def _check_checkpoint(c: CheckpointConfig) -> None:
    _require(
        isinstance(c.resume, str) and (c.resume in ("off", "auto") or os.path.isdir(c.resume)),
        f"checkpoint.resume={c.resume!r} must be 'off', 'auto' or an existing checkpoint directory",
    )
    _require(c.dir is None or isinstance(c.dir, str), f"checkpoint.dir must be a path or none, got {c.dir!r}")


def _check_resilience(r: ResilienceConfig) -> None:
    _require(
        not r.hang_timeout_s or r.hang_timeout_s >= 2 * r.heartbeat_s,
        f"resilience.hang_timeout_s={r.hang_timeout_s} must be at least twice resilience.heartbeat_s="
        f"{r.heartbeat_s} (or 0 to disable the watchdog), or a healthy rank could look hung",
    )
    _require(
        r.slow_phase_timeout_s >= r.hang_timeout_s,
        f"resilience.slow_phase_timeout_s="
        f"{r.slow_phase_timeout_s} must be at least resilience.hang_timeout_s={r.hang_timeout_s}",
    )


def _check_lr(t: TrainConfig) -> None:
    _require(
        _is_num(t.min_lr) and 0 <= t.min_lr <= t.lr,
        f"train.min_lr must be between 0 and train.lr={t.lr!r}, got {t.min_lr!r}",
    )


def _check_choices(cfg: Config) -> None:
    for key, f in _known_keys(type(cfg)).items():
        choices = f.metadata.get("choices", ())
        if choices and (v := getattr(*_owner(cfg, key))) not in choices:
            raise ValueError(
                f"{key}={v!r} is not one of {', '.join(map(str, choices))}{_suggest(str(v), tuple(map(str, choices)))}"
            )
    p = cfg.parallel
    _require(
        not (p.p2p == "shared_memory" and p.backend == "nccl"),
        "parallel.p2p=shared_memory carries CPU tensors, but parallel.backend=nccl runs on GPUs: "
        "use parallel.p2p=auto or process_group",
    )


def _check_balance(cfg: Config) -> None:
    b, p, t = cfg.balance, cfg.parallel, cfg.train
    _require(
        _is_num(cfg.emulate.layer_ms) and cfg.emulate.layer_ms >= 0,
        f"emulate.layer_ms must be >= 0 (0 = off), got {cfg.emulate.layer_ms!r}",
    )
    _require(
        cfg.emulate.layer_timing == "measured" or cfg.emulate.layer_ms > 0,
        "emulate.layer_timing='emulated' needs an emulated cost to read: set emulate.layer_ms > 0 "
        "(or emulate.layer_timing='measured')",
    )
    _require(
        _is_num(cfg.emulate.link_ms) and cfg.emulate.link_ms >= 0,
        f"emulate.link_ms must be >= 0 ms per message, got {cfg.emulate.link_ms!r}",
    )
    for key in ("interval", "window", "patience", "persist"):
        _require(_is_int(v := getattr(b, key)) and v >= 1, f"balance.{key} must be a positive integer, got {v!r}")
    _require(
        _is_int(b.skip_steps) and b.skip_steps >= 0,
        f"balance.skip_steps must be a non-negative integer, got {b.skip_steps!r}",
    )
    _require(_is_num(b.min_gain) and 0 <= b.min_gain < 1, f"balance.min_gain must be in [0, 1), got {b.min_gain!r}")
    _require(
        _is_num(b.threshold) and b.threshold > 1,
        f"balance.threshold must be > 1 (a ratio to the " f"others' median time), got {b.threshold!r}",
    )
    weights = (b.weight_memory, b.weight_compute, b.weight_network)
    for key, w in zip(("weight_memory", "weight_compute", "weight_network"), weights):
        _require(_is_num(w) and w >= 0, f"balance.{key} must be a number >= 0, got {w!r}")
    _require(sum(weights) > 0, f"balance.weight_memory + weight_compute + weight_network must be > 0, got {weights}")
    if b.mode == "off":
        return
    _require(
        p.dp == 1 or t.microbatch_sizes is None,
        f"balance.mode={b.mode} re-splits the batch among "
        "data-parallel replicas, which fixed train.microbatch_sizes would contradict: drop them",
    )
    # The adaptive planner sizes microbatches for an even replica share; an uneven one would escape
    # its memory model.
    _require(
        p.dp == 1 or cfg.batching.policy == "fixed",
        f"balance.mode={b.mode} with parallel.dp="
        f"{p.dp} re-splits the batch among replicas and needs batching.policy=fixed, got "
        f"{cfg.batching.policy!r}",
    )


def _check_grad_sum(cfg: Config) -> None:
    """parallel.grad_sum tree sums the step's dp × microbatches gradients in one balanced tree
    (dataparallel/tree.py): that needs powers of two and equal microbatches that stay where they are."""
    p, t = cfg.parallel, cfg.train
    if p.grad_sum != "tree":
        return
    key = "parallel.grad_sum=tree"
    for name, n in (("parallel.dp", p.dp), ("train.microbatches", t.microbatches)):
        _require(n & (n - 1) == 0, f"{key} sums a balanced binary tree: {name} must be a power of two, got {n}")
    units = p.dp * t.microbatches
    _require(
        t.global_batch % units == 0,
        f"{key} needs equal microbatches: train.global_batch={t.global_batch} must be a multiple of "
        f"parallel.dp × train.microbatches = {units}",
    )
    others = {
        "parallel.zero": p.zero != 0,
        "parallel.replica_batch": p.replica_batch is not None,
        "train.microbatch_sizes": t.microbatch_sizes is not None,
        "batching.microbatch_size": cfg.batching.microbatch_size is not None,
        "batching.policy=adaptive": cfg.batching.policy != "fixed",
        f"balance.mode={cfg.balance.mode}": cfg.balance.mode != "off",
    }
    bad = [k for k, on in others.items() if on]
    _require(
        not bad,
        f"{key} keeps every microbatch whole on its replica and sums whole gradients; it cannot run with "
        f"{', '.join(bad)}: leave them at their defaults or use parallel.grad_sum=overlapped",
    )


def _check_copies(cfg: Config) -> None:
    """train.bf16_weights=copies (trainer/build.py, dataparallel/copies.py) keeps bf16 parameters beside
    fp32 masters, which only bf16 training has."""
    t = cfg.train
    key = "train.bf16_weights=copies"
    _require(
        t.bf16_weights != "copies" or t.precision == "bf16",
        f"{key} needs train.precision=bf16, got {t.precision}: add --train.precision bf16",
    )


def _check_world_size(p: ParallelConfig, world_size: int | None) -> None:
    if world_size is not None and p.world_size != world_size:
        cp = (" × parallel.cp", f" × {p.cp}") if p.cp > 1 else ("", "")
        raise ValueError(
            f"parallel.tp × parallel.pp × parallel.dp{cp[0]} = {p.tp} × {p.pp} × {p.dp}{cp[1]} = "
            f"{p.world_size}, but {world_size} processes were started: "
            f"start {p.world_size} processes or change the layout"
        )


def _check_context(cfg: Config) -> None:
    """Context parallelism (parallel.cp > 1): the sequence must cut into 2 cp equal chunks (each rank
    holds chunk i and 2cp-1-i), and what does not compose with it yet is refused by name."""
    p, t = cfg.parallel, cfg.train
    if p.cp == 1:
        return
    _require(
        t.seq_len % (2 * p.cp) == 0,
        f"train.seq_len={t.seq_len} does not split into 2 × parallel.cp = {2 * p.cp} equal chunks: use a "
        f"multiple of {2 * p.cp} (e.g. {(t.seq_len // (2 * p.cp) + 1) * 2 * p.cp})",
    )
    # With sequence parallelism each cp rank's tokens are cut again over tp for the norm and residual
    # regions; Megatron-Core asks that every one of the 2 cp chunks split over tp (seq_len % 2 cp tp).
    n = 2 * p.cp * p.tp
    _require(
        not p.sequence_parallel or t.seq_len % n == 0,
        f"train.seq_len={t.seq_len} does not split into 2 × parallel.cp × parallel.tp = {n} equal slices "
        f"(parallel.sequence_parallel=true): use a multiple of {n} (e.g. {(t.seq_len // n + 1) * n})",
    )
    unsupported = [
        (cfg.data.document_mask, "data.document_mask=true", "data.document_mask=false"),
        (cfg.balance.mode != "off", f"balance.mode={cfg.balance.mode}", "balance.mode=off"),
        (p.auto, "parallel.auto=true", "an explicit layout (hybridpar plan ranks cp layouts)"),
        (p.cpu_bind != "none", f"parallel.cpu_bind={p.cpu_bind}", "parallel.cpu_bind=none"),
        (p.grad_sum == "tree", "parallel.grad_sum=tree", "parallel.grad_sum=overlapped"),
        (p.zero == 3 and p.dp > 1, "parallel.zero=3", "parallel.zero=2"),
    ]
    for bad, what, fix in unsupported:
        _require(not bad, f"parallel.cp={p.cp} does not support {what} yet: use {fix} or parallel.cp=1")


def check_model(m: ModelConfig) -> None:
    """The model's own rules (its family's options, head sizes); also run by `hybridpar serve`."""
    fam = rules(m)
    _require(m.dim % m.n_heads == 0, f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}")
    for key, opt in OPTIONS.items():
        _require(
            key in fam.options or opt.unset(m),
            f"model.{key}={getattr(m, key)!r} configures {opt.what}, "
            f"which model.family={m.family} does not have: leave model.{key} unset",
        )
    _require(
        not fam.rotary or m.head_dim % 2 == 0,
        f"model.head_dim = model.dim // model.n_heads = {m.dim} // "
        f"{m.n_heads} = {m.head_dim} must be even for rotary embeddings (RoPE)",
    )
    _require(
        m.n_heads % m.kv_heads == 0,
        f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.kv_heads}: model.n_kv_heads is one of "
        f"{', '.join(str(d) for d in range(1, m.n_heads + 1) if m.n_heads % d == 0)}",
    )
    _require(
        m.rope_scaling != "llama3" or m.rope_high_freq_factor > m.rope_low_freq_factor,
        f"model.rope_high_freq_factor={m.rope_high_freq_factor} must exceed model.rope_low_freq_factor="
        f"{m.rope_low_freq_factor} (llama3 rope scaling interpolates between them)",
    )


def _check_model(m: ModelConfig, p: ParallelConfig, t: TrainConfig) -> None:
    check_model(m)
    _require(
        m.max_positions is None or t.seq_len <= m.max_positions,
        f"train.seq_len={t.seq_len} exceeds the "
        f"{m.max_positions} learned positions of model.family={m.family}: raise model.n_positions",
    )
    # Tensor parallelism shards heads, the FFN and the vocabulary evenly across tp ranks.
    sizes = tp_split_sizes(m)
    fits = [d for d in range(1, min(sizes.values()) + 1) if all(x % d == 0 for x in sizes.values())]
    for key, v in sizes.items():
        _require(
            v % p.tp == 0,
            f"parallel.tp={p.tp} does not divide model.{key}={v}: parallel.tp of this model is one of "
            f"{', '.join(map(str, fits))}",
        )
    if p.sequence_parallel:
        _require(
            p.tp > 1,
            f"parallel.sequence_parallel splits the sequence over the tp ranks, but parallel.tp={p.tp}: "
            "use parallel.tp >= 2 or parallel.sequence_parallel=false",
        )
        _require(
            t.seq_len % p.tp == 0,
            f"parallel.sequence_parallel: parallel.tp={p.tp} does not divide train.seq_len={t.seq_len} "
            f"(use a multiple of {p.tp})",
        )


def _check_recompute(t: TrainConfig) -> None:
    _require(isinstance(t.recompute, str), f"train.recompute must be a string, got {t.recompute!r}")
    modes = [m.strip() for m in t.recompute.split(",")]
    for i, m in enumerate(modes):
        where = "train.recompute" if len(modes) == 1 else f"train.recompute entry {i} (stage {i})"
        _require(
            m in RECOMPUTE_MODES,
            f"{where}={m!r} is not one of {', '.join(RECOMPUTE_MODES)}{_suggest(m, RECOMPUTE_MODES)}",
        )
    # How many modes there may be (one, or one per stage) is a rule of the schedule's: config_rules.py.


def replica_share(t: TrainConfig, p: ParallelConfig) -> tuple[int, str]:
    """(samples of the smallest replica, the words that explain where that number comes from)."""
    if p.replica_batch is not None and len(p.replica_batch) == p.dp and all(map(_is_int, p.replica_batch)):
        return min(p.replica_batch), f"(parallel.replica_batch={p.replica_batch})"
    per_replica = t.global_batch // p.dp  # the smallest replica's share; replicas differ by at most one
    over = f"(train.global_batch={t.global_batch} over parallel.dp={p.dp})"
    return per_replica, over


def _check_batch_split(t: TrainConfig, p: ParallelConfig) -> None:
    _require(
        t.global_batch >= p.dp,
        f"train.global_batch={t.global_batch} is smaller than "
        f"parallel.dp={p.dp}: every data-parallel replica needs at least one sample",
    )
    per_replica, over = replica_share(t, p)
    _require(
        t.microbatches <= per_replica,
        f"train.microbatches={t.microbatches} exceeds the " f"{per_replica} samples per data-parallel replica {over}",
    )
    if t.microbatch_sizes is not None:
        sizes = t.microbatch_sizes
        _require(
            t.global_batch % p.dp == 0,
            f"train.microbatch_sizes needs train.global_batch="
            f"{t.global_batch} divisible by parallel.dp={p.dp} so every replica splits the same batch",
        )
        _require(
            len(sizes) == t.microbatches,
            f"train.microbatch_sizes has {len(sizes)} entries " f"but train.microbatches={t.microbatches}",
        )
        for i, n in enumerate(sizes):
            _require(_is_int(n) and n >= 1, f"train.microbatch_sizes[{i}]={n!r} must be a positive integer")
        _require(
            sum(sizes) == per_replica,
            f"train.microbatch_sizes sums to {sum(sizes)}, but each "
            f"data-parallel replica has {per_replica} samples {over}",
        )


def _check_batching(cfg: Config) -> None:
    b, p, t = cfg.batching, cfg.parallel, cfg.train
    per_replica, over = replica_share(t, p)
    _require(
        isinstance(b.try_recompute, bool), f"batching.try_recompute must be true or false, got {b.try_recompute!r}"
    )
    if b.try_recompute:
        _require(
            b.policy == "adaptive" and {m.strip() for m in t.recompute.split(",")} == {"none"},
            "batching.try_recompute lets the adaptive policy choose recomputation: it needs batching.policy="
            f"adaptive (got {b.policy!r}) and train.recompute=none (got {t.recompute!r})",
        )
    if b.microbatch_size is not None:
        _require(
            b.policy == "fixed" and t.microbatch_sizes is None,
            "batching.microbatch_size is a fixed "
            f"split: it needs batching.policy=fixed (got {b.policy!r}) and no train.microbatch_sizes",
        )
        n, largest = cfg.microbatch_count(), -(-t.global_batch // p.dp)
        what = (
            f"batching.microbatch_size={b.microbatch_size} cuts the {largest} samples per replica {over} "
            f"into {n} microbatches"
        )
        _require(n <= per_replica, f"{what}, more than the smallest replica's {per_replica} samples")
        # Enough microbatches for the schedule: config_rules.py.
    _require(
        b.policy != "adaptive" or t.microbatch_sizes is None,
        "train.microbatch_sizes fixes the split, " "but batching.policy=adaptive chooses it: drop one of them",
    )
    _require(
        b.memory_budget is None or b.policy == "adaptive",
        f"batching.memory_budget={b.memory_budget} " f"is used by batching.policy=adaptive only (got {b.policy!r})",
    )


def _check_layer_costs(p: ParallelConfig, m: ModelConfig) -> None:
    if p.partition == "cost" or p.layer_costs is not None:
        _require(
            p.partition == "cost",
            f"parallel.layer_costs is set but parallel.partition="
            f'{p.partition!r}: set parallel.partition="cost" to use it, or drop layer_costs',
        )
        _require(
            p.layer_costs is not None,
            f"parallel.partition='cost' needs parallel.layer_costs "
            f"(one positive cost per layer, model.n_layers={m.n_layers})",
        )
        costs: list[float] = p.layer_costs or []
        _require(
            len(costs) == m.n_layers,
            f"parallel.layer_costs has {len(costs)} entries " f"but model.n_layers={m.n_layers}",
        )
        for i, c in enumerate(costs):
            _require(_is_num(c) and c > 0, f"parallel.layer_costs[{i}]={c!r} must be > 0")


def positive_ints(key: str, values: list[int], count: int, what: str) -> None:
    _require(len(values) == count, f"{key} has {len(values)} entries but {what}")
    for i, n in enumerate(values):
        _require(_is_int(n) and n >= 1, f"{key}[{i}]={n!r} must be a positive integer")


def _check_planned(cfg: Config) -> None:
    """The keys the planner sets (an explicit split of layers and of the batch) and the planner's own."""
    p, t, b = cfg.parallel, cfg.train, cfg.batching
    _require(
        (p.partition == "layers") == (p.stage_layers is not None),
        f"parallel.stage_layers={p.stage_layers} goes with parallel.partition='layers' (got {p.partition!r}): "
        "set both or neither",
    )
    # stage_layers' count and sum are rules of the schedule's (its stages): config_rules.py.
    if p.replica_batch is not None:
        positive_ints("parallel.replica_batch", p.replica_batch, p.dp, f"parallel.dp={p.dp}")
        _require(
            sum(p.replica_batch) == t.global_batch,
            f"parallel.replica_batch sums to {sum(p.replica_batch)} but train.global_batch={t.global_batch}",
        )
        _require(
            b.policy == "fixed" and b.microbatch_size is None and t.microbatch_sizes is None,
            "parallel.replica_batch splits the batch unevenly, which batching.policy=adaptive, "
            "batching.microbatch_size and train.microbatch_sizes (sized for an even split) cannot follow: drop them",
        )
    for key in ("hardware", "auto_precision"):
        _require(p.auto or not getattr(p, key), f"parallel.{key} is read by the planner only: add --parallel.auto true")
