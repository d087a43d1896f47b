"""Sharded checkpoints through torch.distributed.checkpoint (DCP), committed atomically, and resume.

Layout-independent: tensors are stored under full-model names (`model.layers.3.mlp.up_proj.weight`,
`optim/<name>/exp_avg`), a tp shard as a DTensor over the tp sub-mesh (`Shard(p.tp_dim)`), so DCP records
where each shard sits in the full tensor and any (tp, pp, dp) can read it back. Stages hold disjoint names;
replicas (dp, and tp for norm gains) present identical tensors under one (key, offset), and DCP's
DefaultSavePlanner keeps one writer per (key, offset) (`dedup_save_plans`). A head tied across stages
(`Stage.holds_tied_copy`) is the embedding: not saved, loaded from the embedding's keys. Under ZeRO each
dp rank writes only its slices of the optimizer state (and under ZeRO-3 of the parameters, dataparallel/
zero3.py), packed into one flat tensor per dtype with an index of where each slice sits (packed.py): no
rank gathers the whole, and a resume at another dp or tp, or without ZeRO, reads the slices it needs.
Checkpoints written before packing hold each slice as a DTensor over the (dp, tp) sub-mesh: a ZeRO rank
reads those, and tensors saved whole, as its tp shard (DCP reshards) and keeps its dp slice of it.

Committed atomically, verified before it is read, found and pruned: resilience/commits.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from hybridpar.config import ModelConfig
from hybridpar.dataparallel.copies import MasterAdamW
from hybridpar.dataparallel.zero import ShardedAdamW, Slice, part
from hybridpar.model.registry import full_shapes
from hybridpar.model.stage import Stage
from hybridpar.resilience import packed, safe_dcp
from hybridpar.resilience.commits import (
    STATE,
    abandon_newer,
    commit_dir,
    find_latest,
    prune,
    sha256,
    tmp_name,
    verify_checkpoint,
    write_json,
    write_manifest,
)
from hybridpar.resilience.rundir import checkpoint_run_id
from hybridpar.topology.collectives import all_gather_json
from hybridpar.topology.mesh import Topology


@dataclass(frozen=True)
class Where:
    """Where a rank's tensor sits in the saved whole: its tensor-parallel shard dimension and, under ZeRO
    (optimizer state; ZeRO-3's parameters too), its dp slice (zero.Slice) — saved packed (`_region`), so a
    ZeRO checkpoint is written without gathering and loaded at any dp (or none)."""

    tp_dim: int | None
    zero: Slice | None = None


def _opt_state(opt: torch.optim.Optimizer) -> dict[torch.Tensor, tuple[dict[str, torch.Tensor], Slice | None]]:
    """This rank's AdamW state by model parameter, with the dp slice it covers (None: the whole)."""
    if isinstance(opt, ShardedAdamW):
        return opt.local_state()
    return {p: (st, None) for p, st in opt.state.items()}


def _param_shards(opt: torch.optim.Optimizer) -> dict[torch.Tensor, tuple[torch.Tensor, Slice]]:
    """Under ZeRO-3, this rank's slice of each sliced parameter (the parameter itself is empty at rest); with
    bf16 working copies its fp32 master of each (dataparallel/copies.py), sliced or whole."""
    if isinstance(opt, MasterAdamW):
        return dict(zip(opt.full, zip(opt.views, opt.slices)))
    if not isinstance(opt, ShardedAdamW) or not opt.own:
        return {}
    return {p: (q, s) for p, s, q in zip(opt.full, opt.slices, opt.views) if s.dim is not None}


def _tensors(
    stages: dict[int, Stage],
    opt_state: Mapping[torch.Tensor, tuple[dict[str, torch.Tensor], Slice | None]],
    tied_copy: bool,
    shards: Mapping[torch.Tensor, tuple[torch.Tensor, Slice]] | None = None,
) -> Iterator[tuple[str, torch.Tensor, Where]]:
    """(key, local tensor, where it sits) for parameters and the optimizer state this rank holds of
    them (`opt_state` as `_opt_state` gives it; `shards`: ZeRO-3's parameter slices, `_param_shards`)."""
    for stage in stages.values():
        for name, p in stage.named_parameters():
            if stage.holds_tied_copy and stage.stored_name(name) != name:
                if not tied_copy:
                    continue
                name = stage.stored_name(name)  # the same weight and optimizer state as the first stage's embedding
            dim = getattr(p, "tp_dim", None)
            if shards and p in shards:  # ZeRO-3: this rank's slice, written and read in place as the state's
                cut = shards[p][1]
                yield name, shards[p][0].detach(), Where(dim, cut if cut.dim is not None else None)
            else:
                yield name, p.detach(), Where(dim)
            state, cut = opt_state.get(p, ({}, None))
            assert state, f"{name} has no optimizer state: checkpoints are taken after a step"
            for k in sorted(state):
                t = state[k]
                if t.dim() != p.dim():  # the step count: one number, the same on every rank
                    yield f"optim/{name}/{k}", t, Where(None)
                else:
                    yield f"optim/{name}/{k}", t, Where(dim, cut if cut is not None and cut.dim is not None else None)


def _submeshes(topo: Topology) -> Callable[..., DeviceMesh]:
    """`topo.mesh[names]`, each sliced once: slicing a DeviceMesh builds a new one every time (2-5 ms each
    on a loaded 2-core CPU), and a save asks once per tensor — under ZeRO-3 at dp 4 (dim 512, 8 layers) that
    was a quarter of rank 0's time in `save_checkpoint` (5.3 of 21 s over 3 saves, cProfile)."""
    made: dict[tuple[str, ...], DeviceMesh] = {}

    def mesh(*names: str) -> DeviceMesh:
        if names not in made:
            made[names] = topo.mesh[names[0] if len(names) == 1 else names]
        return made[names]

    return mesh


def _dcp_state(
    topo: Topology, items: Iterable[tuple[str, torch.Tensor, Where]]
) -> tuple[dict[str, torch.Tensor], dict]:
    """DCP's state dict of `items` (key, local tensor, where it sits), the sub-meshes sliced once, and the
    index of the dp slices packed into it (packed.py: one flat tensor per dtype, written by context-parallel
    rank 0 alone — its peers hold the same slices —, a tp-replicated tensor's slices by tp rank 0 alone)."""
    mesh = _submeshes(topo)
    state: dict[str, torch.Tensor] = {}
    sliced = []
    for k, t, where in items:
        if where.zero is None:
            state[k] = _for_dcp(t, where, topo, mesh)
        elif topo.cp_rank == 0 and (where.tp_dim is not None or topo.tp_rank == 0):  # tp replicas: one writes
            sliced.append((k, t, _region(t, where, topo)))
    flats, index = packed.pack(sliced, f"rank{topo.rank}")
    return state | flats, index


def _region(t: torch.Tensor, where: Where, topo: Topology) -> packed.Region:
    """Where this rank's `t` sits in the whole tensor: its dp slice (zero.Slice: rows of the tp shard, which
    may be the dimension tp shards too) within its tp shard (even, as DTensor's Shard(tp_dim) over the tp
    sub-mesh)."""
    shape, offsets = list(t.shape), [0] * t.dim()
    if where.zero is not None:
        shape[where.zero.dim] = sum(where.zero.sizes)  # the tp shard's
        offsets[where.zero.dim] = where.zero.offsets[topo.dp_rank]
    if where.tp_dim is not None:
        offsets[where.tp_dim] += topo.tp_rank * shape[where.tp_dim]
        shape[where.tp_dim] *= topo.dims.tp
    return packed.Region(tuple(shape), tuple(offsets))


def _for_dcp(t: torch.Tensor, where: Where, topo: Topology, mesh: Callable[..., DeviceMesh]) -> torch.Tensor:
    """`t` as DCP saves and loads it: replicated, or its tp shard as a DTensor over the tp sub-mesh."""
    assert where.zero is None, "dp slices are packed (_region), or read through their tp shard"
    if where.tp_dim is None:
        return t  # replicated: every holder presents the same tensor under one key; DCP writes it once
    return DTensor.from_local(t, mesh("tp"), [Shard(where.tp_dim)], run_check=False)


def _shard_shape(t: torch.Tensor, s: Slice) -> tuple[int, ...]:
    """The tp shard a dp slice `t` is cut from (zero.slice_of)."""
    return tuple(sum(s.sizes) if d == s.dim else n for d, n in enumerate(t.shape))


def _fresh_adam_state(group: dict[str, Any], p: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's state of `p` as its first step would create it (torch/optim/adam.py `_init_group`)."""
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    fused, on_device = group.get("fused"), group.get("capturable") or group.get("fused")
    step = torch.zeros((), dtype=torch.float32 if fused else scalar, device=p.device if on_device else "cpu")
    moments = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
    return {"step": step, **{k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in moments}}


def _state_to_load(opt: torch.optim.Optimizer) -> dict[torch.Tensor, tuple[dict[str, torch.Tensor], Slice | None]]:
    """The optimizer's own state to load a checkpoint into (created where a step has not yet): under
    ZeRO-1 this rank's slices, which DCP fills from whatever dp the checkpoint was written at."""
    for group in opt.param_groups:
        for p in (p for p in group["params"] if not opt.state[p]):
            opt.state[p] = _fresh_adam_state(group, p)
    return _opt_state(opt)


def _broadcast_json(topo: Topology, obj: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's JSON value on every rank, as bytes in a tensor (nothing is pickled on the wire). A `group`
    of our own (the async writer's gloo group) carries CPU tensors."""
    device = topo.device if group is None else torch.device("cpu")
    data = list(json.dumps(obj).encode()) if topo.rank == 0 else []
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(n, src=0, group=group)
    buf = (
        torch.tensor(data, dtype=torch.uint8, device=device)
        if topo.rank == 0
        else torch.empty(int(n), dtype=torch.uint8, device=device)
    )
    dist.broadcast(buf, src=0, group=group)
    return json.loads(bytes(buf.cpu().tolist()).decode())


def _on_rank0(
    topo: Topology, work: Callable[[], Any], fail: Callable[[str], Exception], group: dist.ProcessGroup | None = None
) -> Any:
    """Run `work` on rank 0 only; every rank returns its JSON result, or raises `fail(rank 0's error)`."""
    out = None
    if topo.rank == 0:
        try:
            out = {"ok": work()}
        except Exception as e:  # every rank must hear of it: a rank 0 that just raised would leave them waiting
            out = {"error": str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"}
    out = _broadcast_json(topo, out, group)
    if "error" in out:
        raise fail(out["error"])
    return out["ok"]


def save_checkpoint(
    topo: Topology,
    stages: dict[int, Stage],
    opt: torch.optim.Optimizer,
    root: Path,
    step: int,
    trainer_state: dict[str, Any],
    keep: int,
    on_phase: Callable[[str], None] = lambda phase: None,
    owner_check: Callable[[], str | None] = lambda: None,
) -> Path:
    """Collective: write this rank's shards, commit `root/step-NNNNNN` atomically, keep the newest `keep`.
    `on_phase(name)` is called entering each phase (ckpt-write, ckpt-barrier, ckpt-manifest, ckpt-rename,
    ckpt-done) for the watchdog and fault injection. `owner_check()` (rank 0, before the commit) returns
    why this run no longer owns its directory, or None: a refusal leaves the commit undone."""
    tensors = _tensors(stages, _opt_state(opt), False, _param_shards(opt))
    state, index = _dcp_state(topo, tensors)
    return write_committed(topo, state, root, step, trainer_state, keep, on_phase, owner_check=owner_check, index=index)


def snapshot(stages: dict[int, Stage], opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor, Where]]:
    """What save_checkpoint would write, copied: later steps cannot change it (the async writer's input;
    `as_dcp_state` turns it into DCP's state dict, off the training thread)."""
    tensors = _tensors(stages, _opt_state(opt), False, _param_shards(opt))
    return [(k, t.detach().clone(), where) for k, t, where in tensors]


def as_dcp_state(topo: Topology, snap: list[tuple[str, torch.Tensor, Where]]) -> tuple[dict[str, torch.Tensor], dict]:
    return _dcp_state(topo, snap)


def write_committed(
    topo: Topology,
    state: dict[str, torch.Tensor],
    root: Path,
    step: int,
    trainer_state: dict[str, Any],
    keep: int,
    on_phase: Callable[[str], None],
    group: dist.ProcessGroup | None = None,
    owner_check: Callable[[], str | None] = lambda: None,
    index: dict | None = None,
) -> Path:
    """Collective over `group`: write `state` (DCP) to a fresh directory and commit it as `root/step-NNNNNN`.
    `index`: this rank's entries of the index of the slices packed into `state` (packed.py)."""
    root, final = Path(root), Path(root) / f"step-{step:06d}"
    run_id = trainer_state.get("run_id")

    def fail(error: str) -> Exception:
        return RuntimeError(
            f"saving the checkpoint of step {step} to {final} failed on rank 0: {error} "
            f"(earlier checkpoints in {root} are intact)"
        )

    def make_tmp() -> str:
        tmp = root / tmp_name(step, run_id)
        tmp.mkdir(parents=True)
        return str(tmp)

    known: dict[str, dict[str, Any]] = {}
    slices: dict[str, Any] = {}  # the packed slices' index, every rank's entries (rank 0 writes it if any)

    def commit() -> None:
        if (why := owner_check()) is not None:
            raise RuntimeError(f"not committed: {why}")
        write_json(tmp / STATE, trainer_state)
        if slices:
            # Compact: indented, json encodes it call by call in Python (0.7 M calls in three saves, profiled)
            write_json(tmp / packed.INDEX, slices, indent=None)
        on_phase("ckpt-manifest")
        write_manifest(tmp, step, run_id, known)
        on_phase("ckpt-rename")
        commit_dir(tmp, final, run_id)
        on_phase("ckpt-done")
        prune(root, keep, run_id)

    tmp = Path(_on_rank0(topo, make_tmp, fail, group))  # the broadcast also tells every rank that it exists
    on_phase("ckpt-write")
    dcp.save(state, checkpoint_id=str(tmp), process_group=group)  # DCP reports a failure on any rank to all
    on_phase("ckpt-barrier")
    dist.barrier(group=group)  # every rank's files are written and synced
    # The manifest's hashes, shared out: each rank hashes a share of the files (its own shard file first), so
    # rank 0 does not read every byte alone; gathered with the packed slices' index as JSON (nothing pickled).
    # A `group` of our own (the async writer's gloo group) carries CPU tensors.
    device = topo.device if group is None else torch.device("cpu")
    for got in all_gather_json({"hashes": _hash_share(tmp, group), "slices": index or {}}, device, group):
        known.update(got["hashes"])
        slices.update(got["slices"])
    _on_rank0(topo, commit, fail, group)
    return final


def _hash_share(tmp: Path, group: dist.ProcessGroup | None) -> dict[str, dict[str, Any]]:
    """Size and sha256 of this rank's share of the files DCP wrote into `tmp`: round robin over them, by
    name, so each rank hashes about one shard file."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    files = sorted(f for f in tmp.rglob("*") if f.is_file())
    return {f.relative_to(tmp).as_posix(): {"size": f.stat().st_size, "sha256": sha256(f)} for f in files[rank::world]}


def choose_checkpoint(
    topo: Topology, resume: str, root: Path, run_id: str | None, log: Callable[[str], None] = print
) -> Path | None:
    """Collective: rank 0 picks the checkpoint (`resume` = 'auto': the newest of run `run_id`, or a path)
    and every rank gets its choice. 'auto' with none usable gives None; a given path that does not verify
    raises ValueError on every rank; a given path of another run is used, with a line saying so."""

    def pick() -> str | None:
        if resume != "auto":
            if (why := verify_checkpoint(Path(resume))) is not None:
                raise ValueError(f"checkpoint.resume={resume!r} cannot be used: {why}")
            if (theirs := checkpoint_run_id(Path(resume))) != run_id:
                log(f"hybridpar: resuming run {run_id} from {resume}, a checkpoint of run {theirs}, as asked")
            return resume
        path, skipped = find_latest(Path(root), run_id)
        for line in skipped:
            log(f"hybridpar: {line}")
        if path is None:
            log(f"hybridpar: no usable checkpoint in {root}: starting from step 0")
        return None if path is None else str(path)

    path = _on_rank0(topo, pick, ValueError)
    return None if path is None else Path(path)


def load_checkpoint(
    topo: Topology, stages: dict[int, Stage], opt: torch.optim.Optimizer, path: Path, model_cfg: dict[str, Any]
) -> dict[str, Any]:
    """Collective: restore parameters and AdamW state from a verified checkpoint; returns its trainer state."""
    state = json.loads((Path(path) / STATE).read_text(encoding="utf-8"))
    # Compared with unset family defaults filled in: a checkpoint written before a field existed, or
    # with a default spelled out, still holds the same model.
    if diff := ModelConfig(**model_cfg).differences(state.get("config", {}).get("model", {})):
        raise ValueError(f"checkpoint {path} holds another model: {', '.join(diff)}")
    index = packed.read_index(Path(path))
    in_flats = packed.packed_keys(index)
    targets: dict[str, list[tuple[torch.Tensor, Slice | None]]] = {}
    bufs: dict[str, torch.Tensor] = {}
    cut: dict[str, list[tuple[torch.Tensor, packed.Region]]] = {}  # filled from the packed slices
    mesh = _submeshes(topo)
    for key, t, where in _tensors(stages, _state_to_load(opt), True, _param_shards(opt)):
        if key in in_flats:
            cut.setdefault(key, []).append((t, _region(t, where, topo)))
            continue
        if key not in bufs:  # a dp slice saved otherwise (whole, or by the format before packing): its tp shard
            shard = t if where.zero is None else t.new_empty(_shard_shape(t, where.zero))
            bufs[key] = _for_dcp(shard, Where(where.tp_dim), topo, mesh)
        targets.setdefault(key, []).append((t, where.zero))
    safe_dcp.load(bufs, path)  # DCP's FileSystemReader would unpickle `.metadata` with pickle.load
    with torch.no_grad():
        for key, dests in targets.items():
            src = bufs[key].to_local() if isinstance(bufs[key], DTensor) else bufs[key]
            for t, s in dests:
                t.copy_(src if s is None else part(src, s, topo.dp_rank))
    packed.unpack(index, cut, packed.reader(Path(path)))  # each rank alone: no collective
    if isinstance(opt, MasterAdamW):
        opt.refresh()  # the bf16 working copies of the masters just loaded (collective over dp)
    return state


def read_full_model(path: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The full fp32 model (HF names, definition order) from a checkpoint of any layout, in one process."""
    if (why := verify_checkpoint(Path(path))) is not None:
        raise ValueError(f"checkpoint {path} cannot be used: {why}")
    state = {n: torch.empty(shape, dtype=torch.float32) for n, shape in full_shapes(cfg).items()}
    packed.load_whole(state, Path(path))
    return state


def resume(
    topo: Topology,
    stages: dict[int, Stage],
    opt: torch.optim.Optimizer,
    which: str,
    root: Path,
    cfg: dict[str, Any],
    run_id: str | None,
    log: Callable[[str], None] = print,
) -> dict[str, Any] | None:
    """Collective: choose (`which`: 'auto' or a path; rank 0 verifies, all agree), load, set aside this run's
    newer checkpoints. `cfg` is this run's Config.to_dict(). Returns the trainer state, or None if 'auto'
    found none."""
    path = choose_checkpoint(topo, which, root, run_id, log)
    if path is None:
        return None
    state = load_checkpoint(topo, stages, opt, path, cfg["model"])
    if topo.rank == 0:
        try:
            for moved in abandon_newer(Path(root), state["step"], run_id):
                log(f"hybridpar: set aside {moved.name}: newer than the checkpoint resumed from")
        except OSError as e:
            log(f"hybridpar: warning: could not set aside newer checkpoints in {root}: {e}")
        saved = state["config"].get("train", {})
        changed = [
            f"train.{k}={v!r} (checkpoint: {saved.get(k)!r})" for k, v in cfg["train"].items() if saved.get(k) != v
        ]
        log(
            f"hybridpar: resumed from {path} after step {state['step']}"
            + (f"; changed since: {', '.join(changed)}" if changed else "")
        )
    return state
