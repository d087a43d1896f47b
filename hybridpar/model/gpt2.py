"""The GPT-2 family (Radford et al. 2019): learned absolute positions, pre-LayerNorm blocks with biases,
a GELU MLP (tanh approximation, HF's "gelu_new"), biases on every projection, and a head tied to the
token embedding — with the parameter names of Hugging Face's `GPT2LMHeadModel`
(`transformer.h.3.attn.c_attn.weight`; transformers/models/gpt2/modeling_gpt2.py). No dropout: training
is deterministic, so every layout can be compared with one device.

Two layouts differ from the Hugging Face files, and are converted when reading and writing them:
- HF's `Conv1D` stores a weight as (in, out); ours are `nn.Linear`s, (out, in), so tensor parallelism,
  the zero-bubble weight-gradient split and everything else treat them like any linear layer.
- HF's fused q/k/v projection `c_attn` has output columns [q | k | v], each ordered by head. Ours are
  ordered by head first, each head's q, k and v together (Megatron-LM's `query_key_value` layout,
  (heads, 3, head_dim)), so a tensor-parallel rank's heads are one contiguous block of rows and the
  projection is an ordinary column-parallel layer whose checkpoint shards reshard like any other.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.config import ModelConfig
from hybridpar.model.family import Family, check_hf_fields
from hybridpar.model.hf import TensorSource, read_local, shard_rows
from hybridpar.model.kvcache import KVStep, LayerKV, attend
from hybridpar.model.regather import block_saves, saving
from hybridpar.model.stage import Stage

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
QKV = ("attn.c_attn.weight", "attn.c_attn.bias")


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm, whose output the blocks that read it may remake in the backward (model/regather.py):
    the same kernel on the same input (which layer_norm keeps anyway), so the same bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if y.grad_fn is not None:
            xd, w, b, eps = x.detach(), self.weight, self.bias, self.eps
            y.grad_fn.metadata["remake"] = lambda node: F.layer_norm(xd, xd.shape[-1:], w.detach(), b.detach(), eps)
        return y


class GPT2Attention(nn.Module):
    # Its saved-tensor hooks (model/regather.py, installed by tp.install_saves) rebuild c_attn's input from ln_1.
    rebuilds_saved = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.c_attn = nn.Linear(cfg.dim, 3 * cfg.dim)  # rows (heads, q|k|v, head_dim): see the module doc
        self.c_proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        with saving(self, x):  # the sequence-parallel re-gather of c_attn's input (model/regather.py)
            return self._forward(x, kv)

    def _forward(self, x: torch.Tensor, kv: LayerKV | None) -> torch.Tensor:
        B, T, _ = x.shape
        saves = block_saves(self)
        x = x if saves is None else saves.note(x)
        # -1 heads: under tensor parallelism each rank holds n_heads/tp of them.
        qkv = self.c_attn(x).view(B, T, -1, 3, self.head_dim)  # (B, T, h, 3, hd)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (B, h, T, hd)
        y = attend(q, k, v, kv)  # scaled by 1/sqrt(hd), as GPT-2's scale_attn_weights
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class GPT2MLP(nn.Module):
    # Its saved-tensor hooks rebuild c_fc's input from ln_2 and c_proj's from c_fc's output.
    rebuilds_saved = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.dim, cfg.ffn_dim)
        self.c_proj = nn.Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with saving(self, x):  # as GPT2Attention's, for c_fc
            saves = block_saves(self)
            x = x if saves is None else saves.note(x)
            fc = self.c_fc(x)
            h = F.gelu(fc, approximate="tanh")  # (B, T, ffn)
            if saves is not None:  # c_proj's input, remade from c_fc's output (which gelu keeps)
                fcd = fc.detach()
                saves.rebuilt(h, lambda: F.gelu(fcd, approximate="tanh"))
            return self.c_proj(h)


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv)
        return x + self.mlp(self.ln_2(x))


class _Body(nn.Module):
    """Holds what HF calls `transformer.*` so that names match `GPT2LMHeadModel`."""


class GPT2Stage(Stage):
    EMBED, HEAD, LAYERS = "transformer.wte.weight", "lm_head.weight", "transformer.h"
    # c_attn and c_fc split by output (heads, FFN width) with their biases; c_proj split by input, its
    # bias replicated and added once after the sum (model/tp.py). Positions and LayerNorms replicated.
    TP_PLAN = {
        "transformer.wte": "vocab",
        "transformer.h.*.attn": "copy_in",
        "transformer.h.*.attn.c_attn": "colwise",
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp": "copy_in",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "colwise_gather",
    }

    def __init__(self, cfg: ModelConfig, layers: Sequence[int], first: bool, last: bool) -> None:
        super().__init__(cfg, layers, first, last)
        self.transformer = _Body()
        if first:
            self.transformer.wte = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.transformer.wpe = nn.Embedding(cfg.max_positions, cfg.dim)
        self.transformer.h = nn.ModuleDict({str(i): GPT2Block(cfg) for i in self.layer_ids})
        if last:
            self.transformer.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_()

    def init_rule(self, name: str) -> tuple[str, float]:
        # GPT2PreTrainedModel._init_weights: LayerNorms 1 and 0, biases 0, weights N(0, 0.02), the two
        # residual-branch outputs (c_proj) scaled by 1/sqrt(2 x layers).
        if name.rsplit(".", 2)[-2].startswith("ln_"):
            return "fill", 1.0 if name.endswith("weight") else 0.0
        if name.endswith(".bias"):
            return "fill", 0.0
        if name.endswith("c_proj.weight"):
            return "normal", self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        return "normal", self.cfg.init_std

    def kv_heads(self) -> int:
        return next(iter(self.layers.values())).attn.c_attn.weight.shape[0] // (3 * self.cfg.head_dim)

    def forward(self, x: torch.Tensor, kv: KVStep | None = None) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device) if kv is None else kv.positions  # (T,) | (B, T)
            # (B, T, d); sequence-parallel: this rank's slice of the sequence, with its positions only
            h = self.transformer.wte(x) + self.transformer.wpe(self.seq_slice(pos, -1))
        else:
            h = x
        for lid, block in self.transformer.h.items():
            h = self.run_layer(block, h, None if kv is None else kv.layer(lid))
        if not self.last:
            return h
        if kv is not None:
            h = kv.last_tokens(h)  # (B, 1, d): only the next token's logits are needed
        return self.lm_head(self.transformer.ln_f(h))  # (B, T, vocab)


def read_hf(src: TensorSource, name: str, tp_dim: int | None, rank: int, n: int, cfg: ModelConfig) -> torch.Tensor:
    """This rank's slice of our parameter `name`, from a GPT2LMHeadModel file."""
    if name.endswith(QKV):  # this rank's heads of each of q, k, v, interleaved by head
        d, hd = cfg.dim, cfg.head_dim
        heads = shard_rows(cfg.n_heads, rank, n) if tp_dim is not None else slice(0, cfg.n_heads)
        lead = (slice(None),) if name.endswith("weight") else ()
        parts = [src.read(name, lead + (slice(j * d + heads.start * hd, j * d + heads.stop * hd),)) for j in range(3)]
        t = torch.stack([p.unflatten(-1, (-1, hd)) for p in parts], dim=-2).flatten(-3)  # (d, h*3*hd) | (h*3*hd,)
        return t.t() if name.endswith("weight") else t
    if name.endswith(CONV1D):  # stored (in, out): our dimension k is the file's 1 - k
        return read_local(src, name, None if tp_dim is None else 1 - tp_dim, rank, n).t()
    return read_local(src, name, tp_dim, rank, n)


