"""The GPU side of the cost model: what fraction of a datasheet figure a GPU's kernels and collectives reach.

A hardware file's optional `[gpu_calibration]` table (plan/hardware.py) holds five global numbers per GPU type,
each with its source and date, and the attention kernel of the software that ran on it:

    matmul_fraction       the best GEMM rate over the datasheet peak (large, well-shaped GEMMs)
    memory_fraction       achievable memory bandwidth over the datasheet's (a streaming copy)
    attention_fraction    a fused (flash) attention kernel's forward + backward rate over the peak, counted
                          as its authors count it (causal: the unmasked half of the score matrix)
    intra_bus_fraction    NCCL all-reduce bus bandwidth over the intra-node link's datasheet bandwidth
    inter_bus_fraction    the same over the inter-node link (the GPU's share of the NICs)
    attention_kernel      "flash" (one fused kernel: no score matrix in memory) or "unfused" (two batched
                          GEMMs with a fused scale-mask-softmax and dropout between them, as Megatron-LM
                          ran before flash attention, 2021-2022)
    overlap               (optional, default none) which communication the cluster's training software
                          runs behind compute, a fact of that software like the attention kernel (OVERLAPS)
    tp_comm_efficiency    (optional, default 1) under `tp_comm` overlap, the overlap efficiency of the
                          software's GEMM-collective pairs as Flux defines it (Chang et al. 2024,
                          arXiv:2406.06858 Sec. 2.3): 1 - what the pair takes beyond the GEMM alone, over the
                          collective alone. It counts the GEMM's own slowdown beside the collective, and is
                          negative where the pair is slower than the two run one after the other. 1 hides a
                          collective up to its GEMM's time (exposed_tp_comm)
    sp_backward           (optional, default "saved") what a column-parallel layer's backward does for its
                          weight gradient under sequence parallelism (SP_BACKWARDS): "saved", the gathered
                          input was kept (hybridpar's runtime), or "regather", only this rank's 1/tp slice was
                          kept and the whole input is all-gathered again (Megatron-LM, Megatron-Core)
    cp_comm               (optional, default "ring") how context parallelism moves keys and values (CP_COMMS):
                          "ring", each block's hop behind the previous block's attention (hybridpar's
                          model/ring_attention.py), or "allgather", the whole sequence's keys and values gathered
                          before attention and their gradients reduce-scattered after it, in the critical path
                          (Llama 3, arXiv:2407.21783 Sec. 3.3.2)
    grad_accumulation     (optional, default "fused") how each microbatch's weight gradients reach the
                          accumulation buffer (GRAD_ACCUMULATIONS): "fused", into an fp32 buffer inside the
                          weight-gradient GEMM (Megatron's gradient_accumulation_fusion: no extra pass);
                          "separate", an elementwise add of the bf16 gradient into the fp32 buffer after it
                          (PyTorch's autograd and FSDP); "separate-half", the same into a buffer in the compute
                          precision, which the data-parallel reduction then moves (Megatron-LM's fp16 runs before
                          2022-09 without --accumulate-allreduce-grads-in-fp32, DeepSpeed's fp16 engine)
    p2p                   (optional, default "async") how the pipeline's hand-offs run (P2PS): "async", posted
                          and left to complete while the sender computes (hybridpar's runtime, Megatron-Core,
                          Llama 3), or "blocking", the sender waits for each transfer to complete and, without
                          sequence parallelism, each tp rank sends its 1/tp slice that the receiving stage
                          all-gathers (Megatron-LM's and DeepSpeed's pipelines of 2021-2022)
    elementwise           (optional, default "fixed") what the memory-bound work around the GEMMs is (ELEMENTWISE):
                          "fixed", the element counts of an unfused Llama block (cost.REPLICATED_ELEMENTS and
                          its kin) and one AdamW pass, the fused kernels of the published clusters' software;
                          "counted", hybridpar's own eager runtime, its aten ops' bytes counted on its own modules
                          under the run's precision, recomputation and AdamW (plan/traffic.py)
    kernel_floor_us       (optional, default 0: none) the device's time per kernel too small to be bound by its
                          bytes: 1-element adds launched eagerly, queued behind a sleeping kernel, CUDA events
                          around them (no host in the loop); measured only by `plan --probe --hardware`
    dispatch_us           (optional, default 0: none) the host's time to dispatch one eager op: the same add
                          called back to back from Python, the host's clock around the enqueue; measured only
                          by `plan --probe --hardware`
    matmul_table          (optional) rows [m, n, k, fraction]: a full grid of GEMM shapes, each one's bf16 rate
                          over the peak, measured by `plan --probe --hardware` on a CUDA device (plan/gpu_probe.py,
                          plan/matmul_table.py); matmul_fraction is then its best row
    source, date          where each number comes from, and when

From them, with no further constant:

* a GEMM (m, n, k) runs at `matmul_efficiency`: where the calibration has a measured `matmul_table`, its
  fraction read from the table (interpolated between the grid's shapes) over matmul_fraction; else the
  roofline, min(1, intensity / ridge) of the matmul fraction, where intensity is its FLOPs over the bytes of
  its three operands and the ridge is the achievable FLOP rate over the achievable memory bandwidth (Williams
  et al. 2009, "Roofline", CACM 52(4)). It rises with each of m, n, k and never exceeds `matmul_fraction`: a
  projection of thousands of tokens is at the matmul fraction, the unfused attention's per-head products
  (k = head_dim) are below it;
* memory-bound work (norms, activations, residuals, softmax, dropout, the optimizer) moves its bytes at
  memory_fraction of the bandwidth;
* where the elementwise work is "counted" (hybridpar's eager runtime, whose ops traffic.py counts), a pass's
  kernels are priced too (`launch_s`): the device runs its GEMMs, attention and counted bytes plus one
  kernel_floor_us per counted kernel (a kernel's fixed start-up and drain beside its bytes' time: a large one's is
  in its measured rate already, so GEMMs and attention take none); the host dispatches every op, counted and
  GEMM alike, at dispatch_us; the CUDA stream queues what the host enqueued, so the two overlap and the pass takes
  the longer. Taken per pass (a layer's forward, its backward), the ends apart: a host ahead during one pass may
  feed the device in the next, so this errs long where the passes differ in which bounds them. A compiled run
  keeps none of it (its kernels are not the counted ones);
* a ring collective's step moves bytes at the bus fraction of its link's bandwidth (nccl-tests' busbw is
  exactly what a ring step achieves: algbw x 2 (n-1)/n for an all-reduce), and so does a pipeline hand-off.

The fractions are measured in bf16 (the published runs' precision); an fp32 or tf32 run takes the same fraction of
its own peak, an assumption no source here measured.

Without the table the cost model takes the datasheet figures as they stand (optimistic on a GPU); CPU hosts
use their probe's measured `[calibration]` instead (plan/calibrate.py), and nothing here applies to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hybridpar.config import ModelConfig
from hybridpar.plan.matmul_table import MatmulTable, parse_matmul_table

FRACTIONS = ("matmul_fraction", "memory_fraction", "attention_fraction", "intra_bus_fraction", "inter_bus_fraction")
KERNELS = ("flash", "unfused")
# Communication a GPU training stack can run behind compute (Megatron-Core's --tp-comm-overlap,
# --overlap-grad-reduce, --overlap-param-gather; Llama 3's stack likewise, arXiv:2407.21783 Sec. 3.3.2):
#   tp_comm       a layer's tensor-parallel collectives, each chunked against the one GEMM beside it: what
#                 exceeds that GEMM is exposed, and at least 1 - tp_comm_efficiency of it (exposed_tp_comm)
#   grad_reduce   the data-parallel gradient reduction, bucket by bucket as the stage's last backward produces
#                 its gradients: it may start when that backward starts instead of when it ends
#   param_gather  the sharded optimizer's all-gather of the updated weights, in the compute precision (the
#                 bf16 model copy; fp32 masters stay sharded), dispatched at the next step's start: hidden
#                 behind what the rank does before its first forward ends (its pipeline fill and that forward)
OVERLAPS = ("tp_comm", "grad_reduce", "param_gather")
# What a column-parallel layer's weight gradient reads under sequence parallelism (Korthikanti et al. 2022,
# arXiv:2205.05198 Sec. 4.2.2): "saved", the all-gathered input its forward kept (hybridpar's model/tp.py), or
# "regather", the rank's 1/tp slice, all-gathered again in the backward (Megatron's
# LinearWithGradAccumulationAndAsyncCommunication.backward, megatron/core/tensor_parallel/layers.py): the
# backward then moves 1.5x the forward's tensor-parallel bytes.
SP_BACKWARDS = ("saved", "regather")
# Context parallelism's key/value traffic: "ring" (hybridpar: each hop hidden behind a block's attention, only
# what outlasts it exposed) or "allgather" (Llama 3 Sec. 3.3.2: "we first all-gather the key (K) and value (V)
# tensors, and then compute attention output for the local query (Q) tensor chunk ... the all-gather
# communication latency is exposed in the critical path"; the backward reduce-scatters their gradients).
CP_COMMS = ("ring", "allgather")
# Where each microbatch's weight gradients are summed: "fused" into the weight-gradient GEMM (its epilogue reads
# and writes the fp32 buffer: Megatron's --gradient-accumulation-fusion, on by default where gradients are fp32);
# "separate", a pass over the buffer per microbatch: read the bf16 gradient (2 bytes), read and write the fp32 sum
# (4 + 4) per parameter; "separate-half", that pass over a buffer in the compute precision (2 + 2 + 2 bytes in
# fp16), the buffer the data-parallel reduction moves (2 bytes a parameter where fp32 buffers move 4). Megatron-LM
# until 2022-09 fused only into fp32 buffers (megatron/arguments.py: "Gradient accumulation fusion ... is supported
# only with fp32 gradient accumulation"), and its fp16 runs accumulate in fp16 unless given
# --accumulate-allreduce-grads-in-fp32 (forced only for bf16): DDP's hook `param.main_grad.add_(param.grad.data)`.
GRAD_ACCUMULATIONS = ("fused", "separate", "separate-half")
# The pipeline's hand-offs: "async" (the simulator's default: a send is posted and the sender computes on) or
# "blocking": Megatron-LM's _communicate (megatron/p2p_communication.py, 2021-2022) waits on every request of
# torch.distributed.batch_isend_irecv and then synchronizes the device; DeepSpeed's pipeline engine
# (deepspeed/runtime/pipe/p2p.py) refuses async_op and sends with dist.send. Both split the activation over the
# tensor-parallel ranks and all-gather it at the receiver (Megatron's --scatter-gather-tensors-in-pipeline,
# on by default; DeepSpeed's is_pipe_partitioned), unless sequence parallelism has split it already.
P2PS = ("async", "blocking")
# The memory-bound work's bytes: "fixed" counts per token and parameter written for an unfused Llama block under
# fused kernels (cost.py's REPLICATED_ELEMENTS, ADAMW_BYTES: Megatron's and DeepSpeed's software), "counted" the
# bytes hybridpar's eager runtime moves, counted op by op on its own modules (plan/traffic.py): autocast's casts,
# its unfused elementwise ops and gradient accumulation, and torch's AdamW as train.fused_adamw picks it.
ELEMENTWISE = ("fixed", "counted")
# The optional keys naming a fact of the software: their choices, the default first.
OPTIONAL_CHOICES = {
    "sp_backward": SP_BACKWARDS,
    "cp_comm": CP_COMMS,
    "grad_accumulation": GRAD_ACCUMULATIONS,
    "p2p": P2PS,
    "elementwise": ELEMENTWISE,
}
# Unfused attention's memory traffic per score element (2-byte elements), counted on Megatron-LM's kernels:
# forward, the fused scale-mask-softmax reads the scores and writes the probabilities (2), dropout reads them
# and writes its output and a one-byte mask (2.5); backward, dropout's reads the gradient and the mask and writes
# (2.5), softmax's reads the probabilities and the gradient and writes (3).
SOFTMAX_FORWARD_ACCESSES = 4.5
SOFTMAX_BACKWARD_ACCESSES = 5.5
# A flash kernel's backward recomputes the scores (QK^T) before its four gradient products: 2.5 forwards of
# FLOPs where an unfused backward has 2. attention_fraction is a forward + backward rate in that count (the
# FlashAttention benchmark's, benchmarks/benchmark_flash_attention.py: 3.5 forwards' FLOPs), so the cost model's
# backward, twice the forward's matmul time, takes this half forward more.
FLASH_BACKWARD_RECOMPUTE = 0.5
# The per-kernel figures (microseconds): the device's floor per kernel, the host's dispatch per eager op. Absent
# means 0: no kernel is priced. The bound catches a figure written in seconds or nanoseconds: eager PyTorch's are
# a few to tens of microseconds.
KERNEL_FIGURES = ("kernel_floor_us", "dispatch_us")
KERNEL_US_MAX = 1000.0
# tp_comm_efficiency's range: at most 1 (a collective hidden whole), and a bound below for typos: the lowest
# Flux measured for Transformer Engine's pairs is -3.25 (A100 NVLink, decoding shapes).
TP_COMM_EFFICIENCY_MIN = -4.0


@dataclass(frozen=True)
class GpuCalibration:
    matmul_fraction: float
    memory_fraction: float
    attention_fraction: float
    intra_bus_fraction: float
    inter_bus_fraction: float
    attention_kernel: str
    source: str
    date: str
    overlap: tuple[str, ...] = ()
    sp_backward: str = "saved"
    cp_comm: str = "ring"
    grad_accumulation: str = "fused"
    p2p: str = "async"
    elementwise: str = "fixed"
    matmul_table: MatmulTable | None = None
    tp_comm_efficiency: float = 1.0
    kernel_floor_us: float = 0.0
    dispatch_us: float = 0.0

    def to_toml(self) -> str:
        nums = "\n".join(f"{k} = {getattr(self, k)!r}" for k in FRACTIONS)
        text = lambda s: '"""' + s.replace("\\", "\\\\").replace('"""', '\\"""') + '"""'  # noqa: E731
        over = f"overlap = {list(self.overlap)!r}\n".replace("'", '"') if self.overlap else ""
        for key, default in OPTIONAL_CHOICES.items():
            over += f'{key} = "{getattr(self, key)}"\n' if getattr(self, key) != default[0] else ""
        over += f"tp_comm_efficiency = {self.tp_comm_efficiency!r}\n" if self.tp_comm_efficiency != 1.0 else ""
        for key in KERNEL_FIGURES:
            over += f"{key} = {getattr(self, key)!r}\n" if getattr(self, key) else ""
        over += self.matmul_table.to_toml() if self.matmul_table is not None else ""
        return (
            f'\n[gpu_calibration]\n{nums}\nattention_kernel = "{self.attention_kernel}"\n{over}'
            f"source = {text(self.source)}\ndate = {text(self.date)}"
        )


def parse_gpu_calibration(d: Any, where: str) -> GpuCalibration:
    """The `[gpu_calibration]` table; ValueError naming the key and its form."""
    known = set(FRACTIONS) | {"attention_kernel", "source", "date"}
    optional = ["overlap", "tp_comm_efficiency", *OPTIONAL_CHOICES, *KERNEL_FIGURES, "matmul_table"]
    if not isinstance(d, dict) or not known <= set(d) <= known | set(optional):
        got = sorted(d) if isinstance(d, dict) else repr(d)
        raise ValueError(
            f"{where} [gpu_calibration]: needs exactly the keys {', '.join(sorted(known))} (and optionally "
            f"{', '.join(optional)}), got {got}"
        )
    for key, choices in OPTIONAL_CHOICES.items():
        if d.get(key, choices[0]) not in choices:
            raise ValueError(f"{where} [gpu_calibration]: {key} must be one of {', '.join(choices)}, got {d[key]!r}")
    over = d.get("overlap", [])
    if not isinstance(over, list) or not set(over) <= set(OVERLAPS) or len(set(over)) != len(over):
        raise ValueError(
            f"{where} [gpu_calibration]: overlap must be a list of distinct names from {', '.join(OVERLAPS)}, "
            f"got {over!r}"
        )
    eff = d.get("tp_comm_efficiency", 1.0)
    if isinstance(eff, bool) or not isinstance(eff, (int, float)) or not TP_COMM_EFFICIENCY_MIN <= eff <= 1:
        raise ValueError(
            f"{where} [gpu_calibration]: tp_comm_efficiency must be a number from {TP_COMM_EFFICIENCY_MIN:g} to 1 "
            f"(1: each collective hidden up to its GEMM; below 0: the overlapped pair is slower than none), got {eff!r}"
        )
    for k in KERNEL_FIGURES:
        v = d.get(k, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= KERNEL_US_MAX:
            raise ValueError(
                f"{where} [gpu_calibration]: {k} must be microseconds from 0 (none) to {KERNEL_US_MAX:g}, got {v!r}"
            )
    for k in FRACTIONS:
        v = d[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise ValueError(f"{where} [gpu_calibration]: {k} must be a fraction in (0, 1], got {v!r}")
    if d["attention_kernel"] not in KERNELS:
        raise ValueError(
            f"{where} [gpu_calibration]: attention_kernel must be one of {', '.join(KERNELS)}, "
            f"got {d['attention_kernel']!r}"
        )
    for k in ("source", "date"):
        if not isinstance(d[k], str) or not d[k].strip():
            raise ValueError(f"{where} [gpu_calibration]: {k} must be a non-empty string")
    table = None if "matmul_table" not in d else parse_matmul_table(d["matmul_table"], f"{where} [gpu_calibration]")
    # The table's best row is the rate the GEMMs' efficiencies are relative to (Rates.matmul_efficiency).
    if table is not None and not math.isclose(table.best(), d["matmul_fraction"], rel_tol=1e-9):
        raise ValueError(
            f"{where} [gpu_calibration]: matmul_fraction must be matmul_table's best fraction {table.best()!r} "
            f"(the best GEMM rate), got {d['matmul_fraction']!r}"
        )
    return GpuCalibration(
        **{k: float(d[k]) for k in FRACTIONS},
        **{k: d[k] for k in ("attention_kernel", "source", "date")},
        overlap=tuple(over),
        **{key: d.get(key, choices[0]) for key, choices in OPTIONAL_CHOICES.items()},
        matmul_table=table,
        tp_comm_efficiency=float(eff),
        **{k: float(d.get(k, 0.0)) for k in KERNEL_FIGURES},
    )


@dataclass(frozen=True)
class Rates:
    """What a GPU reaches: FLOP/s of its best GEMM, bytes/s of memory, bytes per element; the measured GEMM
    efficiencies by shape where the calibration has them."""

    flops: float
    memory_bps: float
    elem_bytes: int
    table: MatmulTable | None = None

    def matmul_efficiency(self, m: float, n: float, k: float) -> float:
        """Fraction of the best GEMM rate that an (m x k) @ (k x n) product reaches: read from the measured
        table (relative to its best row, which is matmul_fraction), else the roofline."""
        if self.table is not None:
            return self.table.fraction(m, n, k) / self.table.best()
        intensity = 2.0 * m * n * k / (self.elem_bytes * (m * k + k * n + m * n))
        return min(1.0, intensity * self.memory_bps / self.flops)

    def gemm_s(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        """Seconds of `batch` products (m x k) @ (k x n)."""
        if min(m, n, k, batch) <= 0:
            return 0.0
        return batch * 2.0 * m * n * k / (self.flops * self.matmul_efficiency(m, n, k))


def weight_gemms(m: ModelConfig, tp: int) -> list[tuple[float, float]]:
    """(k, n) of each projection of a decoder layer on one of `tp` ranks (Megatron's split: column-parallel
    in, row-parallel out): q, k and v, the attention output, the MLP's up (and gate) and down."""
    q, kv = m.n_heads * m.head_dim, m.kv_heads * m.head_dim
    up = 2 * m.ffn_dim if m.family == "llama" else m.ffn_dim  # SwiGLU's gate and up projections
    return [(m.dim, (q + 2 * kv) / tp), (q / tp, m.dim), (m.dim, up / tp), (m.ffn_dim / tp, m.dim)]


