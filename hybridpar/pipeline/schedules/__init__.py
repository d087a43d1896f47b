"""Pipeline schedules as plain data: per pipeline rank, an ordered list of actions.

The runtime executes these lists literally, so everything that can go wrong with a schedule (a missing
backward, mismatched point-to-point order, a dependency cycle) is caught here, in pure Python, before
any GPU time is spent.

    actions.py      Action, Op, stage placement and the one dependency rule of actions
    spec.py         ScheduleSpec: a schedule's constraints, placement, bubble formula and capabilities
    gpipe.py, one_f_one_b.py, interleaved.py, zb_h1.py, zb_v.py
                    one schedule each: its builder (the compute actions), bubble formula and SPEC
    registry.py     the one list of registered schedules, and lookups by name
    lowering.py     name -> compute actions -> sends and receives added -> validated (build_schedule)
    validator.py    validate_schedule and the step x rank grid of its errors
    config_rules.py the schedule's rules on a run configuration, which the pre-flight check runs

Every public name is re-exported here, so importers write `from hybridpar.pipeline.schedules import
build_schedule, schedule_spec`.
"""

from hybridpar.pipeline.schedules.actions import (
    COMPUTE_OPS,
    RECVS,
    SENDS,
    Action,
    Op,
    ScheduleError,
    inputs,
    message_of,
    placement,
)
from hybridpar.pipeline.schedules.lowering import (
    add_communication,
    bubble_fraction_theory,
    build_schedule,
    compute_schedule,
    max_in_flight,
)
from hybridpar.pipeline.schedules.registry import (
    SCHEDULES,
    schedule_names,
    schedule_spec,
    stage_count,
    stages_per_rank,
)
from hybridpar.pipeline.schedules.spec import CONFIG_KEYS, Keys, ScheduleSpec, stage_ranks
from hybridpar.pipeline.schedules.validator import format_grid, validate_schedule

__all__ = [
    "COMPUTE_OPS",
    "CONFIG_KEYS",
    "RECVS",
    "SCHEDULES",
    "SENDS",
    "Action",
    "Keys",
    "Op",
    "ScheduleError",
    "ScheduleSpec",
    "add_communication",
    "bubble_fraction_theory",
    "build_schedule",
    "compute_schedule",
    "format_grid",
    "inputs",
    "max_in_flight",
    "message_of",
    "placement",
    "schedule_names",
    "schedule_spec",
    "stage_count",
    "stage_ranks",
    "stages_per_rank",
    "validate_schedule",
]
