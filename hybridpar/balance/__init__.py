"""Dynamic load balancing: measured load scores, straggler detection, stage re-partition and uneven
data-parallel splits (`balancer`), and the labelled slow-device emulation mode (`emulate`)."""
from hybridpar.balance.balancer import (
    DEFAULT_WEIGHTS,
    Balancer,
    BalancerConfig,
    Decision,
    RankSample,
    RepartitionDecision,
    StragglerDetector,
    StragglerState,
    load_scores,
    plan_repartition,
    predicted_pipeline_step,
    relative_speeds,
    split_by_speed,
)
from hybridpar.balance.emulate import Slowdown, SlowdownPlan

__all__ = [
    "DEFAULT_WEIGHTS", "Balancer", "BalancerConfig", "Decision", "RankSample",
    "RepartitionDecision", "Slowdown", "SlowdownPlan", "StragglerDetector", "StragglerState",
    "load_scores", "plan_repartition", "predicted_pipeline_step", "relative_speeds",
    "split_by_speed",
]
