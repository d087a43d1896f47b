"""What one process of a (dp, pp, tp) run holds, built per parallel dimension as typed bundles.

- `build_model_parallel`: pp x tp — this rank's pipeline stages (tensor-parallel inside), their
  placement, the point-to-point links and the pipeline runtime that runs the action lists.
- `build_data_parallel`: dp — how this rank's gradients meet their replicas' (bucketed all-reduce
  over dp, or over the dp x pp plane once the balancer gave replicas different partitions).
- `build_optimizer`: AdamW over the stages' parameters (ZeRO-1: each dp rank steps its slice,
  hybridpar/dataparallel/zero.py), carrying state over when the stages change.
- `build_zero3`: under ZeRO-3, the per-layer gathers and frees of the parameters (dataparallel/zero3.py).

The trainer (trainer/step.py) builds them once and rebuilds the last two when the load balancer moves
layers; nothing here knows about steps, balancing or probes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridpar.balance.live import plane_groups
from hybridpar.balance.repartition import Layout
from hybridpar.config import Config
from hybridpar.dataparallel.copies import MasterAdamW
from hybridpar.dataparallel.grads import DataParallelGrads, PlaneGrads
from hybridpar.dataparallel.tree import TreeGrads
from hybridpar.dataparallel.zero import ShardedAdamW
from hybridpar.dataparallel.zero3 import Zero3
from hybridpar.model.compiled import CompiledLayers
from hybridpar.model.hf import SafetensorsDir
from hybridpar.model.optim import make_optimizer
from hybridpar.model.registry import build_stage, empty_stage, load_stage_, param_counts
from hybridpar.model.stage import Stage
from hybridpar.model.tp import COLLECTIVES_IN_GRAPH
from hybridpar.pipeline.activation_meter import ActivationMeter
from hybridpar.pipeline.p2p import P2P
from hybridpar.pipeline.partition import partition_by_cost, partition_by_params, partition_uniform
from hybridpar.pipeline.runtime import PipelineRuntime
from hybridpar.pipeline.schedules import schedule_spec, stage_count, stages_per_rank
from hybridpar.topology.mesh import Topology


def layer_partition(cfg: Config) -> list[range]:
    """The starting partition of layers into pipeline stages (`parallel.partition`)."""
    m, n_stages = cfg.model, stage_count(cfg.parallel)
    if cfg.parallel.partition == "uniform":
        return partition_uniform(m.n_layers, n_stages)
    if cfg.parallel.partition == "cost":
        return partition_by_cost(cfg.parallel.layer_costs, n_stages)
    if cfg.parallel.partition == "layers":  # explicit, e.g. the planner's split for unequal devices
        ends = list(itertools.accumulate(cfg.parallel.stage_layers))
        return [range(a, b) for a, b in zip([0] + ends[:-1], ends)]
    n = param_counts(m)
    return partition_by_params([n.layer] * m.n_layers, n_stages, embed_params=n.embed, head_params=n.head)


@dataclass
class ModelParallel:
    """pp x tp: the stages this rank holds (stage index -> module, tp-sharded) and how they talk."""

    stages: dict[int, Stage]
    n_stages: int
    stage_ranks: tuple[int, ...]  # pipeline rank of each stage: the schedule's placement
    p2p: P2P
    runtime: PipelineRuntime
    compiled: CompiledLayers | None = None  # train.compile: the callable every stage's layers run through

    def parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(stage-qualified name, parameter) of every parameter this rank holds, in a fixed order."""
        return [(f"{s}.{n}", q) for s, st in self.stages.items() for n, q in st.named_parameters()]


