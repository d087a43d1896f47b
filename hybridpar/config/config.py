"""Typed run configuration: dataclasses with help text, validation, TOML files and CLI overrides.

Pure Python on purpose (no torch import) so `hybridpar train --help` and config errors are instant,
and so every rank can validate the layout before touching a process group.
"""

import dataclasses
import difflib
import os
import sys
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib


def _f(default: Any, help: str, **meta: Any) -> Any:
    """A field carrying its help text (and optional `choices`) in metadata, so help and validation
    read one source. A class default becomes a default_factory: each Config owns its sections."""
    metadata = {"help": help, **meta}
    if isinstance(default, type):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    vocab_size: int = _f(256, "vocabulary size (256 = raw bytes)")
    dim: int = _f(128, "hidden size")
    n_layers: int = _f(4, "number of transformer blocks")
    n_heads: int = _f(4, "attention (query) heads")
    n_kv_heads: int | None = _f(None, "key/value heads (none = n_heads; fewer = grouped-query attention)")
    ffn_dim: int = _f(352, "SwiGLU feed-forward inner size")
    rope_theta: float = _f(10000.0, "rotary embedding base")
    norm_eps: float = _f(1e-5, "RMSNorm epsilon")
    tie_embeddings: bool = _f(False, "share the input embedding with the output projection")
    init_std: float = _f(0.02, "standard deviation of the normal weight init")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


@dataclass
class ParallelConfig:
    tp: int = _f(2, "tensor-parallel degree")
    pp: int = _f(2, "pipeline-parallel degree (pipeline ranks)")
    dp: int = _f(1, "data-parallel degree (replicas)")
    schedule: str = _f("1f1b", "pipeline schedule", choices=("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"))
    virtual_stages: int = _f(1, "model chunks per pipeline rank (>1 only with interleaved-1f1b)")
    partition: str = _f("params", "how layers are split into stages", choices=("uniform", "params", "cost"))
    layer_costs: list[float] | None = _f(None, "per-layer cost, comma-separated (required iff partition=cost)")
    timeout_s: float = _f(120.0, "bound in seconds on every collective and point-to-point wait")
    backend: str = _f("auto", "torch.distributed backend", choices=("auto", "gloo", "nccl"))
    recv_lookahead: int = _f(1, "compute actions ahead of use that receives are posted (>=0)")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages


@dataclass
class TrainConfig:
    steps: int = _f(250, "optimizer steps")
    global_batch: int = _f(16, "sequences per step, summed over data-parallel replicas")
    microbatches: int = _f(4, "microbatches per data-parallel replica per step")
    microbatch_sizes: list[int] | None = _f(None, "explicit, possibly unequal split of each replica's batch")
    seq_len: int = _f(128, "tokens per sequence")
    lr: float = _f(3e-3, "peak learning rate")
    min_lr: float = _f(3e-4, "learning rate at the end of cosine decay")
    warmup_steps: int = _f(20, "linear warmup steps")
    weight_decay: float = _f(0.1, "AdamW weight decay")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    grad_clip: float = _f(1.0, "global gradient-norm clip (0 disables)")
    seed: int = _f(0, "random seed")
    val_every: int = _f(50, "validate every N steps (0 disables)")
    monitor_every: int = _f(10, "every N steps, gather each rank's measured memory, stage times and "
                               "link counters into metrics.jsonl (0 disables)")
    val_batches: int = _f(4, "batches per validation")
    sample_tokens: int = _f(200, "tokens generated at the end (0 disables)")
    sample_prompt: str = _f("def ", "prompt for the final sample")


@dataclass
class DataConfig:
    path: str | None = _f(None, "text file, folder of text files or nanoGPT uint16 .bin (none = stdlib .py files)")
    val_fraction: float = _f(0.05, "fraction of the corpus held out for validation")
    max_bytes: int = _f(16_000_000, "cap on corpus bytes read")


@dataclass
class CheckpointConfig:
    every: int = _f(0, "save a checkpoint every N steps (0 = off)")
    keep: int = _f(3, "committed checkpoints kept; older ones are deleted after each new commit")
    dir: str | None = _f(None, "checkpoint directory (none = <run_dir>/checkpoints)")
    resume: str = _f("off", "'off', 'auto' (the newest checkpoint in checkpoint.dir that verifies) or the path "
                            "of one checkpoint directory; also --resume")
    async_save: bool = _f(False, "snapshot to host memory and write in the background while training goes on "
                                 "(committed only once complete)")


