"""The rules of a run configuration that ask the schedule registry: the schedule's name, its constraints
on pipeline ranks, virtual stages and microbatches, and every count of stages (which depends on the
schedule's default virtual stages). Each failure raises one ValueError naming the dotted key, its
numbers and what would be right, as `Config.validate` does for the rest.

They live here, not in config/validate.py, because config/ sits below pipeline/ and cannot ask the
registry. `validate_config` runs both, `Config.validate` first; the pre-flight check
(run/preflight.py) and every other entry point that judges a configuration before starting processes
(the launcher, `hybridpar plan`, the planner's search, the elastic re-plan, `train()`) call it.
"""

from __future__ import annotations

from hybridpar.config import Config
from hybridpar.config.keys import _suggest
from hybridpar.config.validate import positive_ints, replica_share
from hybridpar.pipeline.schedules.registry import SCHEDULES, schedule_names, schedule_spec, stage_count, stages_per_rank
from hybridpar.pipeline.schedules.spec import CONFIG_KEYS


def validate_config(cfg: Config, world_size: int | None = None) -> None:
    """Everything checked before any process starts: `Config.validate`, then the schedule's rules."""
    cfg.validate(world_size)
    check_config(cfg)


def check_config(cfg: Config) -> None:
    """The schedule's rules, in this order; the first failure wins. Assumes `Config.validate` passed
    (the counts they compare are positive integers)."""
    _check_name(cfg)
    _check_balance(cfg)
    _check_grad_sum(cfg)
    _check_layout(cfg)
    _check_recompute(cfg)
    _check_microbatch_size(cfg)
    _check_stage_layers(cfg)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_name(cfg: Config) -> None:
    # Worded as Config.validate words a value outside a key's choices: the names are this registry's.
    v, names = cfg.parallel.schedule, schedule_names()
    _require(v in names, f"parallel.schedule={v!r} is not one of {', '.join(names)}{_suggest(str(v), names)}")


def _check_balance(cfg: Config) -> None:
    b, p = cfg.balance, cfg.parallel
    if b.mode == "off":
        return
    live = " or ".join(s.name for s in SCHEDULES.values() if s.live_repartition)
    _require(
        p.pp == 1 or schedule_spec(p.schedule).live_repartition,
        f"balance.mode={b.mode} re-partitions pipeline stages for parallel.schedule {live}, got {p.schedule}",
    )


def _check_grad_sum(cfg: Config) -> None:
    # The tree takes each microbatch's gradient from autograd's accumulation (a post-accumulate hook);
    # a split backward's W writes linear weights' gradients itself.
    p = cfg.parallel
    whole = " or ".join(s.name for s in SCHEDULES.values() if not s.splits_backward)
    _require(
        p.grad_sum != "tree" or p.pp == 1 or not schedule_spec(p.schedule).splits_backward,
        f"parallel.grad_sum=tree needs a schedule whose backward is not split ({whole}), got {p.schedule}",
    )


def _check_layout(cfg: Config) -> None:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    spec, chunks = schedule_spec(p.schedule), stages_per_rank(p)
    problem = spec.layout_problem(p.pp, chunks, CONFIG_KEYS)
    _require(problem is None, problem or "")
    _require(
        m.n_layers >= stage_count(p),
        f"model.n_layers={m.n_layers} is fewer than parallel.pp × "
        f"parallel.virtual_stages = {p.pp} × {chunks} = {stage_count(p)} stages",
    )
    problem = spec.count_problem(p.pp, t.microbatches, CONFIG_KEYS)
    _require(problem is None, problem or "")


def _check_recompute(cfg: Config) -> None:
    # Config.validate has checked each mode; how many there may be depends on the stages.
    p, n = cfg.parallel, len(cfg.train.recompute.split(","))
    _require(
        n in (1, stage_count(p)),
        f"train.recompute has {n} entries but parallel.pp × parallel.virtual_stages = {p.pp} × "
        f"{stages_per_rank(p)} = {stage_count(p)} stages: give one mode for all stages or one per stage",
    )


def _check_microbatch_size(cfg: Config) -> None:
    b, p, t = cfg.batching, cfg.parallel, cfg.train
    if b.microbatch_size is None:
        return
    # Config.validate has checked the policy and the smallest replica; here the schedule's count.
    _, over = replica_share(t, p)
    n, largest = cfg.microbatch_count(), -(-t.global_batch // p.dp)
    assert n is not None  # the fixed policy, which batching.microbatch_size needs
    what = (
        f"batching.microbatch_size={b.microbatch_size} cuts the {largest} samples per replica {over} "
        f"into {n} microbatches"
    )
    spec = schedule_spec(p.schedule)
    least = spec.min_microbatches(p.pp)
    _require(
        n >= least,
        f"{what}; parallel.schedule={p.schedule} needs ≥ "
        f"{spec.min_microbatches_text(p.pp, CONFIG_KEYS)}: use a size ≤ {largest // least}",
    )
    _require(
        n % spec.microbatch_multiple(p.pp) == 0,
        f"{what}; parallel.schedule={p.schedule} needs a multiple of parallel.pp={p.pp}",
    )


def _check_stage_layers(cfg: Config) -> None:
    p, m = cfg.parallel, cfg.model
    if p.stage_layers is None:
        return
    n = stage_count(p)
    positive_ints("parallel.stage_layers", p.stage_layers, n, f"the layout has {n} stages")
    _require(
        sum(p.stage_layers) == m.n_layers,
        f"parallel.stage_layers sums to {sum(p.stage_layers)} but model.n_layers={m.n_layers}",
    )
