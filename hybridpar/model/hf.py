"""Hugging Face Llama interop: `config.json` <-> `ModelConfig`, sharded loading of `*.safetensors`
(each rank opens the files lazily with `safe_open` and reads only its stage's tensors, and of a
tensor-parallel one only its slice), and export of a full state dict to `config.json` +
`model.safetensors` that `transformers.LlamaForCausalLM.from_pretrained` loads.

Parameter names are already the HF ones (`model.layers.3.mlp.up_proj.weight`), and the rotary layout
is HF's rotate-half, so no permutation is needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from hybridpar.config import ModelConfig
from hybridpar.model.llama import LlamaStage

# get(name, tp_dim, tp_rank, tp) -> this rank's slice of the full tensor `name`
TensorGetter = Callable[[str, "int | None", int, int], torch.Tensor]
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def config_from_hf(d: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """ModelConfig of an HF Llama config; refuses what our model does not implement."""
    arch = d.get("model_type")
    if arch != "llama":
        raise ValueError(f"{where}: model_type={arch!r} is not supported; only 'llama' checkpoints load")
    for key, ok, want in (("hidden_act", lambda v: v in (None, "silu"), "'silu'"),
                          ("rope_scaling", lambda v: not v, "null (no RoPE scaling)"),
                          ("attention_bias", lambda v: not v, "false"), ("mlp_bias", lambda v: not v, "false")):
        if not ok(d.get(key)):
            raise ValueError(f"{where}: {key}={d.get(key)!r} is not supported: it must be {want}")
    rope_type = (d.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"{where}: rope_parameters.rope_type={rope_type!r} is not supported: it must be 'default'")
    dim, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    if d.get("head_dim") not in (None, dim // heads):
        raise ValueError(f"{where}: head_dim={d['head_dim']} differs from hidden_size / num_attention_heads = "
                         f"{dim // heads}; only the standard head size is supported")
    rope = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    return ModelConfig(vocab_size=int(d["vocab_size"]), dim=dim, n_layers=int(d["num_hidden_layers"]), n_heads=heads,
                       n_kv_heads=int(d.get("num_key_value_heads") or heads), ffn_dim=int(d["intermediate_size"]),
                       rope_theta=float(rope), norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                       tie_embeddings=bool(d.get("tie_word_embeddings", False)))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            "max_position_embeddings": 4096, "torch_dtype": "float32"}


def read_hf_config(path: str | Path) -> ModelConfig:
    f = Path(path) / "config.json"
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read a Hugging Face config from {f}: {e}") from None
    return config_from_hf(d, str(f))


def slice_of(full_len: int, rank: int, n: int) -> slice:
    size = full_len // n
    return slice(rank * size, (rank + 1) * size)


class SafetensorsDir:
    """Lazy reader of a checkpoint directory's `*.safetensors` files: which file holds which tensor
    comes from the files' headers (or `model.safetensors.index.json`); data is read on request."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{self.path} holds no *.safetensors file")
        self._open = {f: safe_open(str(f), framework="pt", device="cpu") for f in files}
        self.where = {k: f for f, h in self._open.items() for k in h.keys()}

    def get(self, name: str, tp_dim: int | None, rank: int, n: int) -> torch.Tensor:
        if name not in self.where:
            raise ValueError(f"{self.path}: tensor {name!r} is missing from the checkpoint")
        sl = self._open[self.where[name]].get_slice(name)
        if tp_dim is None:
            return sl[:]
        shape = sl.get_shape()
        idx = [slice(None)] * len(shape)
        idx[tp_dim] = slice_of(shape[tp_dim], rank, n)
        return sl[tuple(idx)]  # only this rank's rows/columns are read from disk


def load_stage_(stage: LlamaStage, get: TensorGetter, tp_rank: int = 0, tp: int = 1) -> None:
    """Fill every parameter of a (possibly tp-sharded) stage from `get`, checking shapes."""
    with torch.no_grad():
        for name, p in stage.named_parameters():
            dim = getattr(p, "tp_dim", None)
            src = name
            if name == HEAD and stage.cfg.tie_embeddings:
                src = EMBED  # a tied head is the embedding (HF files often omit lm_head.weight then)
            t = get(src, dim, tp_rank, tp)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"tensor {src!r} has shape {tuple(t.shape)} in the checkpoint, the model "
                                 f"expects {tuple(p.shape)} for this rank (tp={tp}): the config does not match")
            p.copy_(t.to(p.dtype))


def getter_from_state(state: dict[str, torch.Tensor]) -> TensorGetter:
    """A TensorGetter over an in-memory full state dict (e.g. hybridpar's final_model.pt)."""
    def get(name: str, dim: int | None, rank: int, n: int) -> torch.Tensor:
        if name not in state:
            raise ValueError(f"tensor {name!r} is missing from the state dict")
        t = state[name]
        return t if dim is None else t[(slice(None),) * dim + (slice_of(t.shape[dim], rank, n),)]
    return get


def export_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path) -> Path:
    """Write `config.json` + `model.safetensors` (fp32) for a full state dict with HF names."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in state.items()}
    if cfg.tie_embeddings:
        tensors.pop(HEAD, None)  # stored once; transformers re-ties it from tie_word_embeddings
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=1) + "\n", encoding="utf-8")
    return out
