"""The trainer's microbatch policy, built from the validated config and the schedule's constraints."""

from __future__ import annotations

import math

from hybridpar.batching.adaptive import AdaptivePolicy
from hybridpar.batching.fixed import FixedPolicy, MicrobatchPolicy
from hybridpar.batching.split import BatchPlan, plan_batch, split_evenly
from hybridpar.config import Config
from hybridpar.pipeline.schedules import build_schedule, max_in_flight, schedule_spec, stages_per_rank


def count_rules(cfg: Config) -> tuple[int, int]:
    """(fewest microbatches, required multiple) the schedule accepts (its registry entry); config.validate
    checks the same for fixed counts."""
    p = cfg.parallel
    spec = schedule_spec(p.schedule)
    return spec.min_microbatches(p.pp), spec.microbatch_multiple(p.pp)


def make_policy(cfg: Config, dp_rank: int, *, memory_total_bytes: int, resident_bytes: int) -> MicrobatchPolicy:
    """Every rank builds the same policy; fed the same (world-reduced) observations, all ranks of all
    replicas propose the same microbatch count each step. An adaptive policy models the largest
    replica (dp rank 0) on every rank, whatever its own: the count is one decision for the world,
    memory must fit where the microbatches are largest, and so the policy's state is the same on every
    rank (a checkpoint keeps rank 0's)."""
    p, t, b = cfg.parallel, cfg.train, cfg.batching
    replicas = split_evenly(t.global_batch, p.dp)
    mine = replicas[dp_rank]
    if b.policy == "fixed":
        if t.microbatch_sizes is not None:
            return FixedPolicy(mine, sizes=t.microbatch_sizes)
        return FixedPolicy(mine, count=cfg.microbatch_count())
    most = min(replicas)  # every replica runs the same count
    least, multiple = count_rules(cfg)
    top = most - most % multiple
    # Microbatches alive at once at the largest count the policy may try (GPipe: all of them, so the
    # planner's min(in_flight, count) is every count's own). A rank with v chunks holds (stage, microbatch)
    # pairs of about 1/v of its layers each: count them in whole-rank microbatches.
    chunks = stages_per_rank(p)
    in_flight = math.ceil(max_in_flight(build_schedule(p.schedule, p.pp, chunks, top)) / chunks)
    budget = fraction = None
    if b.memory_budget is not None:
        budget, fraction = (b.memory_budget, None) if b.memory_budget > 1 else (None, b.memory_budget)
    return AdaptivePolicy(
        t.global_batch,
        p.dp,
        dp_rank=0,
        memory_budget_bytes=budget,
        memory_fraction=fraction,
        memory_total_bytes=memory_total_bytes,
        memory_baseline_bytes=resident_bytes if fraction is not None else 0,
        min_microbatches=least,
        count_multiple=multiple,
        in_flight=in_flight,
        steps_per_candidate=b.steps_per_candidate,
        warmup_steps=b.warmup_steps,
        switch_margin=b.switch_margin,
        drift_margin=b.drift_margin,
        cooldown_steps=b.cooldown_steps,
    )


def plan_for(cfg: Config, count: int) -> BatchPlan:
    """Every replica's microbatch sizes when each runs `count` microbatches."""
    t = cfg.train
    explicit = t.microbatch_sizes if cfg.batching.policy == "fixed" else None
    return plan_batch(t.global_batch, cfg.parallel.dp, count, explicit)
