"""Optimizer pieces shared by the trainer and the single-device reference: LR schedule and parameter
groups. Plain `torch.optim.AdamW` does the update, so a parallel run and a one-device run step the very
same optimizer."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from hybridpar.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine decay to cfg.min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def param_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices (projections, embedding, head), not norm gains (GPT-2/Llama practice)."""
    named = list(named)
    groups = [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


# Device types where `train.fused_adamw auto` takes torch's fused AdamW kernel (torch documents it as the
# fastest on CUDA). On CPU it measured faster too (docs/compile.md), but auto keeps torch's default there
# until the whole equivalence suite has run with it: every exactness test's optimizer would change.
FUSED_BY_DEFAULT = ("cuda",)


def takes_fused(fused_adamw: str, device_type: str) -> bool:
    """Whether train.fused_adamw runs torch's fused AdamW on a device of `device_type`."""
    return fused_adamw == "on" or (fused_adamw == "auto" and device_type in FUSED_BY_DEFAULT)


def adamw_options(cfg: TrainConfig, device: torch.device) -> dict[str, bool]:
    """AdamW's implementation keyword for `device` under train.fused_adamw: fused=True (one kernel for every
    parameter's update) or nothing (torch's default, the multi-tensor foreach path)."""
    return {"fused": True} if takes_fused(cfg.fused_adamw, device.type) else {}


def make_optimizer(named: Iterable[tuple[str, nn.Parameter]], cfg: TrainConfig) -> torch.optim.AdamW:
    named = list(named)
    device = named[0][1].device if named else torch.device("cpu")
    return torch.optim.AdamW(
        param_groups(named, cfg.weight_decay),
        lr=lr_at(0, cfg),
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **adamw_options(cfg, device),
    )


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
