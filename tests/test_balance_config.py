"""The `balance` config section: defaults (the tutorial's load-score weights), validation errors
that name the field, and the layouts the live balancer refuses before any process starts."""

from __future__ import annotations

import pytest

from hybridpar.config import Config, parse_args
from hybridpar.pipeline.schedules.config_rules import validate_config


def test_defaults_and_cli() -> None:
    b = Config().balance
    assert (b.mode, b.interval, b.min_gain, b.threshold) == ("off", 20, 0.05, 1.25)
    assert (b.weight_memory, b.weight_compute, b.weight_network) == (0.4, 0.4, 0.2)
    cfg = parse_args(["--balance.mode", "auto", "--balance.interval", "7", "--parallel.tp", "1"])
    assert cfg.balance.mode == "auto" and cfg.balance.interval == 7
    validate_config(cfg, world_size=2)


@pytest.mark.parametrize(
    "over,fragment",
    [
        (dict(mode="on"), "balance.mode='on' is not one of off, detect, auto"),
        (dict(interval=0), "balance.interval must be a positive integer, got 0"),
        (dict(window=0), "balance.window must be a positive integer"),
        (dict(persist=0), "balance.persist must be a positive integer, got 0"),
        (dict(skip_steps=-1), "balance.skip_steps must be a non-negative integer"),
        (dict(min_gain=1.0), "balance.min_gain must be in [0, 1), got 1.0"),
        (dict(threshold=1.0), "balance.threshold must be > 1"),
        (dict(weight_network=-0.1), "balance.weight_network must be a number >= 0"),
        (dict(weight_memory=0.0, weight_compute=0.0, weight_network=0.0), "must be > 0"),
    ],
)
def test_bad_values(over: dict, fragment: str) -> None:
    cfg = Config()
    for k, v in over.items():
        setattr(cfg.balance, k, v)
    with pytest.raises(ValueError) as e:
        validate_config(cfg)
    assert fragment in str(e.value)


def test_layouts_refused_before_launch() -> None:
    cfg = Config()
    cfg.balance.mode = "auto"
    for schedule, v in (("zb-h1", None), ("zb-v", 2), ("interleaved-1f1b", 2)):  # every schedule re-partitions
        cfg.parallel.schedule, cfg.parallel.virtual_stages = schedule, v
        validate_config(cfg)
    cfg.parallel.virtual_stages = None
    cfg.parallel.schedule, cfg.parallel.pp, cfg.parallel.dp = "1f1b", 1, 2
    cfg.train.microbatch_sizes = [2, 2, 2, 2]
    with pytest.raises(ValueError, match="drop them"):
        validate_config(cfg)
    cfg.balance.mode = "off"  # off: anything goes
    validate_config(cfg)
    with pytest.raises(ValueError, match="emulate.layer_ms must be >= 0"):
        cfg.emulate.layer_ms = -1.0
        validate_config(cfg)
    cfg.emulate.layer_ms, cfg.emulate.layer_timing = 0.0, "emulated"  # no emulated cost to read
    with pytest.raises(ValueError, match="emulate.layer_timing='emulated' needs an emulated cost to read"):
        validate_config(cfg)
    cfg.emulate.layer_timing = "exact"
    with pytest.raises(ValueError, match="emulate.layer_timing='exact' is not one of measured, emulated"):
        validate_config(cfg)


