"""`Config`: the sections (sections.py) plus the top-level keys, validated as a whole (validate.py)
and round-tripped through plain dicts (TOML files, the launcher's hand-off to workers, checkpoints)."""

# No `from __future__ import annotations`: from_dict and keys.py read each field's `type` as a real type.
import dataclasses
import typing
from dataclasses import dataclass, fields
from typing import Any

from hybridpar.config.keys import RETIRED, _is_int, _known_keys, _owner, _suggest, _type_name, _unwrap
from hybridpar.config.sections import (
    BalanceConfig,
    BatchingConfig,
    CheckpointConfig,
    DataConfig,
    EmulateConfig,
    ModelConfig,
    ParallelConfig,
    ProfileConfig,
    ResilienceConfig,
    SinksConfig,
    TrainConfig,
    _f,
)
from hybridpar.config.validate import validate as _validate


@dataclass
class Config:
    model: ModelConfig = _f(ModelConfig, "model shape")
    parallel: ParallelConfig = _f(ParallelConfig, "parallel layout")
    train: TrainConfig = _f(TrainConfig, "optimisation")
    data: DataConfig = _f(DataConfig, "corpus")
    checkpoint: CheckpointConfig = _f(CheckpointConfig, "sharded checkpoints and resume")
    resilience: ResilienceConfig = _f(ResilienceConfig, "hang detection, restarts, elastic re-plan")
    batching: BatchingConfig = _f(BatchingConfig, "microbatch policy")
    emulate: EmulateConfig = _f(
        EmulateConfig, "emulated slow devices and injected faults (testing and benchmarks only)"
    )
    balance: BalanceConfig = _f(
        BalanceConfig, "dynamic load balancing (stage re-partition, uneven data-parallel split)"
    )
    sinks: SinksConfig = _f(SinksConfig, "where step records go besides metrics.jsonl (TensorBoard, W&B)")
    profile: ProfileConfig = _f(ProfileConfig, "torch.profiler and pipeline trace steps")
    run_dir: str = _f("runs/latest", "directory for logs, metrics and checkpoints")
    trace: str | None = _f(
        None, "write a Chrome/Perfetto trace (one track per rank) of the steps profile.trace_steps to this file"
    )

    def validate(self, world_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field (dotted key), its numbers and what would be right."""
        _validate(self, world_size)

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
    def from_dict(cls, d: dict[str, Any], record: bool = False) -> "Config":
        """Strict inverse of to_dict: missing keys keep defaults, unknown keys and wrong types raise. A key
        this version no longer has (keys.RETIRED) raises its line, or is dropped where `record` says `d` is
        what a run wrote (config.toml, trainer_state.json): a record of an older version, not a request."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a dict of sections, got {type(d).__name__}")
        cfg, known = cls(), _known_keys(Config)
        sections = {f.name for f in fields(cls) if dataclasses.is_dataclass(f.type)}
        # Every bad key is reported at once: a file with three typos is fixed in one edit, not three runs.
        errors: list[str] = []
        # Flatten to dotted keys so sections and top-level keys share one lookup and one error path.
        flat: list[tuple[str, Any]] = []
        for name, value in d.items():
            if name in sections:
                if not isinstance(value, dict):
                    errors.append(f"config section '{name}' must be a table of keys, got {value!r}")
                    continue
                flat += [(f"{name}.{k}", v) for k, v in value.items()]
            else:
                flat.append((name, value))
        for key, value in flat:
            if key in RETIRED:
                errors += [] if record else [RETIRED[key]]
                continue
            if key not in known:
                errors.append(f"unknown config key {key!r}{_suggest(key, [*sections, *known], repr)}")
                continue
            try:
                setattr(*_owner(cfg, key), _coerce(key, value, known[key].type))
            except ValueError as e:
                errors.append(str(e))
        if errors:
            raise ValueError("; ".join(errors))
        return cfg


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
    raise ValueError(
        f"config key {key!r} expects {_type_name(tp)}, got {value!r} ({type(value).__name__}){_toml_hint(value, tp)}"
    )


def _toml_hint(value: Any, tp: Any) -> str:
    """The TOML spelling of what the command line writes as text (a file holding it as a string is the
    likely mistake): TOML has no null (a key left out is none) and writes lists in brackets."""
    base, optional = _unwrap(tp)
    if not isinstance(value, str):
        return ""
    if optional and value.strip().lower() in ("none", "null"):
        return ": TOML has no none; leave the key out to keep it unset"
    if typing.get_origin(base) is list:
        return f": a TOML list is written in brackets, e.g. [{', '.join(v.strip() for v in value.split(','))}]"
    if base is bool and value.strip().lower() in ("true", "false"):
        return f": write {value.strip().lower()} without quotes"
    if base in (int, float):
        try:
            base(value)
        except ValueError:
            return ""
        return f": write {value.strip()} without quotes"
    return ""
