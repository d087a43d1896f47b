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
from hybridpar.model.family import Family, check_hf_fields
from hybridpar.model.kvcache import KVStep, LayerKV, attend
from hybridpar.model.regather import block_saves, saving
from hybridpar.model.stage import Stage


class _RMSNorm(torch.autograd.Function):
    """weight * (x * rsqrt(mean(x^2) + eps)), saving x and the rsqrt only: autograd would also keep the
    normalised x (for the weight's gradient), a second (B, T, d) fp32 tensor that x and the rsqrt give
    back with one multiply (fused norms such as Apex's keep input and inverse rms alone). The backward
    is autograd's own chain of formulas (derivatives.yaml: mul, rsqrt, mean, pow), op for op, on the same
    tensors. x comes in twice (`x`, `x2`: a view of it) so that its two gradient terms, the product's
    and the square's, reach x's other uses (the residual add) one after the other, as autograd sums them:
    floating-point addition is not associative, and this keeps the gradients bit-identical. The output
    can be remade from what is saved (`remake`: the same ops on the same tensors), so the layers that read
    it need not keep it (model/regather.py)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()  # normalise in fp32 as HF Llama does, so low-precision runs keep the same statistics
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, r, weight)  # the weight: a parameter, resident anyway
        if not torch.compiler.is_compiling():
            # For the blocks that read the output (model/regather.py), which never rebuild inside a compiled
            # layer (block_saves). torch 2.11's dynamo cannot trace the write (an InternalTorchDynamoError
            # about a deallocated PyNode): train.compile failed there, on the GPU image's torch.
            ctx.metadata["remake"] = _RMSNorm.remake
        return weight * (h * r).to(x.dtype)

    @staticmethod
    def remake(ctx: Any) -> torch.Tensor:
        """The forward's output again, bit for bit, from the saved input and 1/rms (before this node's backward)."""
        x, r, weight = ctx.saved_tensors
        return weight.detach() * (x.detach().float() * r).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, r, weight = ctx.saved_tensors
        h = x.float()
        gw = (g * (h * r).to(x.dtype)).sum_to_size(weight.shape) if ctx.needs_input_grad[2] else None
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, gw, None
        gn = (g * weight).to(h.dtype)  # through the cast to x's dtype
        gr = (gn * h).sum_to_size(r.shape)  # mul's gradient for the broadcast rsqrt
        gm = -0.5 * gr * r.pow(3)  # rsqrt's
        gp = gm.expand(h.shape) / h.shape[-1]  # mean's
        g_mul, g_pow = gn * r, gp * (2.0 * h.pow(1.0))  # the product's for x, the square's
        if x.dtype != h.dtype:  # x.float() was a cast: autograd sums both terms before casting back
            return (g_mul + g_pow).to(x.dtype), None, gw, None
        return g_mul, g_pow, gw, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, x.view_as(x), self.weight, self.eps)  # two tensors: dynamo refuses one twice


def inv_freq(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """Rotary frequencies (head_dim / 2,), with Llama 3.1's scaling when model.rope_scaling is 'llama3'
    (Meta's llama-models `apply_scaling`; transformers' rope_type "llama3")."""
    hd = cfg.head_dim
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
    if cfg.rope_scaling == "none":
        return freq
    old, low, high = cfg.rope_original_max_positions, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / freq
    # Long wavelengths (beyond the original context / low) are stretched by the factor, short ones (below
    # the original context / high) kept; in between, a linear blend by where the wavelength falls.
    stretched = torch.where(wavelen > old / low, freq / cfg.rope_factor, freq)
    blend = (old / wavelen - low) / (high - low)
    smooth = (1 - blend) * stretched / cfg.rope_factor + blend * stretched
    between = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(between, smooth, stretched)


def rope_tables(seq_len: int, cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (T, head_dim) in HF's "rotate_half" layout (frequencies repeated, not interleaved),
    which is the layout of every HF Llama checkpoint's q/k projections."""
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq(cfg, device))
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class _SharedCast(torch.autograd.Function):
    """One consumer's handle on a low-precision copy made once: forward hands out the copy itself (a view,
    no new storage), backward widens this consumer's gradient to the input's dtype, as autocast's own cast
    would. Each consumer having its own node keeps the consumers' gradients summed in fp32 at the input, in
    the order autocast's per-consumer casts sum them: bit-identical to casting once per consumer."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        ctx.dtype = x.dtype
        return low.view_as(low)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g.to(ctx.dtype), None


def shared_casts(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """`x` for `n` projections that read it (q, k, v; gate, up). Under autocast each projection would cast
    the fp32 norm output to bf16 on its own, and save its own copy for backward (under sequence
    parallelism, of the whole gathered sequence): here it is cast once and the projections save that
    one tensor (Korthikanti et al. 2022 count the shared input once). Elsewhere: x itself."""
    dev = x.device.type
    if x.dtype != torch.float32 or not torch.is_autocast_enabled(dev):
        return [x] * n
    low = x.detach().to(torch.get_autocast_dtype(dev))
    return [_SharedCast.apply(x, low) for _ in range(n)]


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up, saving gate and up only: autograd would also keep silu(gate) for the product's
    backward, a fourth (B, T, ffn) tensor it can recompute from gate (Megatron's fused SwiGLU keeps its
    input alone). The backward runs autograd's own formulas on the same tensors (the product's, then
    aten.silu_backward), so gradients are bit-identical."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(g * up, gate), g * F.silu(gate)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    # Its saved-tensor hooks (model/regather.py, `saves`, installed by tp.install_saves) rebuild the projections'
    # input from the norm and keep one head of each group of the repeated k, v.
    rebuilds_saved = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | None = None) -> torch.Tensor:
        with saving(self, x):
            return self._forward(x, cos, sin, kv)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | None) -> torch.Tensor:
        B, T, _ = x.shape
        saves = block_saves(self)
        # -1 heads: under tensor parallelism each rank holds n_heads/tp query and kv_heads/tp kv heads.
        xq, xk, xv = shared_casts(x, 3)
        if saves is not None:  # what q, k, v read: re-gathered or remade from the norm in the backward
            saves.note(xq)
        q = self.q_proj(xq).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, h, T, hd)
        k = self.k_proj(xk).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, kv, T, hd)
        v = self.v_proj(xv).view(B, T, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = attend(q, k, v, kv, saves)  # (B, h, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    # Its saved-tensor hooks (as Attention's) rebuild the projections' input and the down projection's.
    rebuilds_saved = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with saving(self, x):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        saves = block_saves(self)
        xg, xu = shared_casts(x, 2)
        if saves is not None:  # what gate and up read, as Attention's q, k, v
            saves.note(xg)
        gate, up = self.gate_proj(xg), self.up_proj(xu)
        h = _SwiGLU.apply(gate, up)  # (B, T, ffn)
        if saves is not None:  # the down projection's input, remade from gate and up (which SwiGLU keeps)
            g, u = gate.detach(), up.detach()
            saves.rebuilt(h, lambda: F.silu(g) * u)
        return self.down_proj(h)


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
            self._rope[device] = rope_tables(n, self.cfg, device)
        return self._rope[device]

    def forward(self, x: torch.Tensor, kv: KVStep | None = None) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x  # (B, T, d); (B, T/tp, d) sequence-parallel
        T = h.shape[1] * self.seq_shards  # attention sees the whole sequence (model/tp.py)
        if kv is None:
            cos, sin = (t[:T] for t in self._tables(T, h.device))  # (T, hd)
        else:  # each row at its own positions
            cos, sin = (t[kv.positions].unsqueeze(1) for t in self._tables(kv.max_len, h.device))  # (B, 1, T, hd)
        # A model cast to bf16 (serving) rotates in bf16, as Hugging Face's Llama does; under autocast the
        # residual stream, and so the tables, stay fp32.
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        for lid, layer in self.model.layers.items():
            h = self.run_layer(layer, h, cos, sin, None if kv is None else kv.layer(lid))
        if not self.last:
            return h
        if kv is not None:
            h = kv.last_tokens(h)  # (B, 1, d): only the next token's logits are needed
        return self.lm_head(self.model.norm(h))  # (B, T, vocab)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor"}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_ok(v: Any) -> bool:
    """A rope_scaling / rope_parameters dict we implement: none, default, or llama3 with its four numbers."""
    if v is None or v == {}:
        return True
    if not isinstance(v, dict) or set(v) - ROPE_KEYS - {"original_max_position_embeddings"}:
        return False
    kind = v.get("rope_type", v.get("type", "default"))
    if kind == "default":
        return True
    return kind == "llama3" and all(_positive(v.get(k)) for k in LLAMA3_KEYS)


def config_from_hf(d: dict[str, Any], where: str) -> ModelConfig:
    """ModelConfig of an HF Llama config; every field our model does not implement is refused by name."""
    dim, heads = d.get("hidden_size"), d.get("num_attention_heads")
    rope_what = "null, rope_type 'default', or rope_type 'llama3' with " + ", ".join(LLAMA3_KEYS)
    check_hf_fields(
        d,
        where,
        "llama",
        {
            **{k: (_count, "a positive integer") for k in ("vocab_size", "hidden_size", "intermediate_size")},
            **{k: (_count, "a positive integer") for k in ("num_hidden_layers", "num_attention_heads")},
            "num_key_value_heads": (lambda v: v is None or _count(v), "a positive integer"),
            "head_dim": (
                lambda v: v is None or (_count(dim) and _count(heads) and v == dim // heads),
                "hidden_size / num_attention_heads (only the standard head size is implemented)",
            ),
            "hidden_act": (lambda v: v in (None, "silu"), "'silu'"),
            "rms_norm_eps": (_positive, "a positive number"),
            "rope_theta": (_positive, "a positive number"),
            "rope_scaling": (_rope_ok, rope_what),
            "rope_parameters": (_rope_ok, rope_what),
            "tie_word_embeddings": (lambda v: isinstance(v, bool), "true or false"),
            "attention_bias": (lambda v: not v, "false"),
            "mlp_bias": (lambda v: not v, "false"),
            "attention_dropout": (lambda v: not v, "0 (training is exact only without dropout)"),
            "pretraining_tp": (lambda v: v in (None, 1), "1"),
            "max_position_embeddings": (lambda v: v is None or _count(v), "a positive integer"),
        },
    )
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers") if k not in d]
    if missing or heads is None:
        raise ValueError(f"{where}: missing {', '.join(missing + ['num_attention_heads'] * (heads is None))}")
    rope = {**(d.get("rope_parameters") or {}), **(d.get("rope_scaling") or {})}
    llama3 = rope.get("rope_type", rope.get("type", "default")) == "llama3"
    return ModelConfig(
        family="llama",
        vocab_size=d["vocab_size"],
        dim=dim,
        n_layers=d["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=d.get("num_key_value_heads") or heads,
        ffn_dim=d["intermediate_size"],
        rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling="llama3" if llama3 else "none",
        **(
            dict(
                rope_factor=float(rope["factor"]),
                rope_low_freq_factor=float(rope["low_freq_factor"]),
                rope_high_freq_factor=float(rope["high_freq_factor"]),
                rope_original_max_positions=int(rope["original_max_position_embeddings"]),
            )
            if llama3
            else {}
        ),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    # rope_theta and rope_scaling as separate keys: what transformers 4 writes and 5 still reads.
    scaling = (
        {
            "rope_type": "llama3",
            "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_positions,
        }
        if cfg.rope_scaling == "llama3"
        else None
    )
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
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tied,
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }


FAMILY = Family("llama", LlamaStage, "llama", config_from_hf, config_to_hf)
