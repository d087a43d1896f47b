"""Move decoder layers between the pipeline stages of running processes: parameters and their
optimizer state (AdamW's exp_avg, exp_avg_sq, step) travel by point-to-point messages, the stages are
rebuilt in place, and the training math is untouched (the same tensors, bit for bit, only elsewhere).

Each data-parallel replica moves its own copy between its own pipeline ranks, and under tensor
parallelism each tp rank sends its own shard to the same tp rank of the receiving stage, so every
transfer is between two ranks with the same (dp, tp) coordinates and no shard is ever re-cut. Per
pair of ranks one flat buffer carries all moved tensors (layers in order, parameters in definition
order, then their state), and a second carries the step counters in float64 (exact for any count).
Only layers move: the embedding stays on stage 0 and the final norm and head on the last stage,
which is why stage boundaries alone describe a move.

Under ZeRO-3 (`shards` given) what a rank holds of a parameter at rest is its dp slice, and that is what
moves: the slices are cut by the parameter's shape alone (dataparallel/zero.py's `slice_of`), so dp rank
d's slice on the sending stage is dp rank d's slice on the receiving one, and each rank sends its slice
and the AdamW state of that slice to the rank with its own (dp, tp) coordinates. Nothing is gathered and
no rank ever holds a moved layer whole. Gradients are not carried: a move follows the optimizer step,
after which there are none (ZeRO-2's kept slices included). Under bf16 working copies (dataparallel/copies.py)
the carried state holds each parameter's whole fp32 master beside its moments: the masters move with their
layers, never rounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.model.registry import empty_layer
from hybridpar.model.stage import Stage
from hybridpar.topology.mesh import Topology


def layer_moves(old: Sequence[range], new: Sequence[range]) -> list[tuple[int, int, int]]:
    """(layer, from stage, to stage) for every layer whose stage changes, in layer order."""
    if sum(map(len, old)) != sum(map(len, new)):
        raise ValueError(f"partitions {list(old)} and {list(new)} cover different numbers of layers")
    owner_old = {i: s for s, r in enumerate(old) for i in r}
    owner_new = {i: s for s, r in enumerate(new) for i in r}
    return [(i, owner_old[i], owner_new[i]) for i in sorted(owner_old) if owner_old[i] != owner_new[i]]


@dataclass
class MoveStats:
    layers_sent: int = 0
    layers_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def _state_keys(state: dict[str, torch.Tensor], p: torch.Tensor) -> tuple[list[str], list[str]]:
    """Optimizer state of one parameter: (moment keys shaped like p, scalar keys such as step)."""
    if not state:
        raise ValueError("a layer can move only after the optimizer has stepped (its state is empty)")
    keys = sorted(state)
    return (
        [k for k in keys if torch.is_tensor(state[k]) and state[k].shape == p.shape],
        [k for k in keys if torch.is_tensor(state[k]) and state[k].numel() == 1 and state[k].shape != p.shape],
    )


def _held(p: nn.Parameter, shards: dict | None) -> torch.Tensor:
    """What this rank holds of `p`: the parameter, or under ZeRO-3 its dp slice (`shards[p]`; `p` itself
    where the parameter is not sliced)."""
    return (p if shards is None else shards[p]).detach()


def _pack(layers: list[nn.Module], opt_state: dict, shards: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    tensors: list[torch.Tensor] = []
    scalars: list[torch.Tensor] = []
    for layer in layers:
        for p in layer.parameters():
            st, v = opt_state[p], _held(p, shards)
            moments, counters = _state_keys(st, v)
            tensors += [v.reshape(-1)] + [st[k].reshape(-1) for k in moments]
            scalars += [st[k].reshape(1).to(device=p.device, dtype=torch.float64) for k in counters]
    return torch.cat(tensors), torch.cat(scalars)


def default_layer_builder(
    stage: Stage, tp_group: dist.ProcessGroup | None, device: torch.device
) -> Callable[[int], nn.Module]:
    """Empty decoder layer `i` with this rank's tensor-parallel shard shapes and hooks (its values
    are overwritten by the received ones; sequence-parallel hooks if the stage's are)."""
    sp, back = stage.seq_shards > 1, getattr(stage, "sp_backward", "saved")
    return lambda i: empty_layer(stage.cfg, i, device, tp_group, sp, back)


def _transfers(
    moves: list[tuple[int, int, int]], mine: set[int]
) -> tuple[dict[tuple[int, int], list[int]], dict[tuple[int, int], list[int]]]:
    """The layers this rank sends and receives, per (from stage, to stage) pair with one end here and the
    other on another rank; moves between two stages of this rank (virtual stages) need no message."""
    out: dict[tuple[int, int], list[int]] = {}
    inc: dict[tuple[int, int], list[int]] = {}
    for i, src, dst in moves:
        if src in mine and dst not in mine:
            out.setdefault((src, dst), []).append(i)
        elif dst in mine and src not in mine:
            inc.setdefault((src, dst), []).append(i)
    return out, inc