def build_model_parallel(cfg: Config, topo: Topology, parts: list[range]) -> ModelParallel:
    p, t = cfg.parallel, cfg.train
    n_stages = stage_count(p)
    stage_ranks = schedule_spec(p.schedule).stage_ranks(p.pp, stages_per_rank(p))
    tp_group = topo.group("tp") if p.tp > 1 else None
    sp = p.sequence_parallel and p.tp > 1
    # model.init_from: each rank reads only its stages' tensors, and of those only its tp slices.
    hf = SafetensorsDir(cfg.model.init_from) if cfg.model.init_from else None
    stages: dict[int, Stage] = {}
    recompute = t.recompute_modes(n_stages)
    for s in (s for s, r in enumerate(stage_ranks) if r == topo.pp_rank):
        first, last = s == 0, s == n_stages - 1
        if hf is None:
            stages[s] = build_stage(cfg.model, parts[s], first, last, t.seed, topo.device, tp_group, sp, p.sp_backward)
        else:
            stages[s] = empty_stage(cfg.model, parts[s], first, last, topo.device, tp_group, sp, p.sp_backward)
            load_stage_(stages[s], hf, True, topo.tp_rank, p.tp)
        stages[s].recompute = recompute[s]
        stages[s].rebuild_saved = stages[s].rebuild_now = t.rebuild_saved  # model/regather.py
    low = torch.bfloat16 if t.precision == "bf16" else None
    p2p = P2P(topo.device, low or torch.float32, p.timeout_s, transport=p.p2p)
    runtime = PipelineRuntime(stages, n_stages, lambda s: topo.pp_peer(stage_ranks[s]), p2p, cfg.model.dim)
    runtime.seq_shards = p.tp if sp else 1  # messages carry this rank's 1/tp of the sequence
    copies = t.bf16_weights == "copies"  # bf16 parameters (made by build_optimizer's MasterAdamW): no autocast
    runtime.autocast = None if copies else low
    runtime.compute_dtype = low if copies and low else torch.float32
    runtime.meter = ActivationMeter(cfg.emulate.memory_limit)
    runtime.meter.lent = p2p.lent
    runtime.meter.buffered = p2p.holds
    # The B/W split's eager linears, ring attention and, before torch 2.13, tensor parallelism's collectives
    # (model/tp.py) break each layer's graph (model/compiled.py): then one static graph per microbatch size.
    breaks = schedule_spec(p.schedule).splits_backward or p.cp > 1 or (p.tp > 1 and not COLLECTIVES_IN_GRAPH)
    compiled = CompiledLayers(t.compile_backend, per_size=breaks) if t.compile else None
    for st in stages.values():
        st.compiled = compiled  # kept by live re-partition, which moves layers between existing stages
    return ModelParallel(stages, n_stages, tuple(stage_ranks), p2p, runtime, compiled)


@dataclass
class DataParallel:
    """dp: the gradient reduction among replicas for the current layout."""

    grads: DataParallelGrads | PlaneGrads | TreeGrads
    plane: dist.ProcessGroup | None  # the (dp x pp) plane group, made once replicas' partitions differ


def build_data_parallel(
    cfg: Config, topo: Topology, stages: dict[int, Stage], layout: Layout, plane: dist.ProcessGroup | None = None
) -> DataParallel:
    """Replicas with one partition reduce each parameter over dp; replicas with different partitions
    (after a per-replica re-partition) reduce each layer over the ranks of the dp x pp plane holding it.
    Making the plane group is collective: every rank builds with the same layout."""
    if cfg.parallel.grad_sum == "tree":  # validate.py: no re-partition, no ZeRO
        return DataParallel(TreeGrads(topo, stages), plane)
    if layout.shared_partition or cfg.parallel.dp == 1:
        sharded = cfg.parallel.zero if cfg.parallel.dp > 1 else 0  # >= 1: the optimizer is a ShardedAdamW
        grads = DataParallelGrads(topo, stages, cfg.train.microbatches, sharded=bool(sharded), keep_slices=sharded >= 2)
        return DataParallel(grads, plane)
    plane = plane or plane_groups(topo)
    return DataParallel(PlaneGrads(topo, stages, cfg.model.n_layers, plane), plane)


def build_zero3(cfg: Config, topo: Topology, mp: ModelParallel, opt: torch.optim.Optimizer) -> Zero3 | None:
    """ZeRO-3's gathers and frees of `mp`'s parameters (dataparallel/zero3.py), hooked into its stages and
    runtime; None without ZeRO-3 (or with dp = 1)."""
    if not isinstance(opt, ShardedAdamW) or not opt.own:
        return None
    z = Zero3(topo, mp.stages, opt, cfg.parallel.zero3_regather, mp.runtime.meter)
    mp.runtime.after_compute = z.after_action
    return z


def build_optimizer(
    cfg: Config,
    topo: Topology,
    mp: ModelParallel,
    layout: Layout,
    carry: dict[torch.Tensor, dict] | None = None,
    given: dict[torch.Tensor, torch.Tensor] | None = None,
) -> torch.optim.Optimizer:
    """AdamW over `mp`'s parameters, its state sharded over dp under `parallel.zero` 1 or 2 while the replicas
    share one partition (with per-replica partitions a layer's replicas sit on different pipeline ranks,
    so each rank keeps whole state until the layout is shared again). `carry` (whole state by parameter,
    as `full_optimizer_state` gives) is kept for the parameters it has — layers that moved here arrive
    with their state already in it. Under ZeRO-3 after a move, `given` holds this rank's slice of every
    parameter and `carry` the slices' state (the parameters themselves are empty)."""
    named, t = mp.parameters(), cfg.train
    if t.bf16_weights == "copies":  # fp32 masters, this dp rank's slices only (ZeRO-3: bf16 slices at rest too)
        return MasterAdamW(named, t, topo, carry, own=cfg.parallel.shards_parameters, given=given)
    if cfg.parallel.zero >= 1 and layout.shared_partition:
        return ShardedAdamW(named, t, topo, carry, own=cfg.parallel.shards_parameters, given=given)
    opt = make_optimizer(named, t)
    if carry is not None:
        for _, q in named:
            if q in carry:
                opt.state[q] = carry[q]
    return opt