def to_hf(name: str, t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Our full tensor `name` as GPT2LMHeadModel stores it."""
    if name.endswith(QKV):  # (h, 3, hd, ...) -> (3, h, hd, ...)
        t = t.unflatten(0, (-1, 3, cfg.head_dim)).transpose(0, 1).flatten(0, 2)
    return t.t() if name.endswith(CONV1D) else t


SUMMARY_KEYS = (
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
)


def config_from_hf(d: dict[str, Any], where: str) -> ModelConfig:
    """ModelConfig of an HF GPT-2 config; every field our model does not implement is refused by name.
    Dropout rates are accepted and not applied: serving never drops out, and training from GPT-2
    weights here trains without dropout."""
    count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
    check_hf_fields(
        d,
        where,
        "gpt2",
        {
            **{k: (count, "a positive integer") for k in ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions")},
            "n_ctx": (lambda v: v is None or v == d.get("n_positions", 1024), "n_positions"),
            "n_inner": (lambda v: v is None or count(v), "a positive integer or null"),
            "activation_function": (lambda v: v in (None, "gelu_new", "gelu_pytorch_tanh"), "'gelu_new' (tanh GELU)"),
            "layer_norm_epsilon": (lambda v: isinstance(v, (int, float)) and v > 0, "a positive number"),
            "tie_word_embeddings": (lambda v: isinstance(v, bool), "true or false"),
            "scale_attn_weights": (lambda v: v in (None, True), "true"),
            "scale_attn_by_inverse_layer_idx": (lambda v: not v, "false"),
            "reorder_and_upcast_attn": (lambda v: not v, "false"),
            "add_cross_attention": (lambda v: not v, "false"),
            **{k: (lambda v: True, "") for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")},
            # The sequence-classification head's settings: GPT2LMHeadModel has no such head.
            **{k: (lambda v: True, "") for k in SUMMARY_KEYS},
        },
    )
    dim = int(d.get("n_embd", d.get("hidden_size", 768)))
    return ModelConfig(
        family="gpt2",
        vocab_size=int(d.get("vocab_size", 50257)),
        dim=dim,
        n_layers=int(d.get("n_layer", 12)),
        n_heads=int(d.get("n_head", 12)),
        ffn_dim=int(d.get("n_inner") or 4 * dim),
        n_positions=int(d.get("n_positions", 1024)),
        norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(d.get("tie_word_embeddings", True)),
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    # Dropout 0: the model was trained without it (HF's default is 0.1).
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.dim,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.ffn_dim,
        "n_positions": cfg.max_positions,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": cfg.tied,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "torch_dtype": "float32",
    }


FAMILY = Family("gpt2", GPT2Stage, "gpt2", config_from_hf, config_to_hf, read_hf, to_hf)
