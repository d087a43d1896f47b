"""The schedule registry (hybridpar/pipeline/schedules/registry.py): every registered schedule builds complete,
validated action lists on its own placement over a range of layouts, refuses the layouts its constraints
exclude with errors that name the schedule and the numbers, meets its bubble formula under unit costs,
and nothing outside the registry compares a schedule's name."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import hybridpar
from hybridpar.pipeline.schedules import (
    CONFIG_KEYS,
    SCHEDULES,
    Action,
    Op,
    ScheduleSpec,
    build_schedule,
    compute_schedule,
    schedule_names,
    schedule_spec,
    stage_ranks,
    validate_schedule,
)
from hybridpar.pipeline.schedules.gpipe import build_gpipe
from hybridpar.pipeline.schedules.one_f_one_b import flush_bubble
from hybridpar.pipeline.schedules.registry import REGISTERED, index
from hybridpar.pipeline.simulate import Costs, simulate

F, B, W = Op.FORWARD, Op.BACKWARD, Op.WEIGHT


def layouts(spec: ScheduleSpec) -> list[tuple[int, int, int]]:
    """(pp, v, m) the spec accepts: pp 1..5, its virtual stages, m from its minimum to about 3 pp."""
    out = []
    for pp in range(max(1, spec.min_pp), 6):
        for v in spec.virtual_stages or (1, 2, 3):
            least, step = spec.min_microbatches(pp), spec.microbatch_multiple(pp)
            out += [(pp, v, m) for m in range(least, max(least, 3 * pp + 2)) if m % step == 0]
    return out


CASES = [(name, *layout) for name, spec in SCHEDULES.items() for layout in layouts(spec)]


@pytest.mark.parametrize("name, pp, v, m", CASES, ids=[f"{c[0]}-pp{c[1]}-v{c[2]}-m{c[3]}" for c in CASES])
def test_every_spec_builds_valid_complete_schedules(name: str, pp: int, v: int, m: int) -> None:
    spec = schedule_spec(name)
    ranks = spec.stage_ranks(pp, v)
    n = pp * v
    sched = build_schedule(name, pp, v, m, recv_lookahead=1)  # validated inside
    validate_schedule(sched, pp, n, m, ranks=ranks)
    ops = (F, B, W) if spec.splits_backward else (F, B)
    for r, acts in enumerate(sched):
        compute = [a for a in acts if a.is_compute]
        assert compute == compute_schedule(name, pp, v, m)[r]
        expected = {Action(s, op, mb) for s in range(n) if ranks[s] == r for mb in range(m) for op in ops}
        assert len(compute) == len(expected) and set(compute) == expected  # each action exactly once
        assert all(ranks[a.stage] == r for a in acts)
    # A message for every stage boundary that crosses ranks, both ways, per microbatch.
    crossings = sum(ranks[s] != ranks[s + 1] for s in range(n - 1))
    assert sum(not a.is_compute for acts in sched for a in acts) == 4 * crossings * m


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_unit_cost_bubble_meets_the_formula(name: str) -> None:
    # The event simulator over the very action lists, each stage costing 1 per F and B (and W where the
    # backward is split): its bubble is the registered formula's.
    spec = schedule_spec(name)
    for pp, v, m in layouts(spec)[::3]:
        costs = Costs(1.0, 1.0, 1.0 if spec.splits_backward else 0.0)
        res = simulate(build_schedule(name, pp, v, m), pp, pp * v, costs, ranks=spec.stage_ranks(pp, v))
        t_w = 1.0 if spec.splits_backward else 0.0
        assert res.bubble_fraction == pytest.approx(spec.bubble_fraction(pp, v, m, t_w=t_w), abs=1e-12), (pp, v, m)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_constraint_errors_name_the_schedule_and_the_numbers(name: str) -> None:
    spec = schedule_spec(name)
    pp = max(4, spec.min_pp)
    v = spec.default_virtual_stages
    least = spec.min_microbatches(pp)
    if least > 1:
        with pytest.raises(ValueError, match=rf"^schedule={name} needs microbatches ≥ .*{least}, got {least - 1}$"):
            build_schedule(name, pp, v, least - 1)
        problem = spec.count_problem(pp, least - 1, CONFIG_KEYS)
        assert problem is not None and problem.startswith(f"parallel.schedule={name} needs train.microbatches ≥ ")
    if spec.virtual_stages is not None:
        bad = max(spec.virtual_stages) + 1
        with pytest.raises(ValueError, match=rf"^schedule={name} runs .* per pipeline rank, got virtual_stages={bad}"):
            build_schedule(name, pp, bad, least)
    if spec.min_pp > 1:
        with pytest.raises(ValueError, match=rf"^schedule={name} needs pp >= {spec.min_pp}, got 1$"):
            build_schedule(name, 1, v, least)


def test_unknown_schedule_suggests_a_name() -> None:
    with pytest.raises(ValueError, match=r"unknown schedule 'zb_h1'; did you mean 'zb-h1'\? \(known: gpipe, 1f1b"):
        schedule_spec("zb_h1")


def test_placements() -> None:
    assert stage_ranks("loop", 4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert stage_ranks("v", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)  # first and last stage on rank 0
    assert stage_ranks("v", 3, 1) == stage_ranks("loop", 3, 1) == (0, 1, 2)
    with pytest.raises(ValueError, match="unknown stage placement 'zigzag'"):
        stage_ranks("zigzag", 2, 2)


def test_registration_is_checked() -> None:
    assert index(REGISTERED) == SCHEDULES
    with pytest.raises(ValueError, match="'1f1b' is registered twice"):
        index([*REGISTERED, schedule_spec("1f1b")])
    with pytest.raises(ValueError, match="falls back to 'nope', which is not registered yet"):
        index([*REGISTERED, ScheduleSpec("x-test", "x", build_gpipe, flush_bubble, fallback="nope")])
    with pytest.raises(ValueError, match="'1f1b' falls back to 'gpipe', which is not registered yet"):
        index([schedule_spec("1f1b"), schedule_spec("gpipe")])  # a fallback comes first
    with pytest.raises(ValueError, match="'x-test': unknown placement 'zigzag'"):
        index([ScheduleSpec("x-test", "x", build_gpipe, flush_bubble, placement="zigzag")])
    assert "x-test" not in SCHEDULES


def test_fallback_chains_end_and_capabilities_are_declared() -> None:
    for spec in SCHEDULES.values():
        seen = {spec.name}
        while spec.fallback is not None:  # ends: a fallback is registered before what falls back to it
            spec = schedule_spec(spec.fallback)
            assert spec.name not in seen
            seen.add(spec.name)
    assert all(s.live_repartition for s in SCHEDULES.values())  # the balancer moves layers under every one
    assert all(s.torch_peer for s in SCHEDULES.values())  # every schedule has its peer in the benchmark


def _compared_names(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines where a schedule name is compared (==, !=, in, not in) as a string literal."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                elts = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                if any(isinstance(e, ast.Constant) and e.value in names for e in elts):
                    lines.append(node.lineno)
    return lines


def test_no_schedule_name_is_compared_outside_the_registry() -> None:
    root = Path(hybridpar.__file__).parent
    names = set(schedule_names())
    found = {
        str(p.relative_to(root)): lines
        for p in sorted(root.rglob("*.py"))
        if (lines := _compared_names(ast.parse(p.read_text()), names))
    }
    assert found == {}
    assert _compared_names(ast.parse("if s == '1f1b' or s in ('gpipe', 'x'): pass"), names) == [1, 1]  # it can fail


def test_every_schedule_file_is_registered_and_holds_its_own_builder() -> None:
    # A schedule is one file of the package defining SPEC, and one line of REGISTERED: a file left out of
    # the list, or a spec whose builder lives in another schedule's file, fails here.
    package = Path(hybridpar.__file__).parent / "pipeline" / "schedules"
    with_spec = sorted(p.stem for p in package.glob("*.py") if "\nSPEC = " in p.read_text(encoding="utf-8"))
    assert sorted(spec.builder.__module__.rsplit(".", 1)[1] for spec in REGISTERED) == with_spec
    for spec in REGISTERED:
        assert importlib.import_module(spec.builder.__module__).SPEC is spec, spec.name


def test_the_pipeline_resolves_nothing_by_name() -> None:
    # Specs hold their builder as a function: no dotted "module:function" names, no import by name.
    root = Path(hybridpar.__file__).parent / "pipeline"
    assert [p for p in root.rglob("*.py") if "import_module" in p.read_text(encoding="utf-8")] == []