@dataclass
class ResilienceConfig:
    hang_timeout_s: float = _f(60.0, "a rank that stops beating, or a run where no rank progresses, for this long "
                                     "is named and the run aborted (0 disables the watchdog)")
    slow_phase_timeout_s: float = _f(600.0, "allowance for phases that may legitimately take long without progress "
                                            "(checkpoint write, validation); a frozen rank is still named after "
                                            "hang_timeout_s")
    heartbeat_s: float = _f(1.0, "seconds between heartbeats (and watchdog checks)")
    max_restarts: int = _f(3, "restarts of all workers by the elastic agent after a failure (hybridpar train "
                              "and launch(); torchrun's --max-restarts overrides)")
    resume_on_restart: bool = _f(True, "after a restart by the elastic agent, resume as with checkpoint.resume=auto")
    replan: str = _f("auto", "when resuming with a world size other than tp*pp*dp: 'auto' picks a new layout "
                             "(keep tp, then pp; dp takes the rest), 'off' refuses", choices=("auto", "off"))


@dataclass
class BatchingConfig:
    policy: str = _f("fixed", "how each replica's batch is cut into microbatches: 'fixed' (train.microbatches "
                              "or batching.microbatch_size) or 'adaptive' (measured throughput under a memory "
                              "budget, re-planned at run time)", choices=("fixed", "adaptive"))
    microbatch_size: int | None = _f(None, "fixed policy: the fewest balanced microbatches of at most this many "
                                           "samples, instead of train.microbatches")
    memory_budget: float | None = _f(None, "adaptive policy: activation memory per rank, in bytes (> 1) or as a "
                                           "fraction of the device's memory (<= 1) minus what is resident anyway")
    steps_per_candidate: int = _f(3, "adaptive: measured steps per candidate split")
    warmup_steps: int = _f(1, "adaptive: unmeasured steps after each change of split")
    switch_margin: float = _f(0.03, "adaptive: a candidate must beat the current split by this fraction")
    drift_margin: float = _f(0.10, "adaptive: re-scan when throughput drifts by more than this fraction")
    cooldown_steps: int = _f(50, "adaptive: at least this many steps between re-scans")


@dataclass
class EmulateConfig:
    slowdown: str = _f("", "TESTING/BENCHMARK MODE, off by default: stretch ranks' compute, e.g. "
                           "'rank=2:2.0@step=10,rank=2:1.0@step=50' (rank 2 twice as slow for steps 10-49)")
    fault: str = _f("", "TESTING MODE, off by default: inject faults, each once per run_dir, e.g. "
                        "'rank=1:kill@step=3:phase=forward' (see hybridpar/resilience/chaos.py)")
    layer_ms: float = _f(0.0, "BENCHMARK MODE, off by default (0): every decoder layer's forward also sleeps this "
                              "many ms per sample and its backward twice that, so compute is a fixed duration")
    memory_limit: int | None = _f(None, "TESTING MODE, off by default: raise an out-of-memory error when a rank's "
                                        "activations held for backward would exceed this many bytes")


@dataclass
class BalanceConfig:
    mode: str = _f("off", "dynamic load balancing: 'off'; 'detect' (log decisions, change nothing); 'auto' "
                          "(re-partition stages live and re-split the batch among replicas)",
                   choices=("off", "detect", "auto"))
    interval: int = _f(20, "never decide a rebalance more often than every N steps")
    min_gain: float = _f(0.05, "act only if the predicted step time falls by at least this fraction")
    threshold: float = _f(1.25, "straggler: smoothed time per unit of work above this x the others' median")
    skip_steps: int = _f(2, "first steps of a run not measured (allocation and lazy-init warm-up)")
    window: int = _f(5, "measurements in each rank's smoothing median")
    patience: int = _f(3, "consecutive measurements beyond the threshold before a straggler (or its "
                          "recovery) counts")
    weight_memory: float = _f(0.4, "load-score weight of memory pressure (tutorial: 0.4)")
    weight_compute: float = _f(0.4, "load-score weight of compute time per unit of work (tutorial: 0.4)")
    weight_network: float = _f(0.2, "load-score weight of communication wait (tutorial: 0.2)")


