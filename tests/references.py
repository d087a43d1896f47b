"""The single-device references the equivalence tests hold every layout to, computed once per test process (each
of the suite's two workers computes those its files ask for).

The caches live here, in a module that pytest never collects: tests/test_equivalence.py is both a test
file and the other files' helper, and without a tests/__init__.py pytest imports it as `test_equivalence`
while the files that import it by package name get a second copy, `tests.test_equivalence`, with caches
of its own. Every reference (a yardstick is 13 trainings) was then computed once per copy."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator

import torch

from hybridpar.config import Config
from hybridpar.model.reference import Yardstick, reference, yardstick

_REF: dict[str, tuple] = {}  # the reference depends on model, train and data settings only


def _math(cfg: Config) -> tuple:
    """What the single-device reference depends on: model, data, and train less the settings that change how
    the parallel run computes, not what: compilation, recomputation, and the split of a step's batch into
    microbatches (the reference trains on each step's whole batch at once; model/reference.py)."""
    t = dataclasses.replace(
        cfg.train, compile=False, compile_backend="inductor", recompute="none", microbatches=1, microbatch_sizes=None
    )
    return (cfg.model, t, cfg.data)


def ref_for(cfg: Config, dtype: torch.dtype = torch.float32, accumulate: int = 1, order: int | None = None) -> tuple:
    key = repr((*_math(cfg), dtype, accumulate, order))
    if key not in _REF:
        _REF[key] = reference(cfg, dtype, accumulate, order=order)
    return _REF[key]


_STICKS: dict[str, Yardstick] = {}


def yardstick_for(cfg: Config) -> Yardstick:
    """The fp64 run of `cfg`'s training and the noise of single-process runs in other orders."""
    key = repr(_math(cfg))
    if key not in _STICKS:
        _STICKS[key] = yardstick(cfg, runs=lambda c, dt, k, o: ref_for(c, dt, k, o))
    return _STICKS[key]


@contextlib.contextmanager
def computing(cfgs: list[Config]) -> Iterator[None]:
    """The yardsticks (and so the references) of `cfgs`, computed in a thread of this process while the block
    runs a launch: its ranks are processes of their own, and this one only waited for them. Each is the same
    single-threaded computation in either thread (every random draw has a generator of its own). The block
    reads no reference; one that failed fails the block's end."""
    failed: list[BaseException] = []

    def compute() -> None:
        try:
            for cfg in cfgs:
                yardstick_for(cfg)  # its runs include the reference itself (ORDERS' first)
        except BaseException as e:
            failed.append(e)

    worker = threading.Thread(target=compute, name="references", daemon=True)
    worker.start()
    try:
        yield
    finally:
        worker.join()
    if failed:
        raise failed[0]


def check_fp64(label: str, state: dict[str, torch.Tensor], cfg: Config) -> None:
    """DESIGN.md's parameter criterion (issues 19, 33): fp32 runs that differ only in the order of their
    sums (a microbatch split, a tensor-parallel reduction) differ by up to 3e-5 after a few AdamW steps, so
    a fixed tolerance both fails exact layouts and passes wrong ones at small lr. Instead each parameter's
    distance to an fp64 run of the same training (largest element and root-mean-square) is held to the
    largest of single-process runs in other orders, times a factor derived for a stated false-alarm rate
    (hybridpar/model/reference.py). A real error moves parameters by about lr = 3e-3 per step, far beyond."""
    stick = yardstick_for(cfg)
    print(f"fp64 criterion {label}: worst margin {max(stick.margins(state).values()):.3f}")  # shown by -s
    failures = stick.failures(state)
    assert not failures, f"{label}: " + "; ".join(failures)
