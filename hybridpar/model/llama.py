"""The Llama family: RMSNorm, rotary positions (RoPE), SwiGLU MLP, optional grouped-query attention,
no biases, optionally tied embeddings — with the parameter names of Hugging Face's `LlamaForCausalLM`
(`model.layers.7.mlp.up_proj.weight`) and its rotate-half rotary layout, so its checkpoints load as
they are (transformers/models/llama/modeling_llama.py).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.config import ModelConfig
from hybridpar.model.family import Family, refuse_unsupported
from hybridpar.model.kvcache import KVStep, LayerKV, attend
from hybridpar.model.stage import Stage


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as HF Llama does, so low-precision runs keep the same statistics.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (T, head_dim) in HF's "rotate_half" layout (frequencies repeated, not interleaved),
    which is the layout of every HF Llama checkpoint's q/k projections."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads/tp query and kv_heads/tp kv heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, h, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, kv, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = attend(q, k, v, kv)  # (B, h, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """Holds what HF calls `model.*` so that names match `LlamaForCausalLM`."""


class LlamaStage(Stage):
    EMBED, HEAD, LAYERS = "model.embed_tokens.weight", "lm_head.weight", "model.layers"
    # Megatron-LM layout (Shoeybi et al. 2019): heads and FFN width split, o/down projections summed.
    TP_PLAN = {
        "model.embed_tokens": "vocab",
        "model.layers.*.self_attn": "copy_in",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp": "copy_in",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "colwise_gather",
    }

    def __init__(self, cfg: ModelConfig, layers: Sequence[int], first: bool, last: bool) -> None:
        super().__init__(cfg, layers, first, last)
        self.model = _Body()
        if first:
            self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.model.layers = nn.ModuleDict({str(i): DecoderLayer(cfg) for i in self.layer_ids})
        if last:
            self.model.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_()
        self._rope: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def init_rule(self, name: str) -> tuple[str, float]:
        if name.endswith(("norm.weight", "layernorm.weight")):
            return "fill", 1.0
        # Scaled init of residual-branch outputs (GPT-2 / Megatron): keeps the residual stream's variance
        # independent of depth.
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return "normal", self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        return "normal", self.cfg.init_std

    def kv_heads(self) -> int:
        return next(iter(self.layers.values())).self_attn.k_proj.weight.shape[0] // self.cfg.head_dim

    def _tables(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of at least n positions (row t does not depend on the table's length)."""
        if device not in self._rope or self._rope[device][0].shape[0] < n:
            self._rope[device] = rope_tables(n, self.cfg.head_dim, self.cfg.rope_theta, device)
        return self._rope[device]

    def forward(self, x: torch.Tensor, kv: KVStep | None = None) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x  # (B, T, d)
        T = h.shape[1]
        if kv is None:
            cos, sin = (t[:T] for t in self._tables(T, h.device))  # (T, hd)
        else:  # each row at its own positions
            cos, sin = (t[kv.positions].unsqueeze(1) for t in self._tables(kv.max_len, h.device))  # (B, 1, T, hd)
        for lid, layer in self.model.layers.items():
            h = self.run_layer(layer, h, cos, sin, None if kv is None else kv.layer(lid))
        if not self.last:
            return h
        if kv is not None:
            h = kv.last_tokens(h)  # (B, 1, d): only the next token's logits are needed
        return self.lm_head(self.model.norm(h))  # (B, T, vocab)


def config_from_hf(d: dict[str, Any], where: str) -> ModelConfig:
    """ModelConfig of an HF Llama config; refuses what our model does not implement."""
    refuse_unsupported(
        d,
        where,
        (
            ("hidden_act", lambda v: v in (None, "silu"), "'silu'"),
            ("rope_scaling", lambda v: not v, "null (no RoPE scaling)"),
            ("attention_bias", lambda v: not v, "false"),
            ("mlp_bias", lambda v: not v, "false"),
        ),
    )
    rope_type = (d.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"{where}: rope_parameters.rope_type={rope_type!r} is not supported: it must be 'default'")
    dim, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    if d.get("head_dim") not in (None, dim // heads):
        raise ValueError(
            f"{where}: head_dim={d['head_dim']} differs from hidden_size / num_attention_heads = "
            f"{dim // heads}; only the standard head size is supported"
        )
    rope = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    return ModelConfig(
        family="llama",
        vocab_size=int(d["vocab_size"]),
        dim=dim,
        n_layers=int(d["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=int(d.get("num_key_value_heads") or heads),
        ffn_dim=int(d["intermediate_size"]),
        rope_theta=float(rope),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tied,
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }


FAMILY = Family("llama", LlamaStage, "llama", config_from_hf, config_to_hf)
