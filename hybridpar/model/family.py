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


# config.json keys that do not change what the model computes: bookkeeping, generation defaults, the
# init of a fresh model (we load the weights), the cache switch.
BOOKKEEPING = frozenset(
    {
        "architectures",
        "model_type",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "_name_or_path",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "initializer_range",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
Rule = tuple[Callable[[Any], bool], str]  # (accepts the value, what it must be)


def check_hf_fields(d: dict[str, Any], where: str, family: str, rules: dict[str, Rule]) -> None:
    """ValueError naming every field of config.json `d` that the family does not implement: a key it
    does not know (neither in `rules` nor bookkeeping), or a value its rule refuses. All at once, so one
    look at the message says whether the model can load at all."""
    bad = [
        f"{k}={v!r} (must be {rules[k][1]})" if k in rules else f"{k}={v!r} (unknown to hybridpar's {family})"
        for k, v in d.items()
        if k not in BOOKKEEPING and not (k in rules and rules[k][0](v))
    ]
    if bad:
        raise ValueError(f"{where}: unsupported for model_type={d.get('model_type')!r}: {'; '.join(bad)}")
