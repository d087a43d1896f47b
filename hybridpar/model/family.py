"""`Family`: one model family's entry in the registry (model/registry.py).

Everything family-specific sits behind it: the `Stage` subclass (parameter names, tied-embedding rule,
tensor-parallel plan, init, the forward that serves with a KV cache), and the Hugging Face format —
`config.json` <-> `ModelConfig`, and how the files' tensors map to our parameters, which may be laid
out differently (GPT-2's `Conv1D` stores weights transposed). Configuration validation reads the
family's rules as data from `config/families.py` (the config layer cannot import this one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from hybridpar.config import ModelConfig
from hybridpar.model.hf import TensorSource, read_local
from hybridpar.model.stage import Stage

# read_hf(source, name, tp_dim, tp_rank, tp, cfg) -> this rank's slice of our parameter `name`
HFReader = Callable[[TensorSource, str, "int | None", int, int, ModelConfig], torch.Tensor]
# to_hf(name, full tensor, cfg) -> the tensor as the Hugging Face file stores it
HFWriter = Callable[[str, torch.Tensor, ModelConfig], torch.Tensor]


def same_layout_reader(
    src: TensorSource, name: str, tp_dim: int | None, rank: int, n: int, cfg: ModelConfig
) -> torch.Tensor:
    """The file stores our parameter as it is: read this rank's slice."""
    return read_local(src, name, tp_dim, rank, n)


def same_layout_writer(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Family:
    name: str  # the value of model.family (a key of config/families.py FAMILIES)
    stage: type[Stage]
    hf_model_type: str  # config.json "model_type"
    config_from_hf: Callable[[dict[str, Any], str], ModelConfig]  # (config.json dict, where) -> ours
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    read_hf: HFReader = same_layout_reader
    to_hf: HFWriter = same_layout_writer


def refuse_unsupported(
    d: dict[str, Any], where: str, rules: tuple[tuple[str, Callable[[Any], bool], str], ...]
) -> None:
    """ValueError for the first (key, accepts, what it must be) of `rules` whose value `d` has is refused."""
    for key, ok, want in rules:
        if not ok(d.get(key)):
            raise ValueError(f"{where}: {key}={d.get(key)!r} is not supported: it must be {want}")
