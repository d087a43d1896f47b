"""Typed run configuration: dataclasses with help text, validation, TOML files and CLI overrides.

Pure Python on purpose (no torch import) so `hybridpar train --help` and config errors are instant,
and so every rank can validate the layout before touching a process group.

    sections.py  one dataclass per TOML table; each field carries its help (and choices) via `_f`
    config.py    Config: the sections plus top-level keys; strict dict round trip (from_dict/to_dict)
    validate.py  every rule Config.validate checks, in the order they run
    parse.py     load_toml, parse_args (--config then --section.key VALUE), help_text, to_toml
    keys.py      dotted keys ('train.lr') and field types, shared by the three above

A schedule is a name here: the schedule registry and its rules on a configuration live above config/,
in hybridpar/pipeline/schedules/ (config_rules.py), and the pre-flight check runs them.

What the rest of the package imports is re-exported here (`from hybridpar.config import Config`); the
other sections are read through `Config` or imported from `hybridpar.config.sections`.
"""

from hybridpar.config.config import Config
from hybridpar.config.parse import help_text, load_toml, parse_args, to_toml
from hybridpar.config.sections import BalanceConfig, ModelConfig, ParallelConfig, SinksConfig, TrainConfig
from hybridpar.config.validate import step_range

__all__ = [
    "BalanceConfig",
    "Config",
    "ModelConfig",
    "ParallelConfig",
    "SinksConfig",
    "TrainConfig",
    "help_text",
    "load_toml",
    "parse_args",
    "to_toml",
    "step_range",
]