@dataclass
class Config:
    model: ModelConfig = _f(ModelConfig, "model shape")
    parallel: ParallelConfig = _f(ParallelConfig, "parallel layout")
    train: TrainConfig = _f(TrainConfig, "optimisation")
    data: DataConfig = _f(DataConfig, "corpus")
    checkpoint: CheckpointConfig = _f(CheckpointConfig, "sharded checkpoints and resume")
    resilience: ResilienceConfig = _f(ResilienceConfig, "hang detection, restarts, elastic re-plan")
    batching: BatchingConfig = _f(BatchingConfig, "microbatch policy")
    emulate: EmulateConfig = _f(EmulateConfig, "emulated slow devices and injected faults (testing and benchmarks only)")
    balance: BalanceConfig = _f(BalanceConfig, "dynamic load balancing (stage re-partition, uneven data-parallel split)")
    run_dir: str = _f("runs/latest", "directory for logs, metrics and checkpoints")
    trace: str | None = _f(None, "write a Chrome/Perfetto trace (one track per rank) of steps 2-4 to this file")

    def validate(self, world_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field (dotted key), its numbers and what would be right."""
        m, p, t, c = self.model, self.parallel, self.train, self.checkpoint
        # Ranges first: every later rule divides by or compares against these numbers.
        count, non_negative = (lambda v: _is_int(v) and v >= 1), (lambda v: _is_int(v) and v >= 0)
        ranges: list[tuple[str, typing.Callable[[Any], bool], str]] = [
            ("model.vocab_size model.dim model.n_layers model.n_heads model.ffn_dim parallel.tp parallel.pp "
             "parallel.dp parallel.virtual_stages train.steps train.global_batch train.microbatches "
             "train.seq_len train.val_batches data.max_bytes checkpoint.keep", count, "a positive integer"),
            ("resilience.max_restarts", non_negative, "a non-negative integer"),
            ("resilience.hang_timeout_s", lambda v: _is_num(v) and v >= 0, ">= 0 (0 disables the watchdog)"),
            ("resilience.heartbeat_s resilience.slow_phase_timeout_s", lambda v: _is_num(v) and v > 0, "> 0"),
            ("model.n_kv_heads", lambda v: v is None or count(v), "a positive integer or none"),
            ("batching.microbatch_size emulate.memory_limit", lambda v: v is None or count(v),
             "a positive integer or none"),
            ("batching.steps_per_candidate", count, "a positive integer"),
            ("batching.warmup_steps batching.cooldown_steps", non_negative, "a non-negative integer"),
            ("batching.memory_budget", lambda v: v is None or (_is_num(v) and v > 0),
             "> 0 (bytes if > 1, a fraction of device memory if <= 1) or none"),
            ("batching.switch_margin", lambda v: _is_num(v) and 0 <= v < 1, "in [0, 1)"),
            ("batching.drift_margin", lambda v: _is_num(v) and 0 < v < 1, "in (0, 1)"),
            ("train.warmup_steps train.val_every train.monitor_every train.sample_tokens parallel.recv_lookahead checkpoint.every",
             non_negative, "a non-negative integer"),
            ("train.lr train.eps parallel.timeout_s model.norm_eps model.init_std model.rope_theta",
             lambda v: _is_num(v) and v > 0, "> 0"),  # `v > 0` is False for NaN, so NaN is rejected too
            ("train.grad_clip", lambda v: _is_num(v) and v >= 0, ">= 0 (0 disables clipping)"),
            ("train.beta1 train.beta2", lambda v: _is_num(v) and 0 <= v < 1, "in [0, 1)"),
            ("data.val_fraction", lambda v: _is_num(v) and 0 < v < 0.5, "in (0, 0.5)"),
        ]
        for keys, ok, what in ranges:
            for key in keys.split():
                _require(ok(value := getattr(*_owner(self, key))), f"{key} must be {what}, got {value!r}")
        _require(isinstance(c.resume, str) and (c.resume in ("off", "auto") or os.path.isdir(c.resume)),
                 f"checkpoint.resume={c.resume!r} must be 'off', 'auto' or an existing checkpoint directory")
        _require(c.dir is None or isinstance(c.dir, str), f"checkpoint.dir must be a path or none, got {c.dir!r}")
        r = self.resilience
        _require(not r.hang_timeout_s or r.hang_timeout_s >= 2 * r.heartbeat_s,
                 f"resilience.hang_timeout_s={r.hang_timeout_s} must be at least twice resilience.heartbeat_s="
                 f"{r.heartbeat_s} (or 0 to disable the watchdog), or a healthy rank could look hung")
        _require(r.slow_phase_timeout_s >= r.hang_timeout_s, f"resilience.slow_phase_timeout_s="
                 f"{r.slow_phase_timeout_s} must be at least resilience.hang_timeout_s={r.hang_timeout_s}")
        _require(_is_num(t.min_lr) and 0 <= t.min_lr <= t.lr,
                 f"train.min_lr must be between 0 and train.lr={t.lr!r}, got {t.min_lr!r}")
        for key, f in _known_keys().items():
            choices = f.metadata.get("choices", ())
            if choices and (v := getattr(*_owner(self, key))) not in choices:
                raise ValueError(f"{key}={v!r} is not one of {', '.join(choices)}{_suggest(str(v), choices)}")
        self._validate_balance()

        if world_size is not None and p.world_size != world_size:
            raise ValueError(f"parallel.tp × parallel.pp × parallel.dp = {p.tp} × {p.pp} × {p.dp} = "
                             f"{p.world_size}, but {world_size} processes were started: "
                             f"start {p.world_size} processes or change the layout")

        _require(m.dim % m.n_heads == 0, f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}")
        _require(m.head_dim % 2 == 0, f"model.head_dim = model.dim // model.n_heads = {m.dim} // {m.n_heads} = "
                                      f"{m.head_dim} must be even for rotary embeddings (RoPE)")
        _require(m.n_heads % m.kv_heads == 0,
                 f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.kv_heads}")
        # Tensor parallelism shards heads, the FFN and the vocabulary evenly across tp ranks.
        for key, v in {"model.n_heads": m.n_heads, "model.n_kv_heads": m.kv_heads,
                       "model.ffn_dim": m.ffn_dim, "model.vocab_size": m.vocab_size}.items():
            _require(v % p.tp == 0, f"parallel.tp={p.tp} does not divide {key}={v}")

        _require(m.n_layers >= p.n_stages, f"model.n_layers={m.n_layers} is fewer than parallel.pp × "
                 f"parallel.virtual_stages = {p.pp} × {p.virtual_stages} = {p.n_stages} stages")
        _require(p.virtual_stages == 1 or p.schedule == "interleaved-1f1b",
                 f"parallel.virtual_stages={p.virtual_stages} needs parallel.schedule=interleaved-1f1b, "
                 f"got {p.schedule}; set parallel.virtual_stages=1 or switch the schedule")
        _require(p.schedule != "interleaved-1f1b" or p.pp >= 2,
                 f"parallel.schedule=interleaved-1f1b needs parallel.pp >= 2, got {p.pp}")
        # 1F1B's warmup fills the pipeline with one microbatch per rank before steady state.
        _require(p.schedule == "gpipe" or t.microbatches >= p.pp, f"parallel.schedule={p.schedule} needs "
                 f"train.microbatches ≥ parallel.pp={p.pp}, got {t.microbatches}")
        _require(p.schedule != "interleaved-1f1b" or t.microbatches % p.pp == 0,
                 f"parallel.schedule=interleaved-1f1b needs train.microbatches divisible by "
                 f"parallel.pp={p.pp}, got {t.microbatches}")

        _require(t.global_batch >= p.dp, f"train.global_batch={t.global_batch} is smaller than "
                 f"parallel.dp={p.dp}: every data-parallel replica needs at least one sample")
        per_replica = t.global_batch // p.dp  # the smallest replica's share; replicas differ by at most one
        over = f"(train.global_batch={t.global_batch} over parallel.dp={p.dp})"
        _require(t.microbatches <= per_replica, f"train.microbatches={t.microbatches} exceeds the "
                 f"{per_replica} samples per data-parallel replica {over}")
        if t.microbatch_sizes is not None:
            sizes = t.microbatch_sizes
            _require(t.global_batch % p.dp == 0, f"train.microbatch_sizes needs train.global_batch="
                     f"{t.global_batch} divisible by parallel.dp={p.dp} so every replica splits the same batch")
            _require(len(sizes) == t.microbatches, f"train.microbatch_sizes has {len(sizes)} entries "
                     f"but train.microbatches={t.microbatches}")
            for i, n in enumerate(sizes):
                _require(_is_int(n) and n >= 1, f"train.microbatch_sizes[{i}]={n!r} must be a positive integer")
            _require(sum(sizes) == per_replica, f"train.microbatch_sizes sums to {sum(sizes)}, but each "
                     f"data-parallel replica has {per_replica} samples {over}")

        b = self.batching
        if b.microbatch_size is not None:
            _require(b.policy == "fixed" and t.microbatch_sizes is None, "batching.microbatch_size is a fixed "
                     f"split: it needs batching.policy=fixed (got {b.policy!r}) and no train.microbatch_sizes")
            n, largest = self.microbatch_count(), -(-t.global_batch // p.dp)
            what = f"batching.microbatch_size={b.microbatch_size} cuts the {largest} samples per replica {over} " \
                   f"into {n} microbatches"
            _require(n <= per_replica, f"{what}, more than the smallest replica's {per_replica} samples")
            _require(p.schedule == "gpipe" or n >= p.pp, f"{what}; parallel.schedule={p.schedule} needs ≥ "
                     f"parallel.pp={p.pp}: use a size ≤ {largest // p.pp}")
            _require(p.schedule != "interleaved-1f1b" or n % p.pp == 0,
                     f"{what}; parallel.schedule=interleaved-1f1b needs a multiple of parallel.pp={p.pp}")
        _require(b.policy != "adaptive" or t.microbatch_sizes is None, "train.microbatch_sizes fixes the split, "
                 "but batching.policy=adaptive chooses it: drop one of them")
        _require(b.memory_budget is None or b.policy == "adaptive", f"batching.memory_budget={b.memory_budget} "
                 f"is used by batching.policy=adaptive only (got {b.policy!r})")

        if p.partition == "cost" or p.layer_costs is not None:
            _require(p.partition == "cost", f"parallel.layer_costs is set but parallel.partition="
                     f"{p.partition!r}: set parallel.partition=\"cost\" to use it, or drop layer_costs")
            _require(p.layer_costs is not None, f"parallel.partition='cost' needs parallel.layer_costs "
                     f"(one positive cost per layer, model.n_layers={m.n_layers})")
            costs: list[float] = p.layer_costs or []
            _require(len(costs) == m.n_layers, f"parallel.layer_costs has {len(costs)} entries "
                     f"but model.n_layers={m.n_layers}")
            for i, c in enumerate(costs):
                _require(_is_num(c) and c > 0, f"parallel.layer_costs[{i}]={c!r} must be > 0")

    def _validate_balance(self) -> None:
        b, p, t = self.balance, self.parallel, self.train
        _require(_is_num(self.emulate.layer_ms) and self.emulate.layer_ms >= 0,
                 f"emulate.layer_ms must be >= 0 (0 = off), got {self.emulate.layer_ms!r}")
        for key in ("interval", "window", "patience"):
            _require(_is_int(v := getattr(b, key)) and v >= 1, f"balance.{key} must be a positive integer, got {v!r}")
        _require(_is_int(b.skip_steps) and b.skip_steps >= 0,
                 f"balance.skip_steps must be a non-negative integer, got {b.skip_steps!r}")
        _require(_is_num(b.min_gain) and 0 <= b.min_gain < 1, f"balance.min_gain must be in [0, 1), got {b.min_gain!r}")
        _require(_is_num(b.threshold) and b.threshold > 1, f"balance.threshold must be > 1 (a ratio to the "
                 f"others' median time), got {b.threshold!r}")
        weights = (b.weight_memory, b.weight_compute, b.weight_network)
        for key, w in zip(("weight_memory", "weight_compute", "weight_network"), weights):
            _require(_is_num(w) and w >= 0, f"balance.{key} must be a number >= 0, got {w!r}")
        _require(sum(weights) > 0, f"balance.weight_memory + weight_compute + weight_network must be > 0, got {weights}")
        if b.mode == "off":
            return
        _require(p.pp == 1 or (p.schedule in ("gpipe", "1f1b") and p.virtual_stages == 1),
                 f"balance.mode={b.mode} re-partitions pipeline stages for parallel.schedule gpipe or 1f1b with "
                 f"one stage per rank, got {p.schedule} with virtual_stages={p.virtual_stages}")
        _require(p.dp == 1 or t.microbatch_sizes is None, f"balance.mode={b.mode} re-splits the batch among "
                 "data-parallel replicas, which fixed train.microbatch_sizes would contradict: drop them")
        # The adaptive planner sizes microbatches for an even replica share; an uneven one would escape
        # its memory model.
        _require(p.dp == 1 or self.batching.policy == "fixed", f"balance.mode={b.mode} with parallel.dp="
                 f"{p.dp} re-splits the batch among replicas and needs batching.policy=fixed, got "
                 f"{self.batching.policy!r}")

    def microbatch_count(self) -> int | None:
        """Microbatches per replica under the fixed policy (None: the adaptive policy chooses per step)."""
        if self.batching.policy == "adaptive":
            return None
        if self.batching.microbatch_size is None:
            return self.train.microbatches
        largest = -(-self.train.global_batch // self.parallel.dp)  # every replica runs the same count
        return -(-largest // self.batching.microbatch_size)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (JSON-serialisable); properties are derived, so they are left out."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        """Strict inverse of to_dict: missing keys keep defaults, unknown keys and wrong types raise."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a dict of sections, got {type(d).__name__}")
        cfg, known = cls(), _known_keys()
        sections = {f.name for f in fields(cls) if dataclasses.is_dataclass(f.type)}
        # Flatten to dotted keys so sections and top-level keys share one lookup and one error path.
        flat: list[tuple[str, Any]] = []
        for name, value in d.items():
            if name in sections:
                if not isinstance(value, dict):
                    raise ValueError(f"config section '{name}' must be a table of keys, got {value!r}")
                flat += [(f"{name}.{k}", v) for k, v in value.items()]
            else:
                flat.append((name, value))
        for key, value in flat:
            if key not in known:
                raise ValueError(f"unknown config key {key!r}{_suggest(key, [*sections, *known], repr)}")
            setattr(*_owner(cfg, key), _coerce(key, value, known[key].type))
        return cfg


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config ([model] [parallel] [train] [data] [checkpoint] sections, top-level run_dir) as a raw dict."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as e:  # missing file, a directory, no permission: all a bad --config argument
        raise ValueError(f"cannot read config file {path!r}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path!r} is not valid TOML: {e}") from None


