"""Llama-architecture decoder, parallel-agnostic, with Hugging Face parameter names.

A `LlamaStage` is any contiguous slice of the model: the embedding (first slice), a run of decoder
layers and the final norm + head (last slice). The whole model is simply the slice holding everything,
so single-device training, every pipeline stage and the reference in the tests run one code path.
Layers are kept in a `ModuleDict` keyed by their global index so that parameter names
(`model.layers.7.mlp.up_proj.weight`) are the Hugging Face names whatever the split.

Initialisation is seeded per parameter *name* (not by construction order), so a stage built alone
holds bit-for-bit the same values as the same layers inside the full model: the same seed gives the
same full model under every (tp, pp, dp) layout.
"""

from __future__ import annotations

import math
import zlib
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.config import ModelConfig


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads/tp query and kv_heads/tp kv heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, h, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, kv, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if k.shape[1] != q.shape[1]:  # grouped-query attention: share each kv head among its query group
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h, T, hd)
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """Holds what HF calls `model.*` so that names match `LlamaForCausalLM`."""


class LlamaStage(nn.Module):
    """Layers `layers` of the model, plus the embedding if `first` and the final norm and head if `last`.

    Input: token ids (B, T) on the first stage, hidden states (B, T, d) elsewhere.
    Output: logits (B, T, vocab) on the last stage, hidden states (B, T, d) elsewhere.
    """

    def __init__(self, cfg: ModelConfig, layers: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.first, self.last = first, last
        self.layer_ids = list(layers)
        self.model = _Body()
        if first:
            self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.model.layers = nn.ModuleDict({str(i): DecoderLayer(cfg) for i in self.layer_ids})
        if last:
            self.model.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            if cfg.tie_embeddings and first:
                self.lm_head.weight = self.model.embed_tokens.weight
        self._rope: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def holds_tied_copy(self) -> bool:
        """True when this stage's head is a separate copy of the embedding tied across pipeline stages
        (its gradient must be summed with the first stage's)."""
        return self.cfg.tie_embeddings and self.last and not self.first

    def _tables(self, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (T, device)
        if key not in self._rope:
            self._rope[key] = rope_tables(T, self.cfg.head_dim, self.cfg.rope_theta, device)
        return self._rope[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x  # (B, T, d)
        cos, sin = self._tables(h.shape[1], h.device)
        for layer in self.model.layers.values():
            h = layer(h, cos, sin)
        if self.last:
            h = self.lm_head(self.model.norm(h))  # (B, T, vocab)
        return h


def init_seed(seed: int, name: str) -> int:
    """Seed of one parameter: depends only on the run seed and the parameter's global name."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_stage_(stage: LlamaStage, seed: int) -> None:
    """Initialise every parameter from (seed, name) on the CPU, then copy to its device, so values do
    not depend on the layout, the device or the order modules were built in."""
    cfg = stage.cfg
    # Scaled init of residual-branch outputs (GPT-2 / Megatron): keeps the residual stream's variance
    # independent of depth.
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
                continue
            # A head tied across stages starts as an exact copy of the embedding.
            key = "model.embed_tokens.weight" if (name == "lm_head.weight" and cfg.tie_embeddings) else name
            std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else cfg.init_std
            g = torch.Generator().manual_seed(init_seed(seed, key))
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g))


def build_stage(
    cfg: ModelConfig, layers: Sequence[int], first: bool, last: bool, seed: int, device: torch.device
) -> LlamaStage:
    """Construct on the meta device (no memory), materialise on `device`, initialise deterministically."""
    with torch.device("meta"):
        stage = LlamaStage(cfg, layers, first, last)
    stage.to_empty(device=device)
    if cfg.tie_embeddings and first and last:  # to_empty keeps the tie, but be explicit about it
        stage.lm_head.weight = stage.model.embed_tokens.weight
    init_stage_(stage, seed)
    return stage


def build_full_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> LlamaStage:
    """The unsplit model: the single-device reference and the model used for generation."""
    return build_stage(cfg, range(cfg.n_layers), True, True, seed, torch.device(device))


def canonical_param_names(cfg: ModelConfig) -> list[str]:
    """Parameter names of the full model in definition order (the order of the params digest)."""
    with torch.device("meta"):
        full = LlamaStage(cfg, range(cfg.n_layers), True, True)
    return [n for n, _ in full.named_parameters()]


@torch.no_grad()
def generate(model: LlamaStage, prompt: list[int], n_tokens: int, temperature: float = 0.8,
             top_k: int = 0, seed: int = 0) -> list[int]:
    """Sample `n_tokens` after `prompt` with the full model (no KV cache: this is the end-of-training
    demo; serving has its own engine). Greedy when temperature == 0."""
    device = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(n_tokens):
        logits = model(ids)[0, -1].float().cpu()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    return out
