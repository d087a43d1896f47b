"""Layout search: every legal layout of a model on a hardware description, pruned by memory, ranked
by the step time the cost model predicts on the simulator (plan/cost.py, plan/step.py).

Knobs (plan/knobs.py): tp (dividing the model's split sizes, inside a node), pp (at most one layer per stage), dp (the
rest of the world, dividing the global batch), every registered schedule with its virtual stages,
microbatch counts dividing each replica's batch, partition (parameter-balanced, as the runtime's
default, or cost-balanced), ZeRO-1 (with dp > 1), recomputation and precision (those the hardware
computes). Legality is `validate_config`'s (Config.validate and the schedule's rules), not restated here.

Speed (branch and bound, exact: the list is the one simulating every layout would give): candidates
are visited in the order of a fast estimate (average rank work stretched by the schedule's bubble
formula, its ScheduleSpec in pipeline/schedules/), so the k-th best falls early; a candidate whose lower bound
(plan/bound.py: first from its knobs, then from its schedule's critical path) exceeds the k-th best
is skipped before its memory is asked, and the search stops once no remaining candidate's knob bound
is below it. Memory (a callable, e.g. plan/memory_model.rank_memory) is asked only of the candidates that
get that far; action lists are lowered once per schedule and cached.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from hybridpar.config import Config, TrainConfig
from hybridpar.pipeline.schedules import SCHEDULES, Action, add_communication, compute_schedule, stages_per_rank
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.pipeline.sim_program import Program, compile_program
from hybridpar.pipeline.simulate import SimResult
from hybridpar.plan.bound import ComputeShape, after_bound, compute_shape, knob_bound, pipeline_bound
from hybridpar.plan.cost import CostModel, LayerCosts, Placement, Shape, busy_comm, placement
from hybridpar.plan.hardware import Hardware, Link
from hybridpar.plan.knobs import (
    BOUNDED,
    ESTIMATED,
    RECOMPUTE,
    config_of,
    covers,
    divisors,
    group_key,
    held_knobs,
    knob_key,
    knob_tuple,
    most_frugal,
)
from hybridpar.plan.memory_model import MemoryModel, rank_memory
from hybridpar.plan.step import Prediction, Setup, grad_sum_s, optimizer_s, param_gathers, predict, sharing
from hybridpar.report.mfu import model_flops_per_token

TIES = 1e-9  # the bounds add the simulator's terms in another order: rounding must not prune a tie
GIB = 2**30


class HasTotal(Protocol):
    @property
    def total(self) -> int: ...


Memory = Callable[[Config], Sequence[HasTotal]]


@dataclass
class Candidate:
    cfg: Config
    prediction: Prediction
    memory: list[int]  # bytes per pipeline rank
    tokens_per_s: float
    mfu: float
    reason: str = ""

    @property
    def label(self) -> str:
        p, t = self.cfg.parallel, self.cfg.train
        v = f" v{stages_per_rank(p)}" if stages_per_rank(p) > 1 else ""
        extras = [f"zero{p.zero}"] * (p.zero > 0) + [f"recompute={t.recompute}"] * (t.recompute != "none")
        extras += ["sp"] * p.sequence_parallel + [f"cp{p.cp}"] * (p.cp > 1)
        extras += [t.precision] * (t.precision != "fp32") + ["copies"] * (t.bf16_weights == "copies")
        extras += ["cost-balanced"] * (p.partition == "cost")
        return f"tp{p.tp} pp{p.pp} dp{p.dp} {p.schedule}{v} m{t.microbatches} " + " ".join(extras)

    def to_dict(self) -> dict[str, Any]:
        p, t = self.cfg.parallel, self.cfg.train
        return {
            "layout": self.label.strip(),
            "parallel": {
                "tp": p.tp,
                "pp": p.pp,
                "dp": p.dp,
                "schedule": p.schedule,
                "virtual_stages": stages_per_rank(p),
                "partition": p.partition,
                "zero": p.zero,
                "sequence_parallel": p.sequence_parallel,
                "cp": p.cp,
            },
            "train": {
                "microbatches": t.microbatches,
                "recompute": t.recompute,
                "precision": t.precision,
                "bf16_weights": t.bf16_weights,
            },
            "step_s": self.prediction.step_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "bubble": self.prediction.bubble,
            "memory_per_rank_gib": [round(b / GIB, 3) for b in self.memory],
            "breakdown_s": self.prediction.breakdown(),
            "stages": [list(r) for r in self.prediction.parts],
            "reason": self.reason,
        }


@dataclass
class Plan:
    candidates: list[Candidate]
    considered: int  # layouts enumerated
    simulated: int
    memory_checked: int
    notes: list[str] = field(default_factory=list)


class Planner:
    def __init__(self, base: Config, hw: Hardware, memory: Memory) -> None:
        self.base, self.hw = base, hw
        # The memory model's caches live as long as this search: one MemoryModel per planner.
        self.memory = MemoryModel(validate_schedules=False) if memory is rank_memory else memory
        self.model = CostModel(base.model, hw)
        self._actions: dict[tuple, Program] = {}
        self._compute: dict[tuple, list[list[Action]]] = {}
        self._bounds: dict[tuple, float] = {}
        self._estimates: dict[tuple, float] = {}
        self._estimated_terms: dict[tuple, tuple[Shape, Placement, LayerCosts, float, float | None, float]] = {}
        self._shapes: dict[tuple, ComputeShape] = {}
        self._pipeline_bounds: dict[tuple, tuple[float, Setup]] = {}
        self._sims: dict[tuple, SimResult] = {}
        self._params = self.model.stage_params([range(0, base.model.n_layers)])[0]  # the whole model's
        self._shaped: dict[tuple, tuple[Shape, Placement, TrainConfig, int, tuple[int, Link] | None]] = {}

    def actions(self, name: str, pp: int, v: int, m: int) -> Program:
        """The schedule's action lists, lowered once for the many simulations that share them."""
        if isinstance(self.memory, MemoryModel):  # the memory model replays the same lists: lower them once
            return self.memory.program(name, pp, v, m, self.base.parallel.recv_lookahead)
        key = (name, pp, v, m)
        if key not in self._actions:  # the registry's builders, validated by their tests and by the runtime
            ranks = SCHEDULES[name].stage_ranks(pp, v)
            lists = add_communication(
                self.compute(name, pp, v, m), pp, pp * v, self.base.parallel.recv_lookahead, ranks=ranks
            )
            self._actions[key] = compile_program(lists, pp, pp * v, ranks)
        return self._actions[key]

    def compute(self, name: str, pp: int, v: int, m: int) -> list[list[Action]]:
        if isinstance(self.memory, MemoryModel):  # the memory model builds the same lists: build them once
            return self.memory.compute(name, pp, v, m)
        key = (name, pp, v, m)
        if key not in self._compute:
            self._compute[key] = compute_schedule(name, pp, v, m)
        return self._compute[key]

    def _shape(self, k: dict[str, Any]) -> tuple[Shape, Placement, TrainConfig, int, tuple[int, Link] | None]:
        """Knobs `k`'s mesh shape, placement, training settings, a rank's tokens per microbatch (1/cp of
        the microbatch's under context parallelism) and ring (cp and its link; None without cp)."""
        key = (k["tp"], k["pp"], k["dp"], k.get("cp", 1), k["m"], k["precision"])
        if key not in self._shaped:  # the bounds and estimates of the many layouts alike ask for the same few
            shape = Shape(*key[:4])
            pl = placement(shape, self.hw)
            t = dataclasses.replace(self.base.train, precision=k["precision"])
            tokens = t.global_batch // k["dp"] // k["m"] * t.seq_len // shape.cp
            self._shaped[key] = shape, pl, t, tokens, None if pl.cp is None else (shape.cp, pl.cp)
        return self._shaped[key]

    def weights(self, precision: str) -> tuple[bool, ...]:
        """Whether a layout of this precision may run with working copies, not, or either (the bounds count the
        cheaper): the base's copies hold every bf16 layout to them; under autocast the search tries them on a
        bf16 layout that does not fit (`_Search.fits`)."""
        if precision != "bf16":
            return (False,)
        return (True,) if self.base.train.bf16_weights == "copies" else (False, True)

    def bound(self, k: dict[str, Any]) -> float:
        """`knob_bound` of knobs `k`: no layout with them is predicted faster (the partition, the schedule and
        its virtual stages do not enter: a search's layouts share the bounds of far fewer knobs)."""
        key = knob_tuple(k, BOUNDED)
        if key not in self._bounds:
            shape, pl, t, tokens, ring = self._shape(k)
            st = self.model.comm_stretch(t)  # as the simulation counts them (cost.busy_comm)
            layer = self.model.layer(t, k["tp"], tokens, pl.tp, k["recompute"], sp=k.get("sp", False), ring=ring)
            layer = layer.busy(st)
            embed, head = (busy_comm(e, st) for e in self.model.ends(t, k["tp"], tokens, pl.tp))
            share = sharing(shape, self.hw, pl)
            capacity = None if share is None else sum(share.capacity)
            self._bounds[key] = knob_bound(
                self.model, pl, layer, embed.total + head.total, k, capacity, self.weights(k["precision"])
            )
        return self._bounds[key]

    def estimate(self, k: dict[str, Any]) -> float:
        """Fast step estimate of knobs `k` (the search's order, not a bound): average rank work stretched by
        the schedule's bubble formula."""
        key = knob_tuple(k, ESTIMATED)
        if key in self._estimates:
            return self._estimates[key]
        shape, pl, layer, total, shared, opt = self._estimated(k)
        spec = SCHEDULES[k["schedule"]]
        t_b = layer.b.total if spec.splits_backward else layer.b.total + layer.w.total
        t_w = layer.w.total if spec.splits_backward else 0.0
        try:
            bubble = spec.bubble_fraction(k["pp"], k["v"], k["m"], t_f=layer.f.total, t_b=t_b, t_w=t_w)
        except ValueError:
            bubble = 0.0
        work = total / k["pp"] / (1.0 - bubble)
        if shared is not None:  # the node's cores bound the whole pipeline's work
            work = max(work, shared)
        # After the pipeline: the optimizer, and the first stage's gradient all-reduce, which nothing hides.
        params = self._params / (k["tp"] * k["pp"])
        after = opt + grad_sum_s(self.hw, 4 * params / k["v"], shape, pl, 0)
        self._estimates[key] = work + after
        return self._estimates[key]

    def _estimated(self, k: dict[str, Any]) -> tuple[Shape, Placement, LayerCosts, float, float | None, float]:
        """`estimate`'s terms that the schedule and its virtual stages do not change, once per the knobs the
        knob bound reads: the shape, placement, one layer's costs, the replica's work per step, that work over
        the node's cores where ranks share them, and the optimizer step."""
        key = knob_tuple(k, BOUNDED)
        if key not in self._estimated_terms:
            shape, pl, t, tokens, ring = self._shape(k)
            layer = self.model.layer(t, k["tp"], tokens, pl.tp, k["recompute"], sp=k.get("sp", False), ring=ring)
            embed, head = self.model.ends(t, k["tp"], tokens, pl.tp)
            per_layer = layer.f.total + layer.b.total + layer.w.total
            total = k["m"] * (per_layer * self.base.model.n_layers + embed.total + head.total) / min(pl.pp_speed)
            share = sharing(shape, self.hw, pl)
            shared = None if share is None else total / sum(share.capacity)
            params = self._params / (k["tp"] * k["pp"])
            gathers = param_gathers(k["zero"], self.base.parallel.zero3_regather, k["m"])
            world = k["tp"] * k["pp"] * k["dp"] * k.get("cp", 1)
            copies = self.weights(k["precision"]) == (True,)
            opt = optimizer_s(self.model, k["pp"], k["dp"], k["zero"], pl.dp, params, world, gathers, copies=copies)
            self._estimated_terms[key] = shape, pl, layer, total, shared, opt
        return self._estimated_terms[key]

    def step_bound(self, cfg: Config) -> float:
        """The step bound of the layout (plan/bound.py), the cheaper of the weights' precisions it may run with: no
        simulation of it predicts less."""
        end, su = self.pipeline_bound(cfg)
        return end + after_bound(self.model, cfg, su, self.weights(cfg.train.precision))

    def pipeline_bound(self, cfg: Config) -> tuple[float, Setup]:
        """`step_bound`'s pipeline part (what the optimizer step and the closing reductions, never negative, add
        to) and the layout's setup."""
        p, t = cfg.parallel, cfg.train
        key = (p.schedule, p.pp, stages_per_rank(p), t.microbatches)
        if key not in self._shapes:
            self._shapes[key] = compute_shape(self.compute(*key))
        # The layouts come in pairs that differ in ZeRO only, which changes what follows the pipeline only.
        layout = key + (p.tp, p.dp, p.partition, t.recompute, t.precision, p.sequence_parallel)
        if layout not in self._pipeline_bounds:
            self._pipeline_bounds[layout] = pipeline_bound(self.model, cfg, self._shapes[key])
        return self._pipeline_bounds[layout]

    def same_parts(self, a: Config, b: Config) -> bool:
        pl = placement(a.parallel, self.hw)
        return self.model.parts(a, pl) == self.model.parts(b, pl)

    def evaluate(self, cfg: Config, mem: list[int]) -> Candidate:
        pred = predict(self.model, cfg, self.actions, self._sims)
        t = cfg.train
        tokens = t.global_batch * t.seq_len
        world = cfg.parallel.world_size
        flops = model_flops_per_token(cfg.model, t.seq_len) * tokens / pred.step_s
        return Candidate(cfg, pred, mem, tokens / pred.step_s, flops / (world * self.hw.peak_flops(t.precision)))


