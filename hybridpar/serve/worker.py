"""One serving rank: build this rank's stage (sharded over tp) from a model source, then run the
replica's driver (pp=0, tp=0) or the stage loop. Used by the server's worker pool, the benchmark and
the multi-process tests alike.

Model sources: `init:SEED` (hybridpar's deterministic init, for tests and benchmarks), a Hugging Face
model directory (config.json + *.safetensors, such as a run's final/) or a committed hybridpar DCP
checkpoint directory; either way only this stage's tensors are read. A run directory stands for its
newest model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridpar.config import ModelConfig
from hybridpar.model.hf import SafetensorsDir, StateSource, TensorSource
from hybridpar.model.registry import build_stage, empty_stage, full_shapes, load_stage_, read_hf_config
from hybridpar.model.stage import Stage
from hybridpar.pipeline.partition import partition_uniform
from hybridpar.serve.config import SERVE_DTYPES
from hybridpar.serve.driver import Channel, Driver, Limits
from hybridpar.serve.engine import StageRunner
from hybridpar.topology.mesh import Topology, build_topology
from hybridpar.trainer.export import newest_artefact

# What a serving stage computes in. Checkpoints and model directories hold fp32; a bf16 stage is cast
# after loading, so the engine's KV cache and pipeline messages follow (they take the stage's dtype).
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
assert tuple(TORCH_DTYPES) == SERVE_DTYPES


@dataclass
class WorkerSpec:
    """Everything a serving rank needs (JSON-able, so it crosses process boundaries without pickle)."""

    model: dict[str, Any]  # ModelConfig fields
    source: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    limits: dict[str, Any] = field(default_factory=dict)
    slowdown: list[float] = field(default_factory=list)  # per replica; EMULATION MODE, empty = off
    timeout_s: float = 120.0
    backend: str = "auto"
    dtype: str = "fp32"  # one of SERVE_DTYPES

    def __post_init__(self) -> None:
        if self.dtype not in SERVE_DTYPES:
            raise ValueError(f"serve dtype={self.dtype!r} is not one of {', '.join(SERVE_DTYPES)}")

    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.model)


def resolve_source(source: str, model: ModelConfig | None) -> tuple[str, ModelConfig]:
    """(normalised source, its ModelConfig). A hybridpar run directory resolves to its newest model: its
    final/ (a Hugging Face directory) or a later checkpoint (export.newest_artefact); the shape comes
    from the model's own config. `model` is needed for `init:SEED` only."""
    if source.startswith("init:"):
        if model is None:
            raise ValueError("source 'init:SEED' needs a model config")
        return source, model
    p = Path(source)
    if p.is_dir() and (p / "config.json").is_file():
        return str(p), read_hf_config(p)
    if p.is_dir() and (p / "trainer_state.json").is_file():
        state = json.loads((p / "trainer_state.json").read_text(encoding="utf-8"))
        return str(p), ModelConfig(**state["config"]["model"])
    if p.is_dir() and (found := newest_artefact(p)) is not None:
        return resolve_source(str(found), model)
    if p.is_dir() and any(p.glob("*.safetensors")):
        raise ValueError(
            f"model source {source!r} holds *.safetensors but no config.json: a Hugging Face model directory "
            "needs the config.json written with its weights (save_pretrained and hybridpar export write both)"
        )
    raise ValueError(
        f"model source {source!r} is not init:SEED, a Hugging Face model directory (config.json + "
        "*.safetensors), a hybridpar run directory holding a model (final/ or a checkpoint) or a checkpoint "
        "directory"
    )


def _open(source: str, stage: Stage) -> tuple[TensorSource, bool]:
    """(the source's tensors, whether they are in the Hugging Face layout rather than ours)."""
    p = Path(source)
    if (p / "config.json").is_file():
        return SafetensorsDir(p), True
    from hybridpar.resilience import packed
    from hybridpar.resilience.commits import verify_checkpoint

    if (why := verify_checkpoint(p)) is not None:
        raise ValueError(f"checkpoint {p} cannot be used: {why}")
    # Only this stage's tensors, at full size (DCP reshards on load); TP slicing happens when loading.
    names = {stage.stored_name(n) for n, _ in stage.named_parameters()}
    state = {n: torch.empty(shape, dtype=torch.float32) for n, shape in full_shapes(stage.cfg).items() if n in names}
    packed.load_whole(state, p)  # DCP's metadata through an allowlisting unpickler, not pickle.load
    return StateSource(state, str(p)), False


def build_serving_stage(spec: WorkerSpec, topo: Topology) -> Stage:
    cfg = spec.model_config()
    parts = partition_uniform(cfg.n_layers, spec.pp)
    s = topo.pp_rank
    tp_group = topo.group("tp") if spec.tp > 1 else None
    first, last = s == 0, s == spec.pp - 1
    if spec.source.startswith("init:"):
        stage = build_stage(cfg, parts[s], first, last, int(spec.source[5:]), topo.device, tp_group)
    else:
        # Sharded while empty: loading then reads only this rank's slices.
        stage = empty_stage(cfg, parts[s], first, last, topo.device, tp_group)
        src, hf_layout = _open(spec.source, stage)
        load_stage_(stage, src, hf_layout, topo.tp_rank, spec.tp)
    return stage.to(TORCH_DTYPES[spec.dtype]).eval()


def serve_rank(spec_d: dict[str, Any], channel: Channel | None) -> dict[str, Any] | None:
    """Entry of one rank (torch.distributed environment already set). The driver of each replica
    needs `channel`; returns its final status, other ranks None."""
    spec = WorkerSpec(**spec_d)
    topo = build_topology(spec.dp, spec.pp, spec.tp, spec.backend, spec.timeout_s)
    stage = build_serving_stage(spec, topo)
    slow = spec.slowdown[topo.dp_rank] if topo.dp_rank < len(spec.slowdown) else 1.0
    limits = Limits(**spec.limits)
    runner = StageRunner(stage, topo, slowdown=slow, kv_blocks=limits.kv_blocks, block_size=limits.block_size)
    if runner.is_driver:
        assert channel is not None, "a replica driver needs a channel"
        return Driver(runner, channel, limits).run()
    runner.serve_forever()
    return None
