"""train.compile and train.fused_adamw without processes: a compiled model's gradients against eager ones
(aot_eager: dynamo's capture and AOT autograd's differentiation, run with eager kernels, so equal bit for
bit), how many graphs a model compiles (one for all its layers and batch sizes; a moved layer adds none),
the backend's check, and fused AdamW against foreach. The inductor-generated kernels' figures and
their distance from eager are measured by `hybridpar bench compile` (docs/performance.md); the compiled
pipeline and zero-bubble split against one device: tests/test_equivalence.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpar.config import Config
from hybridpar.config.validate import validate
from hybridpar.model.compiled import CompiledLayers
from hybridpar.model.optim import make_optimizer
from hybridpar.model.reference import TOL, reference, tiny_config, working_copy
from hybridpar.model.registry import build_full_model
from hybridpar.pipeline.split_backward import WeightGradDeferral


def _grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).float().pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("weights", ["fp32", "copies"])
def test_compiled_layers_equal_eager_with_few_graphs(weights: str) -> None:
    """copies: bf16 working copies (the graph takes bf16 weights and a bf16 residual stream; its bf16 weight
    gradients are widened into the fp32 .grad outside it, by AccumulateGrad): bit-identical too."""
    torch._dynamo.reset()  # dynamo's per-function state (sizes seen so far) from other tests in this process
    copies = dict(precision="bf16", bf16_weights="copies") if weights == "copies" else {}
    cfg = tiny_config(model=dict(n_layers=3), train=copies)
    eager, compiled = (working_copy(build_full_model(cfg.model, 0), cfg) for _ in range(2))
    # Full recomputation: the checkpoint reruns the compiled layer in backward.
    eager.recompute = compiled.recompute = "full"
    compiled.compiled = layers = CompiledLayers("aot_eager")
    g = torch.Generator().manual_seed(0)
    for batch in (3, 2):  # the batch size is dynamic from the start: one graph for both
        x = torch.randint(0, cfg.model.vocab_size, (batch, 16), generator=g)
        for a, b in zip(_grads(eager, x), _grads(compiled, x)):
            assert a.dtype == torch.float32 and torch.equal(a, b)
    assert layers.graphs == 1, layers.summary()
    # A layer that arrives from elsewhere (live re-partition builds it anew) runs the same graphs.
    moved = copy.deepcopy(compiled.layers["0"])
    compiled.set_layers({**compiled.layers, "8": moved})
    _grads(compiled, x)
    assert layers.graphs == 1, layers.summary()
    with torch.no_grad():  # evaluation stays eager: no graph for it
        compiled(x)
    assert layers.graphs == 1


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


def _forward_all(model: torch.nn.Module, split: WeightGradDeferral, xs: dict[str, torch.Tensor]) -> dict:
    ys = {}
    for k, x in xs.items():
        split.key = k
        ys[k] = model(x).pow(2).mean()
        split.key = None
    return ys


def test_zero_bubble_split_when_compiled() -> None:
    """Under the B/W split the linear layers run eagerly between compiled regions: B computes the same
    matmuls as eager B (input gradients only), none of the dW products W computes. Then selective
    recomputation with two microbatch sizes in flight (F, F, B, B, as ZB-H1 orders them): each layer's
    recomputation in B must run the graphs its forward ran. With the size specialised after a graph break,
    the second size compiled a dynamic graph that the first microbatch's recomputation took, which
    dispatched one more aten._has_same_storage_numel, and selective recomputation refused; now each size
    has static graphs of its own (model/compiled.py, `per_size`)."""
    torch._dynamo.reset()  # graphs other tests compiled from the same code
    cfg = tiny_config(model=dict(n_layers=2))
    g = torch.Generator().manual_seed(0)
    xs = {k: torch.randint(0, cfg.model.vocab_size, (b, 16), generator=g) for k, b in (("m0", 2), ("m1", 3))}
    counts, grads = [], []
    for compiled in (False, True):
        model = build_full_model(cfg.model, 0)
        model.compiled = layers = CompiledLayers("aot_eager", per_size=True) if compiled else None
        split = WeightGradDeferral(model)
        y = _forward_all(model, split, {"m0": xs["m0"]})["m0"]
        with _CountMatmuls() as mm:  # a dispatch mode: outside any recomputation, which it would make eager
            assert split.backward_input(y, None, None, "m0") is None
        split.weight("m0")
        counts.append(mm.n)
        seen = layers.graphs if compiled else 0
        model.recompute = "selective"
        ys = _forward_all(model, split, xs)
        for k in xs:
            split.backward_input(ys[k], None, None, k)
            split.weight(k)
        assert 2 * seen == (layers.graphs if compiled else 0), (seen, layers.summary())  # size 3's, as many
        grads.append([p.grad for p in model.parameters()])
        split.detach()
        assert "forward" not in vars(model.layers["0"].mlp.up_proj)  # detach restores the class's
    assert counts[0] == counts[1], counts
    # Not bit for bit: between graph breaks AOT autograd's decompositions round some products differently.
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_compile_composes_with_what_it_once_refused_and_checks_its_backend() -> None:
    """Selective recomputation, ZeRO-3 over dp > 1 and context parallelism were refused before launch until
    each was made to compose (docs/compile.md); their runs: tests/test_equivalence.py."""
    for over in (dict(train=dict(recompute="selective")), dict(parallel=dict(dp=2, zero=3)), dict(parallel=dict(cp=2))):
        cfg = tiny_config(**over)
        cfg.train.compile = True
        validate(cfg)
    bad = Config.from_dict({**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "compile_backend": "eager"}})
    with pytest.raises(ValueError, match="train.compile_backend"):
        validate(bad)


def test_fused_adamw_is_exact() -> None:
    """torch's fused AdamW computes the same update in another order of operations. From the same gradients
    the two differ by rounding only (measured: 6e-8 on the default model after 3 steps, bench compile), while
    a wrong update (weight decay or bias correction missed, another lr) moves parameters by about lr = 3e-3
    per step. The fp64 criterion of whole runs: bench compile's records."""
    small = dict(n_layers=2)
    plain = tiny_config(model=small, train=dict(fused_adamw="off"))
    fused = tiny_config(model=small, train=dict(fused_adamw="on"))
    assert make_optimizer(build_full_model(plain.model, 0).named_parameters(), fused.train).defaults["fused"]
    assert not make_optimizer(build_full_model(plain.model, 0).named_parameters(), plain.train).defaults["fused"]
    losses, _, ref_state = reference(plain)
    f_losses, _, state = reference(fused)
    assert all(abs(a - b) <= TOL for a, b in zip(losses, f_losses)), (losses, f_losses)
    worst = max(float((state[n] - ref_state[n]).abs().max()) for n in state)
    assert worst <= 1e-6, f"fused AdamW differs from foreach by {worst}"
