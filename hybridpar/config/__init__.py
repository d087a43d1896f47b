"""Typed run configuration: dataclasses with help text, validation, TOML files and CLI overrides.

A package so that no file grows past the style limit; every public name is re-exported here, so
importers keep writing `from hybridpar.config import Config`.
"""

from hybridpar.config.config import (
    BalanceConfig,
    BatchingConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    EmulateConfig,
    ModelConfig,
    ParallelConfig,
    ResilienceConfig,
    TrainConfig,
    help_text,
    load_toml,
    parse_args,
)

__all__ = [
    "BalanceConfig",
    "BatchingConfig",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EmulateConfig",
    "ModelConfig",
    "ParallelConfig",
    "ResilienceConfig",
    "TrainConfig",
    "help_text",
    "load_toml",
    "parse_args",
]