def parse_args(argv: list[str]) -> Config:
    """Build a Config from `--config FILE` (applied first) then `--section.key VALUE` overrides in order.
    Does not validate: the caller knows the world size."""
    known = _known_keys()
    config_file: str | None = None
    overrides: list[tuple[str, str, str]] = []  # (flag as typed, dotted key, raw value)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ValueError(f"unexpected argument {arg!r}: options look like --section.key VALUE")
        name, has_eq, value = arg[2:].partition("=")
        if not has_eq:
            # A following flag is not a value: `--train.steps --train.lr 1` forgot the steps.
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ValueError(f"missing value for --{name}")
            value = argv[i + 1]
            i += 1
        i += 1
        key = name.replace("-", "_")  # --train.global-batch and --run-dir are spelled like the fields
        key = _ALIASES.get(key, key)
        if key == "config":
            if config_file is not None:
                raise ValueError(f"--config given twice ({config_file!r} and {value!r}); pass one file")
            config_file = value
        elif key in known:
            overrides.append((f"--{name}", key, value))
        else:
            raise ValueError(f"unknown option --{name}{_suggest(key, ['config', *known], _flag)}")
    cfg = Config.from_dict(load_toml(config_file)) if config_file is not None else Config()
    for flag, key, value in overrides:
        setattr(*_owner(cfg, key), _parse_text(flag, value, known[key].type))
    return cfg


