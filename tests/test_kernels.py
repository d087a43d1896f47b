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


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", list(LANES))
def test_exactness_holds_under_another_kernel_choice(kernels: str) -> None:
    env = {**os.environ, **KERNELS[kernels]}
    lane = LANES[kernels]
    cmd = [sys.executable, "-c", LANE, "-q", "-s", "-p", "no:cacheprovider", *lane]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    capability = proc.stdout.partition("\n")[0]
    margins = [line for line in proc.stdout.splitlines() if "worst margin" in line]
    print(f"{kernels} (ATen {capability}):", *margins, sep="\n  ")
    assert proc.returncode == 0, f"under {kernels} ({KERNELS[kernels]}):\n" + proc.stdout[-4000:] + proc.stderr[-2000:]
    bf16 = sum(len(BF16_LAYOUTS[key]) for key in BF16_LAYOUTS if f"{BF16}[{key}]" in lane)
    assert len(margins) == 4 * (FP32 in lane) + bf16, proc.stdout[-2000:]  # one per layout
