"""The model-family registry, and everything the rest of hybridpar asks of a model.

`FAMILIES` maps `model.family` to its `Family` (model/family.py). Callers outside `model/` use the
functions here and the `Stage` interface (model/stage.py) only: building a stage (initialised,
empty for loading, or one decoder layer for a live re-partition), parameter names and shapes, which
pipeline stage owns a parameter, parameter counts and FLOPs, loading a stage's tensors from a Hugging
Face directory or a state dict, and exporting a state dict as a Hugging Face directory.

Adding a family: one module defining its `Stage` subclass and `FAMILY`, one entry below, and one
`FamilyRules` row in config/families.py (what validation needs, as data).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.config import ModelConfig
from hybridpar.model import gpt2, llama
from hybridpar.model.family import Family
from hybridpar.model.hf import TensorSource, read_local
from hybridpar.model.stage import Stage
from hybridpar.model.tp import apply_tp

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, gpt2.FAMILY)}


def family(cfg: ModelConfig) -> Family:
    if cfg.family not in FAMILIES:
        raise ValueError(f"model.family={cfg.family!r} is not one of {', '.join(FAMILIES)}")
    return FAMILIES[cfg.family]


# -- building -------------------------------------------------------------------------------------------
def empty_stage(
    cfg: ModelConfig,
    layers: Sequence[int],
    first: bool,
    last: bool,
    device: torch.device,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    sp_backward: str = "saved",
) -> Stage:
    """A stage with uninitialised tensors on `device`, sharded over `tp_group` (and its activations over
    the sequence: model/tp.py): values are to be loaded. Built on the meta device first, so nothing is
    allocated twice."""
    with torch.device("meta"):
        stage = family(cfg).stage(cfg, layers, first, last)
    stage.to_empty(device=device)
    stage.tie_()  # to_empty keeps the tie, but be explicit about it
    return apply_tp(stage, tp_group, sequence_parallel, sp_backward)


def build_stage(
    cfg: ModelConfig,
    layers: Sequence[int],
    first: bool,
    last: bool,
    seed: int,
    device: torch.device,
    tp_group: dist.ProcessGroup | None = None,
    sequence_parallel: bool = False,
    sp_backward: str = "saved",
) -> Stage:
    """A stage initialised deterministically from `seed` (the same values in every layout), then sharded."""
    stage = empty_stage(cfg, layers, first, last, device)
    stage.init_(seed)
    return apply_tp(stage, tp_group, sequence_parallel, sp_backward)


def build_full_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> Stage:
    """The unsplit model: the single-device reference and the model used for generation."""
    return build_stage(cfg, range(cfg.n_layers), True, True, seed, torch.device(device))


def empty_layer(
    cfg: ModelConfig,
    i: int,
    device: torch.device,
    tp_group: dist.ProcessGroup | None,
    sequence_parallel: bool = False,
    sp_backward: str = "saved",
) -> nn.Module:
    """Decoder layer `i` alone, uninitialised, with this rank's tensor-parallel shard shapes and hooks."""
    return empty_stage(cfg, [i], False, False, device, tp_group, sequence_parallel, sp_backward).layers[str(i)]


# -- names, shapes, counts ---------------------------------------------------------------------------------
def full_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """{name: shape} of every parameter of the full model, in definition order (a tied head is the
    embedding and not listed)."""
    with torch.device("meta"):
        full = family(cfg).stage(cfg, range(cfg.n_layers), True, True)
    return {n: p.shape for n, p in full.named_parameters()}


def canonical_param_names(cfg: ModelConfig) -> list[str]:
    """Parameter names of the full model in definition order (the order of the params digest)."""
    return list(full_shapes(cfg))


def layer_of(cfg: ModelConfig, name: str) -> int | None:
    """The decoder layer a full-model parameter belongs to, None for the embedding, norm and head."""
    prefix = family(cfg).stage.LAYERS + "."
    return int(name[len(prefix) :].split(".")[0]) if name.startswith(prefix) else None


def param_stages(cfg: ModelConfig, parts: Sequence[range]) -> dict[str, int]:
    """{full-model parameter name: the pipeline stage holding it}, in definition order: a layer's stage;
    the embedding (and anything else read before the first layer) on the first, the final norm and
    head on the last."""
    with torch.device("meta"):
        first = {n for n, _ in family(cfg).stage(cfg, [], True, False).named_parameters()}
    out = {}
    for name in canonical_param_names(cfg):
        layer = layer_of(cfg, name)
        out[name] = (
            0
            if name in first
            else len(parts) - 1
            if layer is None
            else next(s for s, r in enumerate(parts) if layer in r)
        )
    return out


