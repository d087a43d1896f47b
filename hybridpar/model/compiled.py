"""`train.compile`: each decoder layer's training forward (and so its backward) through `torch.compile`.

One compiled callable per process, `call(layer, *args)`, is shared by every stage and layer the process
holds: the layer is an argument, not a closure, so dynamo traces the layer's code once and layers of the
same shapes (every decoder layer of a stage, and layers that a live re-partition moves here later) reuse
that graph without recompiling — guards check the module's structure and tensors' shapes, not which
layer it is. The batch dimension is dynamic from the first compile, so unequal microbatches share the
graph too (a microbatch of one sample gets its own: dynamo specialises size 1); a run compiles a handful
of graphs whatever its length; `CompiledLayers.graphs` counts them and the run log reports the count.

Tensor parallelism's collectives (autograd Functions around gloo/NCCL calls, model/tp.py) are traced into
the graph: dynamo turns them into its functional collectives (one graph per rank at tp 2, measured).

What stays eager, by design (graph breaks, `torch.compiler.disable`):
- the zero-bubble split's capture hooks on linear layers (pipeline/split_backward.py): they keep Python
  state per microbatch and register tensor hooks. The linear layers around them then run eagerly too, so
  B still skips the weight-gradient matmuls that W computes (a compiled backward computes all of its
  graph's gradients at once: a linear inside it would have its dW computed in B and again in W).
- ZeRO-3's gathers and frees around each layer (dataparallel/zero3.py): collectives into storages that are
  resized. Dynamo stops before the layer's pre-hook and compiles its forward as a frame of its own, whose
  graph takes the gathered parameters as inputs (the same tensors every step: no recompile).
- ring attention (model/ring_attention.py, parallel.cp > 1): point-to-point transfers around the ring.
- evaluation, sampling and serving (no gradient): eager, so the validation step adds no graph.

Where something eager breaks a layer's graph inside (the split's linears, ring attention), the process's
callable compiles one static graph per microbatch size (`per_size`, see __init__): every recomputation then
runs the graphs its forward ran.

Full and selective activation recomputation checkpoint the compiled call (model/recompute.py): the rerun in
backward calls the same graphs on the same input. Only inductor generates code; `aot_eager` captures and differentiates
the same graphs and runs them with eager kernels (bit-identical to eager where nothing breaks the graph:
the composition check).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

COMPILE_BACKENDS = ("inductor", "aot_eager")


def _call(layer: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    return layer(*args)


class CompiledLayers:
    """`self(layer, *args)` = `layer(*args)`, compiled with `backend`; counts the graphs it compiles and
    the seconds its backend spent compiling forward graphs (backward graphs compile at their first use)."""

    def __init__(self, backend: str, per_size: bool = False) -> None:
        if backend not in COMPILE_BACKENDS:
            raise ValueError(f"train.compile_backend={backend!r}: expected one of {', '.join(COMPILE_BACKENDS)}")
        from torch._dynamo.backends.registry import lookup_backend

        self.backend = backend
        self._compile_graph = lookup_backend(backend)
        self.graphs = 0  # graphs compiled: first compiles, graph-break fragments and recompiles
        self.seconds = 0.0
        self.per_size = per_size
        # Where something eager breaks a layer into several graphs (the split's linear layers, ring
        # attention), dynamo hands the batch size to the graph after a break as a Python int and as tensors
        # that the batch dimension marked dynamic in __call__ does not reach: it specialises them on first
        # sight. A second microbatch size then compiled a dynamic graph beside the static one, and dynamo
        # tries the newest first: a layer recomputed in backward ran another graph than its forward (the
        # static one rebuilds an output that aliases an input by replaying views, the dynamic one calls
        # aten._has_same_storage_numel first), which selective recomputation refuses and full
        # recomputation would rerun in other kernels. `per_size`: one static graph per microbatch size
        # (dynamic=False), whose guards (batch == n) never overlap, so every recomputation runs the graph
        # its forward ran. Measured: all sizes symbolic from the start (dynamic=True) compiled 3x slower
        # (8 graphs in 12 s against one size's 7 in 3.8 s, aot_eager on this CPU); a run has few
        # sizes (a balanced split two), and the count is reported (`compiled_graphs`).
        self._fn = torch.compile(_call, backend=self._counted, dynamic=False if per_size else None)

    def _counted(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        t0 = time.perf_counter()
        self.graphs += 1
        try:
            return self._compile_graph(gm, example_inputs)
        finally:
            self.seconds += time.perf_counter() - t0

    def __call__(self, layer: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        # The batch size dynamic from the first compile: one graph serves every microbatch size (dynamo
        # still specialises a size of 1). Otherwise the second size recompiles, and an activation
        # recomputation of an earlier microbatch in backward would find the newer graph first and rerun
        # other operations than its forward ran: selective recomputation refuses that.
        if args and isinstance(args[0], torch.Tensor) and not self.per_size:
            torch._dynamo.maybe_mark_dynamic(args[0], 0)
        return self._fn(layer, *args)

    def summary(self) -> dict[str, Any]:
        """For the run log and the benchmarks: what was compiled, and how often."""
        return {"backend": self.backend, "graphs": self.graphs, "compile_s": round(self.seconds, 3)}