_ALIASES = {"resume": "checkpoint.resume"}  # short flags for common dotted keys (flag -> key)


def help_text() -> str:
    """Every flag with its type, default and help, grouped by section."""
    rows = [(None, "--config <file>",
             "TOML file with [model] [parallel] [train] [data] [checkpoint] sections, applied first")]
    for key, f in _known_keys().items():
        extra = f"; one of {', '.join(f.metadata['choices'])}" if "choices" in f.metadata else ""
        rows.append((key.rpartition(".")[0] or None, f"{_flag(key)} <{_type_name(f.type)}>",
                     f"{f.metadata['help']} (default: {_format(f.default)}{extra})"))
    rows.sort(key=lambda r: r[0] is not None)  # stable: top-level flags (--run-dir) join --config up front
    width = max(len(usage) for _, usage, _ in rows) + 2
    lines = ["options: --section.key VALUE or --section.key=VALUE, applied after --config in order "
             "('-' and '_' are interchangeable)"]
    section = None
    for sec, usage, text in rows:
        if sec != section:
            section = sec
            lines += ["", f"[{sec}]"]
        lines.append(f"  {usage:<{width}}{text}")
    return "\n".join(lines)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_num(v: Any, kinds: tuple[type, ...] = (int, float)) -> bool:
    return isinstance(v, kinds) and not isinstance(v, bool)  # bool is an int subclass, but True is not a number