@dataclass(frozen=True)
class ParamCounts:
    embed: int  # parameters held by the first stage besides its layers
    layer: int  # parameters of one decoder layer (every layer has the same)
    head: int  # parameters held by the last stage besides its layers (a tied head is not counted)
    layer_matmul: int  # of `layer`, weights of linear layers: 2 x this is the layer's projection FLOPs per token


def param_counts(cfg: ModelConfig) -> ParamCounts:
    with torch.device("meta"):  # shapes only: nothing is allocated
        one = family(cfg).stage(cfg, [0], True, True)
        embed = sum(p.numel() for p in family(cfg).stage(cfg, [], True, False).parameters())
    layer = one.layers["0"]
    in_layer = sum(p.numel() for p in layer.parameters())
    matmul = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
    return ParamCounts(embed, in_layer, sum(p.numel() for p in one.parameters()) - embed - in_layer, matmul)


def layer_tensors(cfg: ModelConfig) -> int:
    """Parameter tensors of one decoder layer (what a per-tensor optimizer loop visits)."""
    with torch.device("meta"):
        return len(list(family(cfg).stage(cfg, [0], False, False).parameters()))


def layer_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward matmul FLOPs of one decoder layer per token at sequence length T: the projections
    (2 x weights) and attention's two T x d products per query (4 x T x d; the causal half not taken off)."""
    return 2.0 * param_counts(cfg).layer_matmul + 4.0 * seq_len * cfg.dim


# -- loading and export ----------------------------------------------------------------------------------
def load_stage_(stage: Stage, src: TensorSource, hf_layout: bool, tp_rank: int = 0, tp: int = 1) -> None:
    """Fill every parameter of a (possibly tp-sharded) stage from `src`, checking shapes. `hf_layout`:
    `src` holds a Hugging Face file's tensors (the family converts them), else our own (a state dict or
    checkpoint of ours)."""
    fam = family(stage.cfg)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            dim, src_name = getattr(p, "tp_dim", None), stage.stored_name(name)
            t = (
                fam.read_hf(src, src_name, dim, tp_rank, tp, stage.cfg)
                if hf_layout
                else read_local(src, src_name, dim, tp_rank, tp)
            )
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(
                    f"tensor {src_name!r} has shape {tuple(t.shape)} in the checkpoint, the model "
                    f"expects {tuple(p.shape)} for this rank (tp={tp}): the config does not match"
                )
            p.copy_(t.to(p.dtype))


class _Shapes:
    """A TensorSource giving meta tensors of the shapes a real read would return: loading through it
    checks names and shapes against the files' headers without reading any data."""

    def __init__(self, src: TensorSource) -> None:
        self.src = src

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        return torch.empty(self.src.shape(name), device="meta")[index]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.src.shape(name)


def check_hf_tensors(cfg: ModelConfig, src: TensorSource) -> None:
    """ValueError naming the first tensor of the full model that `src` (a Hugging Face directory's files)
    lacks or holds in another shape; reads headers only."""
    with torch.device("meta"):
        full = family(cfg).stage(cfg, range(cfg.n_layers), True, True)
    load_stage_(full, _Shapes(src), hf_layout=True)


def config_from_hf(d: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """ModelConfig of a Hugging Face config.json dict, by its model_type."""
    by_type = {f.hf_model_type: f for f in FAMILIES.values()}
    arch = d.get("model_type")
    if arch not in by_type:
        raise ValueError(f"{where}: model_type={arch!r} is not supported; these load: {', '.join(by_type)}")
    return by_type[arch].config_from_hf(d, where)


def read_hf_config(path: str | Path) -> ModelConfig:
    f = Path(path) / "config.json"
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read a Hugging Face config from {f}: {e}") from None
    return config_from_hf(d, str(f))


def export_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path) -> Path:
    """Write `config.json` + `model.safetensors` (fp32) for a full state dict of ours, which
    transformers' model class of the family (LlamaForCausalLM, GPT2LMHeadModel) loads."""
    from safetensors.torch import save_file

    fam = family(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: fam.to_hf(k, v.detach().float().cpu(), cfg).contiguous() for k, v in state.items()}
    if cfg.tied:
        tensors.pop(fam.stage.HEAD, None)  # stored once; transformers re-ties it from tie_word_embeddings
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(fam.config_to_hf(cfg), indent=1) + "\n", encoding="utf-8")
    return out