def layer_times(
    g: GpuCalibration, rates: Rates, m: ModelConfig, tp: int, tokens: int, seq_len: int
) -> tuple[float, float, float, float]:
    """One decoder layer's forward on one of `tp` ranks for `tokens` tokens (sequences of `seq_len`):
    (matmul seconds: the projections at their GEMM shapes and attention's two products; the backward's
    matmul seconds beyond twice those; attention's forward memory-bound seconds; its backward's). The
    backward's matmuls are twice the forward's (the same shapes, transposed). Flash attention: its FLOPs
    (the causal half, as its authors count) at attention_fraction of the peak, no score matrix in memory,
    and its backward's recomputed scores (FLASH_BACKWARD_RECOMPUTE); unfused: per head, scores (s x s x
    head_dim) and values (s x head_dim x s) as batched GEMMs, the softmax and dropout over the score matrix
    in memory."""
    proj = sum(rates.gemm_s(tokens, n, k) for k, n in weight_gemms(m, tp))
    heads, seqs = m.n_heads / tp, tokens / seq_len
    if g.attention_kernel == "flash":
        flops = 4.0 * tokens * seq_len * m.head_dim * heads / 2  # QK^T and PV, causal half
        attention = flops / (g.attention_fraction * rates.flops / g.matmul_fraction)
        return proj + attention, FLASH_BACKWARD_RECOMPUTE * attention, 0.0, 0.0
    batch = seqs * heads
    attn = rates.gemm_s(seq_len, seq_len, m.head_dim, batch) + rates.gemm_s(seq_len, m.head_dim, seq_len, batch)
    scores = batch * seq_len * seq_len * rates.elem_bytes  # bytes of one pass over the score matrix
    return (
        proj + attn,
        0.0,
        SOFTMAX_FORWARD_ACCESSES * scores / rates.memory_bps,
        SOFTMAX_BACKWARD_ACCESSES * scores / rates.memory_bps,
    )