def _is_int(v: Any) -> bool:
    return _is_num(v, (int,))


def _known_keys() -> dict[str, dataclasses.Field]:
    """Every settable leaf: dotted key ('train.lr', or 'run_dir' at top level) -> field, in declaration order."""
    out: dict[str, dataclasses.Field] = {}
    for f in fields(Config):
        if dataclasses.is_dataclass(f.type):
            out.update({f"{f.name}.{g.name}": g for g in fields(f.type)})
        else:
            out[f.name] = f
    return out


def _owner(cfg: Config, key: str) -> tuple[Any, str]:
    """'train.lr' -> (cfg.train, 'lr'); 'run_dir' -> (cfg, 'run_dir'): the getattr/setattr target."""
    section, _, name = key.rpartition(".")
    return (getattr(cfg, section) if section else cfg), name


def _suggest(word: str, options: typing.Iterable[str], show: typing.Callable[[str], str] = repr) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {show(close[0])}?)" if close else ""


def _flag(key: str) -> str:
    # Top-level keys read like ordinary CLI flags (--run-dir); dotted keys keep the field spelling.
    return f"--{key}" if "." in key else f"--{key.replace('_', '-')}"


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None)), True
    return tp, False


def _type_name(tp: Any) -> str:
    base, optional = _unwrap(tp)
    name = f"list[{typing.get_args(base)[0].__name__}]" if typing.get_origin(base) is list else base.__name__
    return f"{name} or none" if optional else name