def plan(
    base: Config,
    hw: Hardware,
    memory: Memory,
    world: int | None = None,
    top: int = 10,
    fixed: dict[str, Any] | None = None,
    prune: bool = True,
) -> Plan:
    """The `top` fastest layouts that fit, fastest first; ValueError naming the binding constraint
    when none does. `fixed`: config keys of KNOB_KEYS held at the given values (the user's choices).
    `prune=False` simulates every layout that fits (the same list, slower: for tests)."""
    world = hw.devices if world is None else world
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive number of devices, got {world!r}")
    if world > hw.devices:
        raise ValueError(
            f"world {world} exceeds the {hw.devices} devices of {hw.name!r} ({hw.nodes} x {hw.devices_per_node})"
        )
    # The search allocates millions of short-lived objects (action lists, simulated events) beside its
    # caches, which hold hundreds of thousands: the cycle collector's full passes over them cost as much as
    # the search itself, and the search makes no garbage that needs them (its caches die with it). It is
    # paused for the search and resumed after, where it was on.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _Search(base, hw, memory, world, top, prune).run(fixed or {})
    finally:
        if collecting:
            gc.enable()


class _Search:
    """One search's state: the layouts built and validated so far, the misfits of each group, the layouts
    found (fastest first) and what the result reports when none is."""

    def __init__(self, base: Config, hw: Hardware, memory: Memory, world: int, top: int, prune: bool) -> None:
        self.base, self.hw, self.world, self.top, self.prune = base, hw, world, top, prune
        self.planner = Planner(base, hw, memory)
        self.memory = self.planner.memory
        self.misfits: dict[tuple, list[dict[str, Any]]] = {}  # per group, knobs found not to fit
        self.fitted: set[tuple] = set()
        self.found: list[Candidate] = []
        self.smallest: tuple[int, int, str] | None = None  # (bytes, check number, layout) of the least misfit
        # Layouts whose weights, optimizer state and activations overflow (MemoryModel.lower_bound) are misfits
        # without their schedule's replay; their full need only names the smallest, so it is asked when read.
        self.lower = getattr(self.memory, "lower_bound", None)
        self.unpriced: list[tuple[int, Config]] = []
        self.problems: list[str] = []
        self.layouts: dict[tuple, Config | str] = {}  # validated layouts, or why not valid
        self.built: dict[tuple, Config] = {}  # layouts built for the step bound, not validated yet
        self.simulated = self.checked = 0
        self.bound = ""
        self.copies = False  # bf16 layouts that do not fit under autocast are tried with working copies (run)

    def run(self, fixed: dict[str, Any]) -> Plan:
        knobs = held_knobs(self.base, self.hw, self.world, fixed)
        # Working copies where autocast does not fit, unless the caller holds the weights' precision.
        self.copies = self.base.train.bf16_weights == "autocast" and "train.bf16_weights" not in fixed
        if not knobs:
            raise ValueError(_no_split(self.base, self.hw, self.world))
        ranked = sorted(knobs, key=self.planner.estimate)  # likely fastest first: the k-th best falls early
        bounds = [self.planner.bound(k) for k in ranked]
        floor = list(itertools.accumulate(reversed(bounds), min))[::-1]
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for k in knobs:
            groups.setdefault(group_key(k), []).append(k)
        for i, k in enumerate(ranked):
            if self.beaten(floor[i]):
                break  # no layout from here on can be predicted faster than the k-th best
            if self.beaten(bounds[i]) or self.step_beaten(k):
                continue
            self.consider(k, groups[group_key(k)])
        return self.result(len(knobs))

    def consider(self, k: dict[str, Any], group: list[dict[str, Any]]) -> None:
        """Simulate the layout of knobs `k` (of `group`) and rank it, unless it does not fit or is not worth it."""
        g = group_key(k)
        if g not in self.misfits:  # first visit: if the group's most frugal variant does not fit, none does
            self.misfits[g] = []
            frugal = most_frugal(k, group)
            # Once a layout is found the misfits no longer name the smallest: the group's test only needs to
            # rule it out, which the lower bound does without the schedule's replay (or leaves to its layouts).
            if frugal in group and self.fits(frugal, full=not self.found) is None and covers(frugal, k):
                return
        if any(knob_key({**k, "recompute": r}) in self.fitted for r in RECOMPUTE[: RECOMPUTE.index(k["recompute"])]):
            return  # recomputation only costs time: it is worth it only where less of it does not fit
        fit = self.fits(k)
        if fit is None:
            if not self.found and not self.bound and (least := self.settled()) is not None:
                self.bound = f"faster layouts need more memory ({least[2]}: {least[0] / GIB:.3g} GiB per device)"
            return
        cfg, per_rank = fit
        self.fitted.add(knob_key(k))
        if k["partition"] == "cost":
            if self.planner.same_parts(cfg, config_of(self.base, {**k, "partition": "params"})):
                return  # the cost-balanced split is the parameter-balanced one: nothing new to rank
        if self.copies and cfg.train.precision == "bf16" and self.own_beaten(cfg):
            return  # its bound before counted the cheaper of its weights' precisions; as it runs, it cannot enter
        self.found.append(self.planner.evaluate(cfg, per_rank))
        self.simulated += 1
        self.found.sort(key=lambda c: c.prediction.step_s)

    def result(self, n_knobs: int) -> Plan:
        if not self.found:
            if (least := self.settled()) is not None:
                raise ValueError(
                    f"no layout fits: the smallest needs {least[0] / GIB:.3g} GiB per device ({least[2]}), "
                    f"the hardware has {self.hw.device_memory_gib:g}"
                )
            why = self.problems[0] if self.problems else "none enumerated"
            raise ValueError(f"no layout of world {self.world} is valid: {why}")
        found = self.found[: self.top]
        _explain(found, self.bound)
        return Plan(found, n_knobs, self.simulated, self.checked)

    def layout(self, k: dict[str, Any]) -> Config | str:
        """The validated layout of knobs `k`, or why it is not valid: built once for the step bound and the
        memory check that both ask for it."""
        key = knob_key(k)
        if key not in self.layouts:
            cfg = self.built.pop(key, None) or config_of(self.base, k)
            try:
                validate_config(cfg, self.world)
                self.layouts[key] = cfg
            except ValueError as e:
                self.layouts[key] = str(e)
        return self.layouts[key]

    def fits(self, k: dict[str, Any], full: bool = True) -> tuple[Config, list[int]] | None:
        """The layout and its bytes per rank (memory is asked once per layout), None where it does not fit.
        `full=False`: only the lower bound is asked; a layout it does not rule out comes back with no bytes.
        A bf16 layout under autocast that does not fit is tried with working copies (`copies`): they hold less
        but change the numbers a run computes, so they are tried only where autocast does not fit (their cost
        differs after the pipeline: cost.optimizer_s; the bounds take the cheaper, `Planner.weights`); a misfit
        is one that fits neither way."""
        if any(covers(x, k) for x in self.misfits.get(group_key(k), ())):
            return None
        cfg = self.layout(k)
        if isinstance(cfg, str):
            self.problems.append(cfg)
            return None
        fit = self._fits(cfg, full)
        if fit is None and self.copies and k["precision"] == "bf16":
            alt = self.layout({**k, "weights": "copies"})
            fit = None if isinstance(alt, str) else self._fits(alt, full)
        if fit is None:
            self.misfits.setdefault(group_key(k), []).append(k)
        return fit

    def _fits(self, cfg: Config, full: bool) -> tuple[Config, list[int]] | None:
        self.checked += 1
        limit = self.hw.device_memory_bytes
        if self.lower is not None and self.lower(cfg, limit) > limit:
            self.unpriced.append((self.checked, cfg))  # its full need is asked only if `smallest` is read
            return None
        if not full and self.lower is not None:
            return cfg, []
        per_rank = [int(e.total) for e in self.memory(cfg)]
        need = max(per_rank)
        if need <= limit:
            return cfg, per_rank
        self.note(need, self.checked, cfg)
        return None

    def note(self, need: int, order: int, cfg: Config) -> None:
        """`smallest`: the least need of the misfits, the first checked of equals."""
        if self.smallest is None or (need, order) < self.smallest[:2]:
            self.smallest = (need, order, _config_label(cfg))

    def settled(self) -> tuple[int, int, str] | None:
        """`smallest` with the misfits found by the lower bound priced in."""
        for order, cfg in self.unpriced:
            self.note(max(int(e.total) for e in self.memory(cfg)), order, cfg)
        self.unpriced.clear()
        return self.smallest

    def beaten(self, bound: float) -> bool:
        top = self.top
        return self.prune and len(self.found) >= top and bound > self.found[top - 1].prediction.step_s * (1 + TIES)

    def own_beaten(self, cfg: Config) -> bool:
        """Whether the step bound of the validated layout `cfg` with its own weights' precision (autocast where
        it fits, else working copies: `fits`) beats the k-th best; their pipeline is the same (cost.py)."""
        if not (self.prune and len(self.found) >= self.top):
            return False
        end, su = self.planner.pipeline_bound(cfg)
        return self.beaten(end + after_bound(self.planner.model, cfg, su))

    def step_beaten(self, k: dict[str, Any]) -> bool:
        # (not `beaten(0.0)`: no bound of 0 beats anything, so it never ran)
        if not (self.prune and len(self.found) >= self.top):
            return False
        # Not validated first: most layouts that get here are pruned by this bound, and the list is full, so an
        # invalid one's reason would never be read (`problems` names only a search that found nothing). A
        # layout the bound does not prune is validated by fits().
        key = knob_key(k)
        cfg = self.layouts.get(key) or self.built.setdefault(key, config_of(self.base, k))
        if isinstance(cfg, str):
            return False  # fits() reports it
        try:
            # The pipeline part alone often prunes: what follows it only adds (floats: adding >= 0 never lowers).
            return self.beaten(self.planner.pipeline_bound(cfg)[0]) or self.beaten(self.planner.step_bound(cfg))
        except ValueError:
            return False  # an invalid layout the bound cannot price: fits() reports it