def regathers(g: GpuCalibration | None) -> bool:
    """Whether the calibrated software all-gathers a column-parallel layer's input again in its backward
    under sequence parallelism (SP_BACKWARDS)."""
    return g is not None and g.sp_backward == "regather"


def exposed_tp_comm(
    rates: Rates,
    m: ModelConfig,
    tp: int,
    tokens: int,
    gather_s: float,
    reduce_s: float,
    sp: bool,
    again: bool,
    efficiency: float = 1.0,
) -> tuple[float, float, float]:
    """What a layer's tensor-parallel collectives leave exposed under `tp_comm` overlap: (forward, backward,
    the backward's re-gathers). Megatron-Core's --tp-comm-overlap (Transformer Engine's userbuffers) runs each
    collective beside the one GEMM that produces or consumes its tensor, so each is hidden only up to that
    GEMM's time: with sequence parallelism the forward's all-gathers beside q/k/v's and the MLP's up
    projection, its reduce-scatters beside the attention output's and the MLP's down projection; the
    backward's gathers of the output gradients beside those two projections' input-gradient GEMMs, its
    reduce-scatters of the input gradients beside q/k/v's and the up projection's weight-gradient GEMMs, and
    (`again`: SP_BACKWARDS "regather") the inputs' re-gathers beside their input-gradient GEMMs. Without
    sequence parallelism the all-reduces after the row-parallel GEMMs (forward) and of the column-parallel
    input gradients (backward) pair the same way. `gather_s`: one all-gather of the layer's input;
    `reduce_s`: one all-reduce of it. Each pass's GEMMs are as long as the forward's (the same shapes).
    `efficiency` (tp_comm_efficiency): a pair takes at least (1 - efficiency) x its collective beyond its GEMM,
    the collective's part that the software's overlap does not hide, the GEMM's slowdown included."""
    qkv, proj, up, down = (rates.gemm_s(tokens, n, k) for k, n in weight_gemms(m, tp))
    one = gather_s if sp else reduce_s
    left = lambda gemm: max(0.0, one - gemm, (1.0 - efficiency) * one)  # noqa: E731
    forward = left(proj) + left(down) + (left(qkv) + left(up) if sp else 0.0)
    backward = left(qkv) + left(up) + (left(proj) + left(down) if sp else 0.0)
    return forward, backward, left(qkv) + left(up) if sp and again else 0.0


