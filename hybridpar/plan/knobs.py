"""The space of layouts the search visits (plan/search.py): every knob's legal values for a model on a hardware
description, the configuration each combination gives, and which combinations a cheaper one covers.
"""

from __future__ import annotations

import copy
import itertools
import operator
from typing import Any, Iterator

from hybridpar.config import Config
from hybridpar.pipeline.schedules import SCHEDULES
from hybridpar.plan.hardware import Hardware

VIRTUAL_STAGES = (2, 4, 8)  # tried for schedules that take any count
RECOMPUTE = ("none", "selective", "full")
# Context parallelism is searched where each of a rank's two chunks holds at least this many tokens: a
# shorter ring block is below the tile a flash-attention kernel computes at once (128 x 128 in
# FlashAttention-2), so the block neither uses the device nor hides the hop behind it.
MIN_CP_CHUNK = 128


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _cps(base: Config, ranks: int) -> list[int]:
    """The context-parallel sizes searched among `ranks`: 1, and those whose 2 cp chunks of the sequence
    hold MIN_CP_CHUNK tokens or more each."""
    seq = base.train.seq_len
    return [c for c in divisors(ranks) if c == 1 or (seq % (2 * c) == 0 and seq // (2 * c) >= MIN_CP_CHUNK)]


def all_knobs(base: Config, hw: Hardware, world: int, precisions: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """Every combination of knobs (not yet validated)."""
    m = base.model
    for tp in divisors(world):
        if tp > hw.devices_per_node or hw.devices_per_node % tp:
            continue
        for cp, pp in ((c, q) for c in _cps(base, world // tp) for q in divisors(world // (tp * c))):
            dp = world // (tp * cp * pp)
            if pp > m.n_layers or base.train.global_batch % dp:
                continue
            per_replica = base.train.global_batch // dp
            # With cp, each of a rank's 2 chunks is cut over tp too (config/validate.py `_check_context`).
            sp_splits = tp > 1 and base.train.seq_len % (tp if cp == 1 else 2 * cp * tp) == 0
            for spec in SCHEDULES.values():
                if pp == 1 and (spec.splits_backward or spec.min_microbatches_rule != (1, 0)):
                    continue  # one rank: the schedules differ only in how many microbatches wait; keep 1F1B's one
                vs = spec.virtual_stages or tuple(v for v in VIRTUAL_STAGES if pp * v <= m.n_layers)
                for v, mb in itertools.product(vs, divisors(per_replica)):
                    if spec.layout_problem(pp, v) or spec.count_problem(pp, mb) or pp * v > m.n_layers:
                        continue
                    for zero, sp, rec, prec, part in itertools.product(
                        # ZeRO-2 keeps ZeRO-1's peak: never preferred; ZeRO-3 does not compose with cp yet
                        ((0, 1, 3) if cp == 1 else (0, 1)) if dp > 1 else (0,),
                        # sequence parallelism: with tp > 1, where each cp rank's chunks split over tp
                        (False, True) if sp_splits else (False,),
                        RECOMPUTE,
                        precisions,
                        ("params", "cost") if pp > 1 else ("params",),
                    ):
                        yield dict(
                            tp=tp,
                            pp=pp,
                            dp=dp,
                            cp=cp,
                            schedule=spec.name,
                            v=v,
                            m=mb,
                            zero=zero,
                            sp=sp,
                            recompute=rec,
                            precision=prec,
                            partition=part,
                        )


# The knobs the knob bound reads (not the partition, the schedule or its virtual stages).
BOUNDED = ("tp", "pp", "dp", "cp", "m", "zero", "sp", "recompute", "precision")
# The knobs a layout's step estimate reads (all but the partition, which it does not model).
ESTIMATED = ("tp", "pp", "dp", "cp", "schedule", "v", "m", "zero", "sp", "recompute", "precision")


def knob_tuple(k: dict[str, Any], names: tuple[str, ...]) -> tuple:
    """The values of knobs `names` in `k` (a cache key; a search asks it of each of its layouts)."""
    try:
        return operator.itemgetter(*names)(k)
    except KeyError:  # knobs given without cp or sp (the defaults)
        return tuple(k.get(n) for n in names)


# The config key of each knob (`fixed` names knobs by these keys).
KNOB_KEYS = {
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "dp": "parallel.dp",
    "cp": "parallel.cp",
    "schedule": "parallel.schedule",
    "v": "parallel.virtual_stages",
    "m": "train.microbatches",
    "zero": "parallel.zero",
    "sp": "parallel.sequence_parallel",
    "recompute": "train.recompute",
    "precision": "train.precision",
    "partition": "parallel.partition",
}


def held_knobs(base: Config, hw: Hardware, world: int, fixed: dict[str, Any]) -> list[dict[str, Any]]:
    """The knobs with the `fixed` keys at their values; ValueError naming the binding ones where they
    leave none of the knobs there are."""
    held = {n: fixed[k] for n, k in KNOB_KEYS.items() if k in fixed}
    precisions = hw.precisions()
    if held.get("precision") not in (None, *precisions) and hw.peak_flops(held["precision"]) > 0:
        precisions += (held["precision"],)  # the user's own, costed from the peak where nothing timed it
    every = list(all_knobs(base, hw, world, precisions))
    keeps = lambda k, hold: all(k[n] == v for n, v in hold.items())  # noqa: E731
    knobs = [k for k in every if keeps(k, held)]
    if every and not knobs:  # binding: the held keys that, let go alone, leave some layout
        free = [n for n in held if any(keeps(k, {m: v for m, v in held.items() if m != n}) for k in every)]
        given = ", ".join(f"{KNOB_KEYS[n]}={held[n]}" for n in free or held)
        raise ValueError(
            f"no layout of world {world} has {given}: leave {'it' if len(free) == 1 else 'some'} to the planner"
        )
    return knobs


def config_of(base: Config, k: dict[str, Any]) -> Config:
    """`base` with the knobs `k` set (the sections they touch copied, the others shared)."""
    cfg = copy.copy(base)
    cfg.parallel = _replace(
        base.parallel,
        tp=k["tp"],
        pp=k["pp"],
        dp=k["dp"],
        cp=k.get("cp", 1),
        schedule=k["schedule"],
        zero=k["zero"],
        sequence_parallel=k.get("sp", False),
        partition=k["partition"],
        virtual_stages=k["v"] if SCHEDULES[k["schedule"]].virtual_stages is None else None,
        layer_costs=[1.0] * base.model.n_layers if k["partition"] == "cost" else None,
    )
    cfg.train = _replace(
        base.train,
        microbatches=k["m"],
        recompute=k["recompute"],
        precision=k["precision"],
        microbatch_sizes=None,
        bf16_weights=k.get("weights", base.train.bf16_weights),
    )
    cfg.batching = _replace(base.batching, policy="fixed", microbatch_size=None)
    return cfg


def _replace(section: Any, **changes: Any) -> Any:
    """`dataclasses.replace` for the config's sections (plain dataclasses: every field an init field, no
    __post_init__), as a shallow copy: a search builds tens of thousands of layouts."""
    assert set(changes) <= section.__dataclass_fields__.keys() and not hasattr(section, "__post_init__"), changes
    out = copy.copy(section)
    out.__dict__.update(changes)
    return out


def knob_key(k: dict[str, Any]) -> tuple:
    return tuple(sorted(k.items()))


def group_key(k: dict[str, Any]) -> tuple:
    """The knobs memory is not assumed monotone in; within a group, memory is assumed not to grow with
    more recomputation, ZeRO (as `_zero_covers` orders its levels) or more (smaller) microbatches."""
    return tuple(k.get(n, 1) for n in ("tp", "pp", "dp", "cp", "schedule", "v", "precision", "partition"))


def most_frugal(k: dict[str, Any], knobs_of_group: list[dict[str, Any]]) -> dict[str, Any]:
    sp = k["tp"] > 1 and any(x.get("sp", False) for x in knobs_of_group)
    return {
        **k,
        "recompute": "full",
        "zero": 1 if k["dp"] > 1 else 0,
        "sp": sp,
        "m": max(x["m"] for x in knobs_of_group),
    }


def _zero_covers(a: int, b: int) -> bool:
    """Whether ZeRO level `a` holds no more than level `b` whatever the layout: 1 and 2 hold the same peak
    and every level no more than 0; ZeRO-3 (its slices besides the gathered layers) can hold more than
    ZeRO-1 where a stage has only a layer or two, so 3 and 1/2 are not compared."""
    return a == b or b == 0 or (a in (1, 2) and b in (1, 2))


def covers(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether `a` is at least as frugal as `b` in every monotone knob (so `a` not fitting means `b` does not)."""
    return (
        RECOMPUTE.index(a["recompute"]) >= RECOMPUTE.index(b["recompute"])
        and _zero_covers(a["zero"], b["zero"])
        and a.get("sp", False) >= b.get("sp", False)  # sequence parallelism holds no more than without it
        and a["m"] >= b["m"]
    )
