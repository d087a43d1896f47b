"""Tensor parallelism as a plan keyed by module name (Megatron-LM layout, applied with DTensor).

Per decoder layer: q/k/v and gate/up projections are column-parallel (each rank owns a slice of the
heads / of the FFN width), o_proj and down_proj are row-parallel, so each block needs exactly one
all-reduce forward and one backward (Shoeybi et al. 2019). The embedding is vocabulary-parallel
(row-wise) and the head column-parallel with its logits gathered, so the loss is computed on full
logits identically on every tensor-parallel rank. Norm weights stay replicated plain tensors: their
inputs are identical on every tp rank, hence so are their gradients.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from hybridpar.model.llama import LlamaStage


def tp_plan(first: bool, last: bool) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
    }
    if first:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    if last:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def apply_tp(stage: LlamaStage, tp_mesh: DeviceMesh) -> LlamaStage:
    """Shard `stage` in place over the 1-D `tp_mesh`. A no-op for tp=1."""
    if tp_mesh.size() == 1:
        return stage
    parallelize_module(stage, tp_mesh, tp_plan(stage.first, stage.last))
    if stage.cfg.tie_embeddings and stage.first and stage.last:
        # parallelize_module replaces each weight with a new DTensor parameter, which unties them; both are
        # Shard(0) over the vocabulary, so the shared weight can simply be re-tied.
        stage.lm_head.weight = stage.model.embed_tokens.weight
    return stage


def is_sharded(p: nn.Parameter) -> bool:
    """True for a DTensor parameter sharded over tp (its local tensor is a slice of the full one)."""
    return hasattr(p, "placements") and any(pl.is_shard() for pl in p.placements)