def _format(value: Any) -> str:
    """A default written the way parse_args reads it back (strings quoted to show spaces, e.g. 'def ')."""
    if value is None or isinstance(value, bool):
        return str(value).lower()
    return ",".join(map(str, value)) if isinstance(value, list) else repr(value)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Type-check a TOML/JSON value; ints widen to float, nothing else is converted."""
    base, optional = _unwrap(tp)
    if value is None and optional:
        return None
    if typing.get_origin(base) is list:
        if isinstance(value, list):
            elem = typing.get_args(base)[0]
            return [_coerce(f"{key}[{i}]", v, elem) for i, v in enumerate(value)]
    elif base is float and _is_int(value):
        return float(value)
    elif isinstance(value, base) and (base is bool or not isinstance(value, bool)):
        return value
    raise ValueError(f"config key {key!r} expects {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _parse_text(flag: str, text: str, tp: Any) -> Any:
    """Parse a command-line string by the field's type."""
    base, optional = _unwrap(tp)
    if optional and text.strip().lower() in ("none", "null"):
        return None
    try:
        if typing.get_origin(base) is list:
            elem = typing.get_args(base)[0]
            return [elem(s) for s in text.split(",")] if text.strip() else []
        if base is bool:
            words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
            return words[text.strip().lower()]
        return base(text)
    except (ValueError, KeyError):
        raise ValueError(f"{flag} expects {_type_name(tp)}, got {text!r}") from None
