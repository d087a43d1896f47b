"""Emulated layer cost (`--emulate.layer_ms`): a named benchmark mode, off by default.

Every decoder layer of a stage costs a fixed duration per sample: a stage's forward of a microbatch
lasts `layers x samples x layer_ms`, its backward twice that (the usual B = 2F; a split backward's B
and W once each). The duration is a floor on the whole compute action, not an addition to it: the
pipeline runtime sleeps until the action has lasted its emulated cost, so the real compute inside it
(a tiny model's, kept well under the cost) and whatever a loaded machine makes it take do not change
the action's length. A sleeping rank needs no core, so 4 ranks on 2 shared cores measure the speeds
the balancer is meant to see, not the contention. `--emulate.slowdown` stretches the action on top
(stretch x the emulated cost). The tensors and the math are untouched. Where the real compute of an
action outgrows its cost, or a loaded machine wakes the rank late, the action lasts longer than the cost;
`--emulate.layer_timing emulated` makes the monitor and the balancer read the emulated cost itself
instead (the runtime records it per action), so a test of the policy sees the emulated speeds exactly
however loaded the machine is, while step times stay measured. The cost reads the stage's
current layer count at each action, so it follows layers that move. The run entry attaches it to the
trainer's runtime (attach.py), never the trainer itself.
"""

from __future__ import annotations

from typing import Any, Callable


def attach_layer_cost(runtime: Any, layer_ms: float, report: bool = False) -> Callable[[], None]:
    """Make each compute action of `runtime` (a PipelineRuntime) last at least `layer_ms` per layer and
    sample (backward twice that), and with `report` record that emulated time per action; returns the
    function that takes the cost off (nothing at 0)."""
    if layer_ms <= 0:
        return lambda: None

    def cost(stage: int, samples: int) -> float:  # one forward's seconds
        return len(runtime.stages[stage].layer_ids) * samples * layer_ms / 1000.0

    runtime.emulated_cost, runtime.report_emulated = cost, report

    def detach() -> None:
        runtime.emulated_cost, runtime.report_emulated = None, False

    return detach
