"""How a run enters emulation: the run entry (run/train.py) asks here for what the `[emulate]` keys turn
on and hands it over, so the trainer and the resilience session hold no emulation code of their own.

- `emulated_devices`: an attachment for `Trainer.attach` (slow ranks, `emulate.slowdown`, and slowdowns
  shaped in time, `emulate.drift` and `emulate.spike`, whose factors multiply; a slow pipeline link,
  `emulate.slow_link`; fixed layer
  costs, `emulate.layer_ms`). `attach` re-applies it when a layout change rebuilds the trainer's pieces.
- `fault_injector`: the injector of `emulate.fault`, for the resilience session's probe, which fires it at
  each phase (resilience/probe.py).

Both do nothing when their keys are off, the default. `emulate.memory_limit` is not here: it is a limit of
the activation meter, which counts those bytes anyway (pipeline/activation_meter.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from hybridpar.config import Config
from hybridpar.emulate.faults import Injector, parse_faults
from hybridpar.emulate.layer_cost import attach_layer_cost
from hybridpar.emulate.profiles import SHAPES, parse_shaped, shaped_factor
from hybridpar.emulate.slow_link import link_delays
from hybridpar.emulate.slowdown import SlowdownPlan
from hybridpar.topology.mesh import Topology
from hybridpar.trainer.step import Attachment, Trainer


def emulated_devices(cfg: Config, topo: Topology) -> Attachment:
    """The trainer attachment of `emulate.slowdown` and `emulate.layer_ms` (ValueError naming the key for
    a bad slowdown spec)."""
    factor = rank_factor(cfg, topo.dims.world_size)
    layer_ms = cfg.emulate.layer_ms
    delays = _slow_link(cfg, topo) if cfg.emulate.slow_link.strip() else {}

    def attach(trainer: Trainer) -> Callable[[], None]:
        undo = [attach_layer_cost(trainer.runtime, layer_ms, cfg.emulate.layer_timing == "emulated")]
        if factor is not None:
            undo.append(_stretch_steps(trainer, factor))
        if delays:
            trainer.p2p.link_delay_s = dict(delays)
            undo.append(trainer.p2p.link_delay_s.clear)

        def detach() -> None:
            for u in undo:
                u()

        return detach

    return attach


def rank_factor(cfg: Config, world: int) -> Callable[[int, int], float] | None:
    """factor(rank, step): how many times slower `emulate.slowdown`, `emulate.drift` and `emulate.spike`
    together make a rank at a step (they multiply); None when all three are off."""
    plan = SlowdownPlan.from_config(cfg.emulate.slowdown, world)
    shaped = tuple(e for shape in SHAPES for e in parse_shaped(shape, getattr(cfg.emulate, shape), world))
    if not (plan or shaped):
        return None
    return lambda rank, step: plan.factor(rank, step) * shaped_factor(shaped, rank, step)


def _slow_link(cfg: Config, topo: Topology) -> dict[int, float]:
    """This rank's added seconds per message received, by sender (`emulate.slow_link`)."""
    pp, me = topo.dims.pp, topo.pp_rank
    peers = {r: topo.pp_peer(r) for r in (me - 1, me + 1) if 0 <= r < pp}
    return link_delays(cfg.emulate.slow_link, cfg.emulate.link_ms, pp, me, peers)


def _stretch_steps(trainer: Trainer, factor: Callable[[int, int], float]) -> Callable[[], None]:
    """Before each step, set the runtime's stretch to this rank's factor at that step (the runtime sleeps
    `stretch - 1` times each compute action's own time); returns the function that stops it."""
    step, rank = trainer.step, trainer.topo.rank

    def stretched(s: int) -> dict[str, Any]:
        trainer.runtime.stretch = factor(rank, s)
        return step(s)

    setattr(trainer, "step", stretched)  # on this instance only: deleting it uncovers the class's method
    return lambda: delattr(trainer, "step")


def fault_injector(cfg: Config, topo: Topology, ck_dir: Path) -> Injector | None:
    """This rank's injector of `emulate.fault` (ValueError naming the entry), None when no fault is given."""
    faults = parse_faults(cfg.emulate.fault, topo.dims.world_size)
    return Injector(faults, topo.rank, Path(cfg.run_dir), ck_dir) if faults else None
