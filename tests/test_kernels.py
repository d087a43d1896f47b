"""Exactness on other kernels (issue 33): torch's libraries pick their code for the CPU they start on
(AVX2, AVX-512 with native bf16 and AMX, or none), and each rounds differently. The exactness tests most
sensitive to rounding run again in a fresh interpreter limited to each other kernel choice a machine can
be limited to (hybridpar/model/reference.py: KERNELS), references and ranks alike, so the criterion is shown to
hold on machines other than this one. The full set under every choice: hybridpar/bench/exactness.py and
docs/exactness.md.

Each choice runs the layouts whose arithmetic it changes, each class of code path (tensor parallelism
with sequence parallelism, pipelines with the zero-bubble B/W split, data parallelism with ZeRO, bf16
working copies, context parallelism) at least once, to keep the suite's time:
- AVX2 changes everything: ATen's vector code (norms, activations, softmax, attention, AdamW), MKL's fp32
  GEMMs and oneDNN's bf16 matmuls. The odd shapes (fp32: tp=3 with and without sequence parallelism, pp=3
  under ZB-H1, dp=3) and the 2-rank bf16 layouts (ZB-V, interleaved 1F1B, working copies under ZeRO-2, with
  context parallelism and full recomputation, and GPT-2's LayerNorm, GELU and biases). What the 4-rank bf16
  layouts add is tensor parallelism in bf16: the same oneDNN matmuls on the shards' shapes, whose sum over
  ranks is gloo's (not a kernel choice), and whose fp32 arithmetic the odd shapes hold under AVX2.
- AVX-512 without AMX changes only oneDNN's bf16 matmuls (ATen and MKL run as natively): the 4-rank bf16
  layouts hold every kind of matmul (autocast and working copies, the tensor-parallel shards with sequence
  parallelism, the split B and W of ZB-H1, ring attention's blocks, dp=2). The 2-rank ones add no other
  kind: ZeRO's sharded AdamW and gradient reductions run no matmul, other schedules and full
  recomputation run the same matmuls in another order, and GPT-2's biases are added to the same dot
  products."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridpar.model.reference import KERNELS
from tests.test_precision import LAYOUTS as BF16_LAYOUTS

ROOT = Path(__file__).resolve().parents[1]
FP32 = "tests/test_equivalence.py::test_odd_shapes"  # 4 layouts (tp3 with and without sequence parallelism)
BF16 = "tests/test_precision.py::test_bf16_layouts_match_one_device_bf16"  # BF16_LAYOUTS (autocast and working copies)
# Each choice runs what it changes (the docstring says why these cover every class of code path), to keep
# the suite's time. No vectorization at all (KERNELS' "scalar": no machine we run on) costs a minute of the
# suite and is left to `hybridpar bench exactness`, which runs every set under every choice.
LANES = {"avx2": [FP32, f"{BF16}[world2]"], "avx512-no-amx": [f"{BF16}[world4]"]}
# A lane's interpreter: ATen's kernel choice on its first line, then pytest (one torch import, not two).
LANE = "import sys, pytest, torch; print(torch.backends.cpu.get_cpu_capability(), flush=True); sys.exit(pytest.main())"
LANE_TIMEOUT_S = 280  # the lanes together: pytest's own timeout (300 s) bounds the first test's setup too


@pytest.fixture(scope="module")
def lanes(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, tuple[int, str, str]]:
    """The lanes this session runs, started together: {lane: (exit code, its stdout and stderr)}. A lane's
    interpreter spends much of its time in one thread (collection, its one-device references) while the other
    core idles; together they share both cores. Each is still an interpreter of its own with its kernels."""
    here = [item for item in request.session.items if item.path == request.path and hasattr(item, "callspec")]
    wanted = [k for k in LANES if any(item.callspec.params.get("kernels") == k for item in here)]
    out = tmp_path_factory.mktemp("lanes")
    procs = {}
    try:
        for k in wanted:
            env = {**os.environ, **KERNELS[k]}
            # `-n 0`: the lane's tests in its own interpreter, under its kernels, printing their margins (`-s`).
            cmd = [sys.executable, "-c", LANE, "-q", "-s", "-n", "0", "-p", "no:cacheprovider", *LANES[k]]
            # Files, not pipes: neither lane can block on a full pipe while the other is waited for.
            with (out / f"{k}.out").open("w") as o, (out / f"{k}.err").open("w") as e:
                procs[k] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=o, stderr=e, text=True)
        deadline = time.monotonic() + LANE_TIMEOUT_S
        codes = {k: p.wait(max(0.0, deadline - time.monotonic())) for k, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:  # timed out (or pytest's timeout): the lane ends, its ranks with it
                p.kill()
                p.wait(30)
    return {k: (codes[k], (out / f"{k}.out").read_text(), (out / f"{k}.err").read_text()) for k in procs}


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", list(LANES))
def test_exactness_holds_under_another_kernel_choice(kernels: str, lanes: dict[str, tuple[int, str, str]]) -> None:
    lane = LANES[kernels]
    code, stdout, stderr = lanes[kernels]
    capability = stdout.partition("\n")[0]
    margins = [line for line in stdout.splitlines() if "worst margin" in line]
    print(f"{kernels} (ATen {capability}):", *margins, sep="\n  ")
    assert code == 0, f"under {kernels} ({KERNELS[kernels]}):\n" + stdout[-4000:] + stderr[-2000:]
    bf16 = sum(len(BF16_LAYOUTS[key]) for key in BF16_LAYOUTS if f"{BF16}[{key}]" in lane)
    assert len(margins) == 4 * (FP32 in lane) + bf16, stdout[-2000:]  # one per layout
