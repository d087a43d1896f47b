"""GPipe (Huang et al., 2019): all forwards, then all backwards."""

from __future__ import annotations

from hybridpar.pipeline.schedules.actions import Action
from hybridpar.pipeline.schedules.one_f_one_b import flush_bubble, single_stage
from hybridpar.pipeline.schedules.spec import ScheduleSpec


def build_gpipe(pp: int, virtual_stages: int, m: int) -> list[list[Action]]:
    # GPipe is 1F1B with a full warm-up: all forwards, then all backwards, stashing m activations.
    return [single_stage(m, m, r) for r in range(pp)]


SPEC = ScheduleSpec(
    "gpipe",
    "all forwards, then all backwards (GPipe, Huang et al., 2019)",
    build_gpipe,
    flush_bubble,
    min_microbatches_rule=(0, 1),
    live_repartition=True,
    torch_peer="ScheduleGPipe",
)