def test_bench_scenarios_are_valid_configs() -> None:
    from hybridpar.bench.balance import parse_args
    from hybridpar.bench.balance_cases import ACCEPTANCE, CASES, LAYOUTS, case_config

    a = parse_args(["--layer-ms", "1.0"])
    assert (a.clean_steps, a.repeats, a.drift_steps) == (200, 3, 300)
    for layout in LAYOUTS:
        for case in CASES:
            if case == "slow_link" and LAYOUTS[layout]["pp"] < 4:
                continue
            for contender in (False, True):
                cfg = case_config(layout, case, "emulated", a, contender)
                validate_config(cfg, world_size=4)
                assert cfg.model.n_layers == 24 and cfg.emulate.layer_ms == 1.0
                assert cfg.balance.mode == ("auto" if contender or case == "clean" else "off")
    one = case_config("dp2xpp2", "one", "compute", a, True)
    assert one.emulate.slowdown == "rank=2:2.0@step=10" and one.emulate.layer_ms == 0.0
    assert case_config("pp4-zb-v", "drift", "emulated", a, True).emulate.drift == "rank=2:2.5@step=10+300"
    link = case_config("pp4-1f1b", "slow_link", "emulated", a, True)
    assert link.emulate.slow_link == "1:10" and link.batching.policy == "adaptive"
    # The acceptance set: its own sizes (each overridable), every pair a valid config, every compute action
    # at least --min-action-ms long (zb-v: 3 layers x 3.5 samples -> 8 / 10.5 ms per layer and sample).
    acc = parse_args(["--acceptance", "--repeats", "2"])
    assert (acc.layer_ms, acc.steps, acc.clean_repeats, acc.drift_static, acc.repeats) == (0.2, 30, 1, False, 2)
    for mode, layout, case in ACCEPTANCE:
        validate_config(case_config(layout, case, mode, acc, True), world_size=4)
    assert case_config("pp4-zb-v", "one", "emulated", acc, True).emulate.layer_ms == pytest.approx(8 / 10.5)
    assert case_config("pp4-1f1b", "one", "emulated", acc, True).emulate.layer_ms == 0.2
    assert {c for _, _, c in ACCEPTANCE} == set(CASES) and {x for _, x, c in ACCEPTANCE if c == "clean"} == set(LAYOUTS)
    bad_args = (["--layouts", "pp8"], ["--cases", "three"], ["--modes", "fast"], ["--steps", "15"], ["--repeats", "0"])
    for bad in (*bad_args, ["--min-action-ms", "-1"], ["--clean-repeats", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_bench_figures_against_the_bound() -> None:
    """A pair of runs turned into ratios: 4 ranks, clean step 1.0 s; rank 2 at 2x drags the static run to
    2.0 s and the balanced one settles at 1.2 s. Bound: 1.0 x 4 / 3.5."""
    from argparse import Namespace

    from hybridpar.bench.balance_cases import case_config, drift_bound, figures

    a = Namespace(layer_ms=1.0, link_ms=2.0, steps=40, drift_steps=300, measure=10, clean_steps=200)
    cfg = case_config("pp4-1f1b", "one", "emulated", a, True)

    def rows(times: list[float], moved_at: int | None = None) -> list[dict]:
        out: list[dict] = [{"step": i, "step_time_s": t} for i, t in enumerate(times)]
        if moved_at is not None:
            out[moved_at]["balance"] = [{"event": "rebalance", "applied": True, "step": moved_at}]
        return out

    f = figures(cfg, "one", rows([1.0] * 10 + [2.0] * 30), rows([1.0] * 10 + [1.2] * 30, moved_at=14), a)
    assert f["balanced_over_ideal"] == pytest.approx(4 / 3.5 / 1.2) and f["static_over_ideal"] == pytest.approx(4 / 7)
    assert f["balanced_over_static"] == pytest.approx(2.0 / 1.2) and f["steps_to_rebalance"] == 4 and f["moves"] == 1
    # The emulated costs' own bound: 1 ms x 3 x 28 samples x 24 layers / 3.5, 1f1b pp4 m4: x 7 / 4.
    assert f["balanced_over_analytic"] == pytest.approx(0.001 * 3 * 28 * 24 / 3.5 * 7 / 4 / 1.2)
    # Drift: the bound integrates each step's summed speeds (all 4 at full speed outside the drift).
    assert drift_bound(1.0, 4, "rank=2:2.5@step=100+10", range(0, 10)) == pytest.approx(10.0)
    assert drift_bound(1.0, 4, "rank=2:2.0@step=0+2", range(1, 2)) == pytest.approx(4 / 3.5)
    # A drift run without its static run (--no-drift-static): balanced against the bound only.
    drift = case_config("pp4-1f1b", "drift", "emulated", Namespace(**{**vars(a), "drift_steps": 10}), True)
    f = figures(drift, "drift", None, rows([1.0] * 30), a, rows([1.0] * 20))
    assert f["static_over_ideal"] is None and f["moves"] == 0
    assert f["balanced_over_ideal"] == pytest.approx(drift_bound(1.0, 4, drift.emulate.drift, range(10, 30)) / 20)
    assert f["balanced_over_own_pre_onset_ideal"] == pytest.approx(f["balanced_over_ideal"])  # pre-onset 1.0 too


def test_alternating_blocks_against_each_rounds_bound() -> None:
    """bench/balance_alternate.py: each round's balanced and static blocks against that round's clean block
    (4 ranks, one 2x slow: bound = clean x 4 / 3.5), medians over the rounds; a round the load slowed as a
    whole keeps its ratios."""
    from hybridpar.bench.balance_alternate import alternate_figures

    def blocks(r: int, clean: float, balanced: float, static: float) -> list[dict]:
        return [
            {"round": r, "variant": v, "step_s": [t, t, 9.0 * t], "load_average": 1.0}
            for v, t in (("clean", clean), ("balanced", balanced), ("static", static))
        ]

    res = {
        "blocks": blocks(0, 1.0, 1.2, 2.0) + blocks(1, 2.0, 2.4, 4.0) + blocks(2, 1.0, 1.6, 2.0),
        "moves": [{"step": 14}],
        "balanced_parts": [[[0, 7], [7, 14], [14, 17], [17, 24]]],
    }
    f = alternate_figures(res, 3.5, 4, 10)
    assert [x["balanced_over_ideal"] for x in f["rounds"]] == pytest.approx([4 / 3.5 / 1.2] * 2 + [4 / 3.5 / 1.6])
    assert f["balanced_over_ideal"] == pytest.approx(4 / 3.5 / 1.2) and f["static_over_ideal"] == pytest.approx(4 / 7)
    assert f["steps_to_rebalance"] == 4 and f["moves"] == 1 and f["balanced_over_static"] == pytest.approx(2 / 1.2)
    res["blocks"][1]["step_s"] = [3.0, 1.2, 3.0]  # a burst on two of round 0's balanced steps: its quietest kept
    f = alternate_figures(res, 3.5, 4, 10)
    assert f["rounds"][0]["balanced_over_ideal"] == pytest.approx(4 / 3.5 / 3.0)
    assert f["rounds"][0]["quiet_balanced_over_ideal"] == pytest.approx(4 / 3.5 / 1.2)
    # Half of the clean step emulated compute: only that half is scaled, the rest stays (1.0 + 0.5 x 0.5 / 3.5).
    f = alternate_figures(res, 3.5, 4, 10, emulated_s=0.5)
    assert f["rounds"][2]["balanced_over_ideal"] == pytest.approx((1.0 + 0.5 * 0.5 / 3.5) / 1.6)


def test_drift_oscillation_counts_direction_changes() -> None:
    """A drift's moves take work off the slow rank, then give it back: one change of direction; a move
    back and forth again counts twice more."""
    from argparse import Namespace

    from hybridpar.bench.balance_cases import case_config, oscillation

    a = Namespace(layer_ms=1.0, link_ms=2.0, steps=40, drift_steps=300, measure=10, clean_steps=200)
    cfg = case_config("pp4-interleaved", "drift", "emulated", a, True)  # stages 2 and 6 on rank 2

    def move(step: int, old: list[int], new: list[int]) -> dict:
        def rec(sizes: list[int]) -> dict:
            bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            return {"parts": [[[x, y] for x, y in zip(bounds, bounds[1:])]], "split": [28]}

        return {"step": step, "old": rec(old), "new": rec(new)}

    u, less, least = [3] * 8, [3, 3, 2, 4, 3, 3, 3, 3], [3, 3, 2, 4, 3, 3, 2, 4]
    monotone = [move(40, u, less), move(80, less, least), move(200, least, less), move(260, less, u)]
    expected = {"min_move_gap": 40, "direction_changes": 1, "work_changes": [-28, -28, 28, 28]}
    assert oscillation(cfg, monotone) == expected
    assert oscillation(cfg, monotone[:2] + [move(100, least, less), move(120, less, least)])["direction_changes"] == 2


def test_summary_over_launches_counts_a_launch_that_never_moved() -> None:
    from hybridpar.bench.balance import acceptance, summarise

    reps = [
        {"balanced_over_ideal": 0.9, "steps_to_rebalance": None, "moves": 0},
        {"balanced_over_ideal": 1.0, "steps_to_rebalance": 12, "moves": 1},
        {"balanced_over_ideal": 1.1, "steps_to_rebalance": 11, "moves": 1},
    ]
    med = summarise("one", reps)  # launch 0 first: its None no longer hides the others' figure
    assert med == {"balanced_over_ideal": 1.0, "moves": 1, "steps_to_rebalance": 12, "launches_rebalanced": 2}
    reps[1]["steps_to_rebalance"] = None  # two of three never moved: the median is never
    med = summarise("one", reps)
    assert med["steps_to_rebalance"] is None and med["launches_rebalanced"] == 1
    results = [{"mode": "emulated", "case": "one", "median": med}]
    assert acceptance(results)["one_slow_rebalanced_within_20_steps"] is False