def move_layers(
    topo: Topology,
    stages: dict[int, Stage],
    opt_state: dict,
    old: Sequence[range],
    new: Sequence[range],
    build_layer: Callable[[int], nn.Module],
    peer: Callable[[int], int],
    shards: dict[nn.Parameter, torch.Tensor] | None = None,
) -> MoveStats:
    """Collective over this replica's pipeline ranks (call on all of them, with the same `old` and
    `new`): after it, each of this rank's `stages` (stage index -> stage: one per rank, or several with
    virtual stages) holds the layers `new[s]`, with their parameters and their entries in `opt_state`
    (the optimizer's `state`, keyed by parameter) brought from the rank that held them; entries of layers
    that left the rank are deleted. `peer(s)` is the global rank of stage s. Messages between one pair of
    ranks are posted in (from stage, to stage) order on both ends, so they match whatever the placement.
    The caller rebuilds whatever caches parameters (optimizer groups, gradient hooks, split backward).
    `shards` (ZeRO-3: parameter -> this rank's dp slice, the state in `opt_state` being the slice's): the
    slices move instead of the parameters, and arrive as new entries of `shards`; a received layer's own
    parameters hold nothing yet (ZeRO-3's rebuild frees their storages, dataparallel/zero3.py)."""
    t0 = time.perf_counter()
    stats = MoveStats()
    out, inc = _transfers(layer_moves(old, new), set(stages))
    layers = {k: v for st in stages.values() for k, v in st.layers.items()}
    template = next(iter(layers.values()))
    # Sizes of an incoming layer's buffers, from a layer we hold: every decoder layer has the same
    # parameter shapes on a given tp rank, and the same optimizer state.
    # Its dtype too: the parameter's, or fp32 where the state widens it (bf16 working copies carry their
    # fp32 masters and moments beside the bf16 parameter: torch.cat promotes, exactly).
    flat_t, scalar_t = _pack([template], opt_state, shards)
    n_flat, n_scalar, flat_dtype = flat_t.numel(), scalar_t.numel(), flat_t.dtype
    ops: list[dist.P2POp] = []
    received: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for (src, dst), ids in sorted(out.items()):
        flat, scalars = _pack([layers[str(i)] for i in ids], opt_state, shards)
        ops += [dist.P2POp(dist.isend, flat, peer(dst)), dist.P2POp(dist.isend, scalars, peer(dst))]
        stats.layers_sent += len(ids)
        stats.bytes_sent += flat.numel() * flat.element_size() + scalars.numel() * 8
    for (src, dst), ids in sorted(inc.items()):
        flat = torch.empty(n_flat * len(ids), dtype=flat_dtype, device=topo.device)
        scalars = torch.empty(n_scalar * len(ids), dtype=torch.float64, device=topo.device)
        ops += [dist.P2POp(dist.irecv, flat, peer(src)), dist.P2POp(dist.irecv, scalars, peer(src))]
        received[(src, dst)] = (flat, scalars)
        stats.layers_received += len(ids)
        stats.bytes_received += flat.numel() * flat.element_size() + scalars.numel() * 8
    if ops:
        timeout = timedelta(seconds=topo.timeout_s)
        for w in dist.batch_isend_irecv(ops):
            w.wait(timeout)
    for pair, ids in sorted(inc.items()):
        layers.update(_unpack(ids, *received[pair], template, opt_state, build_layer, shards))
    for ids in out.values():
        for i in ids:
            for p in layers.pop(str(i)).parameters():
                opt_state.pop(p, None)
                if shards is not None:
                    shards.pop(p, None)
    for s, stage in stages.items():
        stage.set_layers({str(i): layers[str(i)] for i in new[s]})
    stats.seconds = time.perf_counter() - t0
    return stats


def _unpack(
    ids: list[int],
    flat: torch.Tensor,
    scalars: torch.Tensor,
    template: nn.Module,
    opt_state: dict,
    build_layer: Callable[[int], nn.Module],
    shards: dict | None,
) -> dict[str, nn.Module]:
    """The received layers `ids`, built empty and filled from one pair's buffers (packed by `_pack`), their
    optimizer state entered in `opt_state` with the dtypes and shapes of `template`'s (under ZeRO-3 the
    slices entered in `shards`, with the shapes of the template's slices)."""
    tmpl_params = list(template.parameters())
    tmpl_keys = {id(p): _state_keys(opt_state[p], _held(p, shards)) for p in tmpl_params}
    fo = so = 0
    built: dict[str, nn.Module] = {}
    for i in ids:
        layer = build_layer(i)
        for p, tp_ in zip(layer.parameters(), tmpl_params):
            moments, counters = tmpl_keys[id(tp_)]
            tmpl_state, shape = opt_state[tp_], _held(tp_, shards).shape
            value = flat[fo : fo + shape.numel()].view(shape)
            with torch.no_grad():
                if shards is not None and shards[tp_] is not tp_:  # a slice, kept apart (ZeRO-3 frees p)
                    shards[p] = value.clone()
                else:
                    p.copy_(value)
                    if shards is not None:
                        shards[p] = p
            fo += shape.numel()
            st: dict[str, torch.Tensor] = {}
            for k in moments:
                st[k] = flat[fo : fo + shape.numel()].view(shape).clone()
                fo += shape.numel()
            for k in counters:
                ref = tmpl_state[k]
                st[k] = scalars[so].to(device=ref.device, dtype=ref.dtype).reshape(ref.shape).clone()
                so += 1
            opt_state[p] = st
        built[str(i)] = layer
    return built