def gathers_cp(g: GpuCalibration | None) -> bool:
    """Whether the calibrated software all-gathers context parallelism's keys and values (CP_COMMS)."""
    return g is not None and g.cp_comm == "allgather"


def accumulation_bytes(g: GpuCalibration | None, act: int) -> int:
    """Bytes per parameter that summing one microbatch's weight gradients (`act` bytes an element, the compute
    precision) moves beyond the GEMM that computes them (GRAD_ACCUMULATIONS): none where fused or without a
    calibration (the CPU path: measured); else the gradient read, the sum read and written."""
    if g is None or g.grad_accumulation == "fused":
        return 0
    return act + 2 * grad_bytes(g, act)


def grad_bytes(g: GpuCalibration | None, act: int) -> int:
    """Bytes an element of the accumulated gradients, which the data-parallel reduction moves: fp32 unless the
    software sums them in the compute precision (GRAD_ACCUMULATIONS "separate-half")."""
    return act if g is not None and g.grad_accumulation == "separate-half" else 4


def blocks_p2p(g: GpuCalibration | None) -> bool:
    """Whether the calibrated software's pipeline sender waits for each hand-off to complete (P2PS)."""
    return g is not None and g.p2p == "blocking"


def overlapped(g: GpuCalibration | None, name: str) -> bool:
    """Whether the calibrated software runs the communication `name` (OVERLAPS) behind compute."""
    return g is not None and name in g.overlap


def counts_traffic(g: GpuCalibration | None) -> bool:
    """Whether the calibrated software is hybridpar's own eager runtime, its memory-bound bytes counted
    (ELEMENTWISE)."""
    return g is not None and g.elementwise == "counted"


def launch_s(g: GpuCalibration | None, device_s: float, kernels: float, dispatched: float) -> float:
    """What a pass's kernels add to its `device_s` (its GEMMs, attention and counted bytes): the device adds
    kernel_floor_us for each of its `kernels` counted kernels, the host dispatches `dispatched` ops at dispatch_us
    meanwhile (the stream queues them: the two overlap), and the pass takes the longer. 0 without the figures."""
    if g is None or not (g.kernel_floor_us or g.dispatch_us):
        return 0.0
    device = device_s + kernels * g.kernel_floor_us * 1e-6
    return max(device, dispatched * g.dispatch_us * 1e-6) - device_s