def _config_label(cfg: Config) -> str:
    p, t = cfg.parallel, cfg.train
    return (
        f"tp{p.tp} pp{p.pp} dp{p.dp} {p.schedule} m{t.microbatches} recompute={t.recompute} zero{p.zero} {t.precision}"
        + (" copies" if t.bf16_weights == "copies" else "")
    )


def _no_split(base: Config, hw: Hardware, world: int) -> str:
    m, t = base.model, base.train
    tps = [tp for tp in divisors(world) if tp <= hw.devices_per_node and hw.devices_per_node % tp == 0]
    return (
        f"world {world} cannot be split: tp must divide {hw.devices_per_node} devices per node (tp in {tps}), "
        f"pp at most model.n_layers={m.n_layers}, and dp = world / (tp x pp) must divide "
        f"train.global_batch={t.global_batch}"
    )


_TERMS = {
    "compute_s": "compute",
    "tp_comm_s": "tensor- and context-parallel communication",
    "bubble_s": "pipeline bubble",
    "dp_reduce_s": "gradient all-reduce",
    "optimizer_s": "optimizer step",
}


def _explain(found: list[Candidate], bound: str) -> None:
    """A reason per candidate: against the runner-up for the first, against the first for the rest,
    the term of the step that differs most."""
    for i, c in enumerate(found):
        if len(found) == 1:
            c.reason = "the fastest" + (f"; {bound}" if bound else "")
            continue
        other = found[1] if i == 0 else found[0]
        mine, theirs = c.prediction.breakdown(), other.prediction.breakdown()
        term = max(_TERMS, key=lambda k: abs(mine[k] - theirs[k]))
        ratio = other.prediction.step_s / c.prediction.step_s - 1
        verb = "less" if mine[term] < theirs[term] else "more"
        head = f"{ratio:+.1%} vs #{2 if i == 0 else 1}" if i == 0 else f"{-ratio / (1 + ratio):.1%} slower than #1"
        c.reason = f"{head}: {verb} {_TERMS[term]} ({mine[term] * 1e3:.3g} vs {theirs[term] * 1e3:.3g} ms)" + (
            f"; {bound}" if i == 0 and bound else ""
        )
