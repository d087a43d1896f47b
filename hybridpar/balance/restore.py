"""A restart keeps its balance: which layout a resumed run starts from (pure Python).

A checkpoint records the layout the run held when it was taken (`Layout.to_record()` with the mesh it
was for, `recorded_layout`). Resuming, the trainer is first built on the configured starting partition,
the checkpoint is loaded into it (DCP reshards by parameter name), and then the recorded layout is
adopted by the same collective move a live rebalance makes, so parameters and AdamW state arrive
exactly. Without it a balanced run would restart on the uniform partition and wait a full detection
window (plus `balance.interval`) before the balancer moves the same layers again.

The recorded layout applies only to the mesh and batch it was made for: the same pipeline depth, stages
per rank, replica count, layer count and global batch, every replica keeping at least its microbatch
count. Otherwise (an elastic re-plan, a changed batch) the run starts from its configured partition and
says why; the balancer then measures afresh. Under ZeRO-3 (`shared_only`) a layout whose replicas hold
different partitions (recorded by a run at another zero level) does not apply either: ZeRO-3 cuts each
layer among the replicas' ranks of one stage (and bf16 working copies at dp > 1 its masters: live.one_partition).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridpar.balance.repartition import Layout


def recorded_layout(layout: Layout, pp: int, dp: int, virtual_stages: int) -> dict[str, Any]:
    """What a checkpoint stores of the balancer's layout (JSON): the layout and the mesh it is for."""
    return {"pp": pp, "dp": dp, "virtual_stages": virtual_stages, **layout.to_record()}


@dataclass(frozen=True)
class Restored:
    """The layout a resumed run starts from: `layout` (None: keep the configured one) and why."""

    layout: Layout | None
    reason: str

    def to_record(self) -> dict[str, Any]:
        return {
            "source": "checkpoint" if self.layout is not None else "configured",
            "reason": self.reason,
            "layout": self.layout.to_record() if self.layout is not None else None,
        }


def _mismatch(rec: dict[str, Any], layout: Layout, now: dict[str, int], global_batch: int, microbatches: int) -> str:
    """Why a recorded layout cannot run now, or ''."""
    for key, value in now.items():
        if rec.get(key) != value:
            return f"it was for {key}={rec.get(key)}, this run has {key}={value}"
    if len({sum(len(r) for r in p) for p in layout.parts}) != 1:
        return "its replicas cover different numbers of layers"
    if sum(layout.split) != global_batch:
        return f"its replica shares {list(layout.split)} sum to {sum(layout.split)}, train.global_batch={global_batch}"
    if min(layout.split) < microbatches:
        return f"a replica share {min(layout.split)} is below train.microbatches={microbatches}"
    return ""


def restored_layout(
    saved: dict[str, Any] | None,
    configured: Layout,
    *,
    pp: int,
    dp: int,
    virtual_stages: int,
    global_batch: int,
    microbatches: int,
    shared_only: bool = False,
) -> Restored:
    """The layout to adopt after loading `saved` (a checkpoint's trainer state; None: not resumed), given
    the run's `configured` starting layout and mesh. Never raises for an unusable record: says why."""
    if saved is None:
        return Restored(None, "not resumed")
    rec = saved.get("balance_layout")
    if rec is None:
        return Restored(None, "the checkpoint records no balanced layout (written before it was recorded)")
    try:
        layout = Layout.from_record(rec)
    except (KeyError, TypeError, ValueError) as e:
        return Restored(None, f"the checkpoint's layout record is unreadable ({e})")
    why = _mismatch(rec, layout, {"pp": pp, "dp": dp, "virtual_stages": virtual_stages}, global_batch, microbatches)
    if not why and sum(len(r) for r in layout.parts[0]) != sum(len(r) for r in configured.parts[0]):
        why = (
            f"it covers {sum(len(r) for r in layout.parts[0])} layers, this model has "
            f"{sum(len(r) for r in configured.parts[0])}"
        )
    if not why and shared_only and not layout.shared_partition:
        why = "its replicas hold different partitions, and this run (ZeRO-3, or bf16 working copies at dp > 1) "
        why += "needs one partition for all"
    if why:
        return Restored(None, f"the checkpoint's layout does not apply: {why}; starting from the configured one")
    if layout == configured:
        return Restored(None, "the checkpoint's layout is the configured one")
    sizes = [[len(r) for r in p] for p in layout.parts]
    return Restored(layout, f"layers per stage {sizes}, samples per replica {list(layout.split)} from the checkpoint")
