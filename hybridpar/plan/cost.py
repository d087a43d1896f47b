"""The cost model: seconds of each pipeline action and collective of a layout on a hardware description
(the step they add up to: plan/step.py).

Per decoder layer and token, from the model family (model/registry.py): the forward's matmul FLOPs
(projections and attention products), timed at the device's peak for the run's precision; the
memory-bound elementwise work around them (norms, rotary, activation function, residual adds), as
bytes over `memory_bandwidth_gbs`; and the framework operations each pass launches, at
`op_overhead_us` each. A backward costs two forwards of matmuls (input and weight gradients) and
twice the elementwise work; where the schedule splits it, B is the input-gradient half with the
elementwise work and W the weight-gradient half. Recomputation adds the forward (full) or its
non-matmul part (selective) to B. The first stage adds the embedding, the last the head and loss.

Communication, each by latency + bytes / bandwidth over the link the placement gives it (tp inside a
node; global ranks run tp fastest, then pp, then dp): Megatron tensor parallelism's two all-reduces
per layer in the forward and two in the backward (plus the embedding's all-reduce, the head's gather
and its input gradient's all-reduce); the point-to-point activation messages (simulator's link model);
the data-parallel gradient all-reduce of each stage, started when its last backward ends and overlapped
with what follows (as dataparallel/grads.py does);
ZeRO-1's all-gather of the updated slices; the step's small all-reduces (loss, clip norm). The
optimizer step is memory-bound. bf16 working copies (train.bf16_weights copies) differ only there: AdamW steps
the fp32 masters of a rank's 1/dp slice at every ZeRO level, rounds them into the bf16 weights and all-gathers
those at 2 bytes a parameter (ZeRO 0 included); their gradients are fp32 and reduced as autocast's. Ring
collectives: an all-reduce moves 2 (n-1)/n of the bytes and takes 2 (n-1) hops, an all-gather half of that.

Where the hardware file carries a calibration of this model's shape (plan/calibrate.py: the layer, the
embedding, the head and the optimizer timed through the model's own modules on this machine, as CPU
hosts need), its times replace the FLOP and element counts for fp32 runs, and each pipeline action adds
the runtime's measured per-action overhead; a tensor-parallel all-reduce takes its time measured in
place (all ranks computing and reducing at once) where the calibration has one, and the other
communication terms stay as above.

Where it carries a `[gpu_calibration]` (plan/gpu_model.py), GEMMs are timed by their shapes, attention by
its kernel, memory-bound work and links at their achievable fractions of the datasheet figures (hybridpar's own
eager runtime: its counted bytes, and with the probe's kernel figures its kernels' floor and dispatch,
gpu_model.launch_s); ZeRO-1's
gradient reduction is a reduce-scatter and small all-reduces take NCCL's tree (plan/collectives.py); and the
communication its `overlap` names (gpu_model.OVERLAPS) hides behind the compute it runs beside.

A layout's step time from these costs: plan/step.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from hybridpar.config import Config, ModelConfig, ParallelConfig, TrainConfig
from hybridpar.model.optim import takes_fused
from hybridpar.model.registry import ParamCounts, layer_flops_per_token, layer_tensors, param_counts
from hybridpar.pipeline.partition import partition_by_cost, partition_uniform
from hybridpar.pipeline.schedules import schedule_spec, stage_count, stages_per_rank
from hybridpar.plan.calibrate import Calibration
from hybridpar.plan.collectives import all_gather_s, all_reduce_s, p2p_s, reduce_scatter_s
from hybridpar.plan.gpu_model import (
    accumulation_bytes,
    counts_traffic,
    exposed_tp_comm,
    gathers_cp,
    launch_s,
    layer_times,
    overlapped,
    regathers,
    weight_gemms,
)
from hybridpar.plan.hardware import Hardware, Link
from hybridpar.plan.traffic import Settings, Traffic, count_optimizer, scaled_for_optimizer, traffic

if TYPE_CHECKING:  # plan/step.py reads this model's costs and keeps its simulations' marks in `_last`
    from hybridpar.plan.step import SimMarks

# Elements read or written per token by the elementwise work of one decoder layer's forward, counted on
# the Llama block (two RMSNorms: square, mean, scale, weight, about 6 accesses per element each; two
# residual adds, 3 each; rotary on q and k, 9 each; the attention output's layout copy, 2; SwiGLU's
# SiLU and product, 5 per FFN element). GPT-2's block (LayerNorm, GELU) touches about as many.
REPLICATED_ELEMENTS = 18  # x dim: the norms and residuals every tp rank runs whole
ATTENTION_ELEMENTS = 9  # x (q + k width): rotary
FFN_ELEMENTS = 5  # x ffn_dim
OPS_PER_LAYER = 30  # framework operations of one decoder layer's forward
F32_BYTES = 4
ADAMW_BYTES = 28  # per parameter: read p, g, m, v; write p, m, v (fp32)
COPY_BYTES = 6  # per parameter of a working copy's slice: read its fp32 master, write the bf16 weight (refresh)
OPS_PER_PARAM_TENSOR = 12  # AdamW's per-tensor operations (torch's for-loop implementation on CPU)
CLIP_BYTES = 12  # per parameter: clipping's norm reads each gradient (4), its scaling reads and writes it (8)


@dataclass(frozen=True)
class Placement:
    """Which link each kind of traffic crosses, and the nodes of the pipeline ranks."""

    tp: Link
    pp: Link
    dp: Link
    world: Link  # the step's world-wide all-reduces
    pp_nodes: tuple[int, ...]  # node of each pipeline rank (of replica 0, cp and tp rank 0)
    pp_speed: tuple[float, ...]  # slowest device of each pipeline rank (over its tp, cp and dp ranks)
    cp: Link | None = None  # the context-parallel ring's hops (None: cp = 1)
    dp_cp: Link | None = None  # the gradient sum over the dp x cp ranks: its slowest hop (None: cp = 1, dp's)


class Shape(NamedTuple):
    tp: int
    pp: int
    dp: int
    cp: int = 1


def placement(p: Shape | ParallelConfig, hw: Hardware) -> Placement:
    """Global ranks run tp fastest, then cp, then pp, then dp (topology/mesh.py)."""
    n, cp = hw.devices_per_node, p.cp
    inner = p.tp * cp  # the ranks of one pipeline rank of one replica
    world = inner * p.pp * p.dp
    link = lambda crosses: hw.inter_node if crosses else hw.intra_node  # noqa: E731
    speeds = [1.0] * p.pp
    if hw.speed is not None:
        speeds = [
            min(hw.device_speed((d * p.pp + r) * inner + i) for d in range(p.dp) for i in range(inner))
            for r in range(p.pp)
        ]
    ring_crosses = inner > n or n % inner != 0  # a node does not hold whole cp x tp groups
    return Placement(
        tp=link(p.tp > n or n % p.tp != 0),
        pp=link(p.pp > 1 and inner * p.pp > n),
        dp=link(p.dp > 1 and world > n),
        world=link(world > n),
        pp_nodes=tuple(r * inner // n for r in range(p.pp)),
        pp_speed=tuple(speeds),
        cp=link(ring_crosses) if cp > 1 else None,
        dp_cp=link(ring_crosses or (p.dp > 1 and world > n)) if cp > 1 else None,
    )


@dataclass(frozen=True)
class Work:
    """One piece of compute, split by what bounds it."""

    matmul_s: float = 0.0
    memory_s: float = 0.0
    ops_s: float = 0.0
    comm_s: float = 0.0  # tensor-parallel collectives inside it

    @property
    def compute(self) -> float:
        return self.matmul_s + self.memory_s + self.ops_s

    @property
    def total(self) -> float:
        return self.compute + self.comm_s

    def __add__(self, o: Work) -> Work:
        return Work(
            self.matmul_s + o.matmul_s, self.memory_s + o.memory_s, self.ops_s + o.ops_s, self.comm_s + o.comm_s
        )

    def times(self, k: float) -> Work:
        return Work(self.matmul_s * k, self.memory_s * k, self.ops_s * k, self.comm_s * k)


def busy_comm(w: Work, stretch: float | None) -> Work:
    """`w` with its collectives' time as CPU work, where they were measured in place on ranks sharing
    cores under `stretch` (`CostModel.comm_stretch`; None: unchanged). There a collective's wall time is
    not idle: gloo's threads and the waits' wake-ups burn the cores the other ranks compute on (a tp step's
    wall time is its ranks' summed CPU time over the cores), so the simulator must not hand those cores
    to another pipeline rank meanwhile; as work it costs what it was measured to while every rank computes,
    and less while some idle."""
    if stretch is None or not w.comm_s:
        return w
    return Work(w.matmul_s, w.memory_s, w.ops_s + w.comm_s / stretch)


@dataclass(frozen=True)
class LayerCosts:
    """Seconds per microbatch on one rank: forward, backward input half (B), weight half (W)."""

    f: Work
    b: Work
    w: Work

    def busy(self, stretch: float | None) -> LayerCosts:
        """Each of F, B, W with its collectives as CPU work (`busy_comm`)."""
        return LayerCosts(busy_comm(self.f, stretch), busy_comm(self.b, stretch), busy_comm(self.w, stretch))


class CostModel:
    """The costs of one model on one hardware description; the layout comes with each call."""

    def __init__(self, m: ModelConfig, hw: Hardware) -> None:
        self.m, self.hw = m, hw
        self.counts: ParamCounts = param_counts(m)
        self.layer_tensors = layer_tensors(m)
        self._flops: dict[int, float] = {}
        self._parts: dict[tuple, list[range]] = {}
        self._last: dict[tuple, SimMarks] = {}  # a simulation's key -> when its collectives may start
        # One layer's and the ends' costs per distinct input: a search asks for the same few hundred thousands
        # of times (they read of the training settings only the precision and the sequence length).
        self._layers: dict[tuple, LayerCosts] = {}
        self._ends: dict[tuple, tuple[Work, Work]] = {}
        self._placements: dict[tuple[int, int, int, int], Placement] = {}
        self._stages: dict[tuple, tuple] = {}  # `setup`'s per-stage part per distinct input
        self._stage_kinds: dict[tuple, dict[tuple, LayerCosts]] = {}  # `stage_costs`' kinds per its inputs
        self._traffic: dict[Settings, Traffic] = {}  # counted once per setting (plan/traffic.py: seconds each)
        self._optimizer_bytes: dict[Settings, float] = {}

    def counted(self, t: TrainConfig, recompute: str) -> Traffic | None:
        """hybridpar's own eager runtime's memory-bound traffic under `t` where the GPU calibration says the
        software is hybridpar's (gpu_model.ELEMENTWISE "counted"), counted once per setting; else None. A compiled
        run (train.compile) fuses its elementwise work into kernels this count cannot see on a CPU: it keeps the
        fixed counts of the fused software."""
        if not counts_traffic(self.hw.gpu_calibration) or t.compile:
            return None
        key = Settings.of(t, recompute)
        if key not in self._traffic:
            self._traffic[key] = traffic(self.m, key)
        return self._traffic[key]

    def optimizer_bytes(self, precision: str, copies: bool, fused_adamw: str) -> float | None:
        """Counted bytes per parameter of the runtime's AdamW step (clipping excluded), as `counted`; else None."""
        if not counts_traffic(self.hw.gpu_calibration):
            return None
        fused = takes_fused(fused_adamw, "cuda")  # the runtime's choice on a GPU (model/optim.py)
        # fp32 and autocast step the same fp32 parameters; working copies add the bf16 weights' refresh.
        key = Settings("bf16", "copies" if copies else "autocast", "none", fused)
        if key not in self._optimizer_bytes:
            self._optimizer_bytes[key] = count_optimizer(scaled_for_optimizer(self.m), key)[0] - CLIP_BYTES
        return self._optimizer_bytes[key]

    def _rate(self, precision: str) -> float:
        peak = self.hw.peak_flops(precision)
        if peak <= 0:
            raise ValueError(f"{self.hw.name} has no {precision} peak: train.precision={precision} cannot run on it")
        return peak

    def _memory_s(self, elements: float, act_bytes: int) -> float:
        bw = self.hw.memory_bps()
        return 0.0 if bw is None else elements * act_bytes / bw

    def _accumulate_s(self, params: float, act: int) -> float:
        """Summing one microbatch's gradients of `params` parameters into the accumulation buffer, where the GPU
        software does it in a pass of its own (gpu_model.GRAD_ACCUMULATIONS); 0 where fused or measured."""
        nbytes = accumulation_bytes(self.hw.gpu_calibration, act) * params
        return 0.0 if nbytes == 0 else nbytes / self.hw.memory_bps()

    def comm_stretch(self, t: TrainConfig) -> float | None:
        """On a calibrated host whose ranks share cores, the stretch its collectives were measured in place
        under (every rank of the node computing: devices over cores); None elsewhere (`busy_comm`)."""
        hw = self.hw
        if hw.cores_per_node is None or self.calibrated(t) is None:
            return None
        return max(1.0, hw.devices_per_node / hw.cores_per_node)

    def calibrated(self, t: TrainConfig) -> Calibration | None:
        """The hardware's measured times where they are of this model's shape and the run is fp32."""
        cal = self.hw.calibration
        ok = cal is not None and t.precision == "fp32" and cal.fits(self.m, t.seq_len)
        return cal if ok else None

    def layer(
        self,
        t: TrainConfig,
        tp: int,
        tokens: int,
        link: Link,
        recompute: str,
        split: bool = False,
        sp: bool = False,
        ring: tuple[int, Link] | None = None,
    ) -> LayerCosts:
        """`_layer`, computed once per distinct input."""
        key = (t.precision, t.bf16_weights, t.fused_adamw, t.compile, t.seq_len, tp, tokens, link, recompute, split, sp)
        key += (ring,)
        if key not in self._layers:
            self._layers[key] = self._layer(t, tp, tokens, link, recompute, split, sp, ring)
        return self._layers[key]

    def _layer(
        self,
        t: TrainConfig,
        tp: int,
        tokens: int,
        link: Link,
        recompute: str,
        split: bool,
        sp: bool,
        ring: tuple[int, Link] | None,
    ) -> LayerCosts:
        """One decoder layer for a microbatch of `tokens` tokens on one tp rank (`split`: the schedule
        runs B and W apart; otherwise W may be 0 with the whole backward in B). `sp` (sequence
        parallelism): the norms and residuals run on 1/tp of the tokens; its all-gather and reduce-scatter
        move the bytes of the all-reduces they replace, so the collectives are costed as those, and where the
        GPU software re-gathers a column-parallel layer's input for its weight gradient (gpu_model.SP_BACKWARDS)
        the backward adds those two all-gathers (in W where the schedule splits it, else in B). `ring`:
        (cp, the ring's link) under context parallelism, `tokens` then being this rank's share of the
        sequences (each still attends over the whole sequence: `ring_s`)."""
        m = self.m
        if t.seq_len not in self._flops:
            self._flops[t.seq_len] = layer_flops_per_token(m, t.seq_len)
        act = 2 if t.precision == "bf16" else 4
        mm = tokens * self._flops[t.seq_len] / tp / self._rate(t.precision)
        sharded = ATTENTION_ELEMENTS * (m.dim + m.kv_heads * m.head_dim) + 2 * m.dim + FFN_ELEMENTS * m.ffn_dim
        replicated = REPLICATED_ELEMENTS * m.dim / (tp if sp else 1)
        mem = self._memory_s(tokens * (replicated + sharded / tp), act)
        rates, mem_b, mm_b = self.hw.gpu_rates(t.precision), 2 * mem, 0.0
        if rates is not None:  # GEMMs by shape, attention by its kernel (plan/gpu_model.py)
            mm, mm_b, att_f, att_b = layer_times(self.hw.gpu_calibration, rates, m, tp, tokens, t.seq_len)
            mem, mem_b = mem + att_f, mem_b + att_b
        ct = self.counted(t, recompute) if rates is not None and self.calibrated(t) is None else None
        if ct is not None:  # hybridpar's eager runtime: its counted bytes (tp: the fixed counts' proportions)
            share = (replicated + sharded / tp) / (REPLICATED_ELEMENTS * m.dim + sharded)
            at = lambda a: (a.per_token.nbytes * tokens * share + a.per_pass.nbytes / tp) / rates.memory_bps  # noqa: E731
            mem = at(ct.layer_f) + att_f
            # The count's backward holds its recomputation, which the cost model adds below as the forward's.
            mem_b = at(ct.layer_b) + att_b - (mem if recompute != "none" else 0.0)
        ops = OPS_PER_LAYER * self.hw.op_overhead_us * 1e-6
        reduce = self.tp_all_reduce_s(t, tp, tokens, link)
        comm = 2 * reduce  # after attention and after the MLP
        gather = all_gather_s(tokens * m.dim * act, tp, link, self.hw)
        # Sequence parallelism keeping only the 1/tp slice: q/k/v's and the MLP's inputs gathered again.
        again = 2 * gather if sp and regathers(self.hw.gpu_calibration) else 0.0
        if rates is not None and overlapped(self.hw.gpu_calibration, "tp_comm"):  # each beside its GEMM
            eff = self.hw.gpu_calibration.tp_comm_efficiency
            comm, back, again = exposed_tp_comm(rates, m, tp, tokens, gather, reduce, sp, again > 0, eff)
        else:
            back = comm
        comm_b, comm_w = (back, again) if split else (back + again, 0.0)
        f = Work(mm, mem, ops, comm)
        b = Work(mm + mm_b, mem_b, 1.5 * ops, comm_b)  # input gradients, attention's all; the copy-ins' reduces
        # The weight gradients into their sum (counted: in the backward's count already).
        acc = self._accumulate_s(self.counts.layer / tp, act) if ct is None else 0.0
        w = Work(mm, acc if split else 0.0, 0.5 * ops, comm_w)
        b = b if split else b + Work(memory_s=acc)
        cal = self.calibrated(t)
        timed = cal.layer(tp, tokens) if cal is not None else None
        if timed is not None:  # measured compute (in matmul_s: the whole layer), the same collectives
            f = Work(timed.f, comm_s=f.comm_s)
            b = Work(timed.b_input if split else timed.b, comm_s=b.comm_s)
            w = Work(timed.w if split else 0.0)
        if ring is not None and ring[0] > 1:  # the exposed part of the ring's hops: forward and backward (B)
            # The attention's forward: on a GPU its kernel's own time (the layer's matmul time less the
            # projections'), elsewhere its share of the layer's FLOPs of the (counted or measured) time.
            attention = 4.0 * t.seq_len * m.dim / self._flops[t.seq_len] * f.matmul_s
            if rates is not None and timed is None:
                attention = mm - sum(rates.gemm_s(tokens, n, k) for k, n in weight_gemms(m, tp))
            ring_f, ring_b = self.ring_s(t, tp, tokens, ring, attention)
            f, b = f + Work(comm_s=ring_f), b + Work(comm_s=ring_b)
        if recompute == "full":
            b = b + f
        elif recompute == "selective":  # the forward's work outside its matmuls (measured: in the counted share)
            b = b + (Work(0.0, mem, ops) if timed is None else Work(f.compute * (mem + ops) / (mm + mem + ops)))
        if ct is not None:  # the counted ops' kernels (gpu_model.launch_s); the backward's count holds its recompute
            g, kf, kb = self.hw.gpu_calibration, ct.layer_f.at(tokens), ct.layer_b.at(tokens)
            f = f + Work(ops_s=launch_s(g, f.compute, kf.ops, kf.ops + kf.matmuls))
            b = b + Work(ops_s=launch_s(g, b.compute + w.compute, kb.ops, kb.ops + kb.matmuls))
        return LayerCosts(f, b, w)

    def ring_s(
        self, t: TrainConfig, tp: int, tokens: int, ring: tuple[int, Link], attention_s: float
    ) -> tuple[float, float]:
        """What ring attention's hops add to one layer's forward and backward for this rank's `tokens`
        (model/ring_attention.py), as the implementation overlaps them: at each of the cp steps the hop
        of the next key/value block is posted before the current block's attention is computed, so a
        hop costs only what it outlasts that block (the rank's `attention_s`, forward, over cp steps:
        every step computes the same work, the chunks being paired for balance). Forward: cp - 1 hops of
        the rank's keys and values (its tp share of the kv heads, in the activations' precision).
        Backward: the same cp - 1 hops, each with the travelling dK/dV accumulator (fp32) beside it,
        against a block's backward (twice its forward's FLOPs), then one last hop of the accumulator
        home, which nothing overlaps. Where the GPU software all-gathers instead (gpu_model.CP_COMMS): the
        whole sequence's keys and values gathered in the forward, their gradients (in the activations'
        precision) reduce-scattered in the backward, each in the critical path."""
        cp, link = ring
        kv = 2 * tokens * self.m.kv_heads * self.m.head_dim / tp  # keys and values, elements
        act = 2 if t.precision == "bf16" else 4
        if gathers_cp(self.hw.gpu_calibration):  # gathered whole before attention, nothing hidden (CP_COMMS)
            whole = kv * cp * act
            return all_gather_s(whole, cp, link, self.hw), reduce_scatter_s(whole, cp, link, self.hw)
        block = attention_s / cp
        forward = (cp - 1) * max(0.0, p2p_s(kv * act, link, self.hw) - block)
        backward = (cp - 1) * max(0.0, p2p_s(kv * (act + F32_BYTES), link, self.hw) - 2 * block)
        return forward, backward + p2p_s(kv * F32_BYTES, link, self.hw)

    def tp_all_reduce_s(self, t: TrainConfig, tp: int, tokens: int, link: Link) -> float:
        """One tensor-parallel all-reduce of a microbatch's activations: measured in place where the
        calibration has it (plan/probe.py), else latency and bandwidth of the link."""
        cal = self.calibrated(t)
        timed = cal.tp_all_reduce(tp, tokens) if cal is not None and tp > 1 else None
        if timed is not None:
            return timed
        return all_reduce_s(tokens * self.m.dim * (2 if t.precision == "bf16" else 4), tp, link, self.hw)

    def ends(self, t: TrainConfig, tp: int, tokens: int, link: Link) -> tuple[Work, Work]:
        """(embedding forward + backward on the first stage, head + loss forward + backward on the last)."""
        key = (t.precision, t.bf16_weights, t.compile, t.seq_len, tp, tokens, link)
        if key not in self._ends:
            self._ends[key] = self._ends_of(t, tp, tokens, link)
        return self._ends[key]

    def _ends_of(self, t: TrainConfig, tp: int, tokens: int, link: Link) -> tuple[Work, Work]:
        m = self.m
        act = 2 if t.precision == "bf16" else 4
        ovh = self.hw.op_overhead_us * 1e-6
        embed_mem = self._memory_s(tokens * m.dim * 4, act) + self._accumulate_s(self.counts.embed / tp, act)
        embed = Work(0.0, embed_mem, 6 * ovh, self.tp_all_reduce_s(t, tp, tokens, link))
        mm = 3 * tokens * 2.0 * m.dim * m.vocab_size / tp / self._rate(t.precision)
        rates = self.hw.gpu_rates(t.precision)  # the logits' GEMM by its shape where calibrated
        mm = mm if rates is None else 3 * rates.gemm_s(tokens, m.vocab_size / tp, m.dim)
        head_mem = self._memory_s(tokens * (8 * m.vocab_size + 6 * m.dim), act) + self._accumulate_s(
            self.counts.head / tp, act
        )
        ct = self.counted(t, "none") if rates is not None else None
        if ct is not None:  # counted: the ends' bytes, the embedding's its gather's and its share of the per-pass
            c, whole = self.counts, ct.ends_f.at(tokens).nbytes + ct.ends_b.at(tokens).nbytes
            per_pass = (ct.ends_f.per_pass.nbytes + ct.ends_b.per_pass.nbytes) / tp
            whole += per_pass - (ct.ends_f.per_pass.nbytes + ct.ends_b.per_pass.nbytes)
            embed_bytes = tokens * m.dim * 4 * act + per_pass * c.embed / (c.embed + c.head)
            embed = Work(0.0, embed_bytes / rates.memory_bps, embed.ops_s, embed.comm_s)
            head_mem = (whole - embed_bytes) / rates.memory_bps
        head = Work(
            mm,
            head_mem,
            20 * ovh,
            sum(self.head_comm(t, tp, tokens, link)),
        )
        if ct is not None:  # the ends' kernels, forward and backward, on the head's side (the embedding's are 2-3)
            k = ct.ends_f.at(tokens) + ct.ends_b.at(tokens)
            extra = launch_s(self.hw.gpu_calibration, embed.compute + head.compute, k.ops, k.ops + k.matmuls)
            head = head + Work(ops_s=extra)
        return embed, head

    def head_comm(self, t: TrainConfig, tp: int, tokens: int, link: Link) -> tuple[float, float]:
        """The head's tensor-parallel collectives: (the forward's all-gather of the logits, the backward's
        all-reduce of its input gradient). Measured in place where the calibration has them (their sum,
        split in the ring's proportions: the gather takes half the steps with vocab / dim of the bytes);
        else, where the all-reduce is measured in place, the gather is that time in those proportions."""
        if tp <= 1:
            return 0.0, 0.0
        reduce = self.tp_all_reduce_s(t, tp, tokens, link)
        cal = self.calibrated(t)
        gather = self.m.vocab_size / self.m.dim / 2  # the gather's time over the all-reduce's, in the ring
        head = cal.tp_head(tp, tokens) if cal is not None else None
        if head is not None:  # the two measured together in place: split in those proportions
            return head * gather / (gather + 1), head / (gather + 1)
        if cal is not None and cal.tp_all_reduce(tp, tokens) is not None:
            return reduce * gather, reduce
        return all_gather_s(tokens * self.m.vocab_size * (2 if t.precision == "bf16" else 4), tp, link, self.hw), reduce

    def end_costs(self, t: TrainConfig, tp: int, tokens: int, link: Link) -> tuple[LayerCosts, LayerCosts]:
        """F, B, W that the embedding adds to the first stage and the head and loss to the last: measured
        where calibrated (backward in B), else `ends` with a third of the work in each."""
        embed, head = self.ends(t, tp, tokens, link)
        cal = self.calibrated(t)
        timed = cal.end(tokens) if cal is not None else None
        if timed is None:
            third = lambda e: LayerCosts(e.times(1 / 3), e.times(1 / 3), e.times(1 / 3))  # noqa: E731
            return third(embed), third(head)
        gather, reduce = self.head_comm(t, tp, tokens, link)
        return (
            LayerCosts(Work(timed.embed_f, comm_s=embed.comm_s), Work(timed.embed_b), Work()),
            LayerCosts(Work(timed.head_f, comm_s=gather), Work(timed.head_b, comm_s=reduce), Work()),
        )

    def stage_params(self, parts: list[range]) -> list[int]:
        c = self.counts
        return [
            len(r) * c.layer + (c.embed if s == 0 else 0) + (c.head if s == len(parts) - 1 else 0)
            for s, r in enumerate(parts)
        ]

    def placed(self, p: Shape | ParallelConfig) -> Placement:
        """`placement` of the mesh shape of `p` (it reads tp, cp, pp and dp only), computed once per shape."""
        key = (p.tp, p.cp, p.pp, p.dp)
        if key not in self._placements:
            self._placements[key] = placement(p, self.hw)
        return self._placements[key]

    def parts(self, cfg: Config, pl: Placement) -> list[range]:
        """The layers of each stage under cfg.parallel.partition (params: balance parameters, as the
        runtime does; cost: balance time with the embedding and head as extras and the ranks' speeds)."""
        p, c = cfg.parallel, self.counts
        n_stages, L = stage_count(p), self.m.n_layers
        if p.partition == "uniform":
            return partition_uniform(L, n_stages)
        if p.partition == "params":
            if (n_stages,) not in self._parts:
                self._parts[n_stages,] = partition_by_cost(
                    [float(c.layer)] * L, n_stages, first_extra=c.embed, last_extra=c.head
                )
            return self._parts[n_stages,]
        # What the split below reads, for a cheaper key than its own (a search asks thousands of times).
        t = cfg.train
        lc = None if p.layer_costs is None else tuple(p.layer_costs)
        asked = (lc, p.schedule, p.pp, stages_per_rank(p), p.tp, pl.tp, pl.pp_speed, t.precision, t.seq_len)
        if asked not in self._parts:
            self._parts[asked] = self._cost_parts(cfg, pl)
        return self._parts[asked]

    def _cost_parts(self, cfg: Config, pl: Placement) -> list[range]:
        p = cfg.parallel
        n_stages, L = stage_count(p), self.m.n_layers
        if p.layer_costs is not None:
            costs = list(p.layer_costs)
        else:
            costs = [1.0] * L
        ranks = schedule_spec(p.schedule).stage_ranks(p.pp, stages_per_rank(p))
        speeds = [pl.pp_speed[ranks[s]] for s in range(n_stages)]
        embed, head = self.ends(cfg.train, p.tp, 1, pl.tp)
        lay = self.layer(cfg.train, p.tp, 1, pl.tp, "none")
        unit = lay.f.total + lay.b.total + lay.w.total
        key = (tuple(costs), n_stages, round(embed.total / unit, 9), round(head.total / unit, 9), tuple(speeds))
        if key not in self._parts:
            self._parts[key] = partition_by_cost(costs, n_stages, first_extra=key[2], last_extra=key[3], speeds=speeds)
        return self._parts[key]
