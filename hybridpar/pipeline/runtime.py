"""The one pipeline runtime: executes a rank's action list (see schedules.py) for one step.

Every stage boundary cuts the autograd graph: a stage's input is a fresh leaf, its backward is driven
by the gradient its successor sent back. Boundaries between stages on the same rank (the turn of
ZB-V's V on the last rank, or pp=1) hand tensors over through a local mailbox instead of P2P, so the
same code runs every layout and stage placement (`stage_peer` says where each stage lives).
Microbatches may have different sizes; each message's shape comes from its microbatch, which every
rank knows from the step's split. Schedules with W actions (zero bubble)
split each backward into B (input gradient) and W (weight gradient), see split_backward.py.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from hybridpar.model.tp import rebind_regather
from hybridpar.pipeline.activation_meter import ActivationMeter
from hybridpar.pipeline.p2p import P2P
from hybridpar.pipeline.schedules import Action, Op
from hybridpar.pipeline.split_backward import WeightGradDeferral

Key = tuple[int, int]  # (stage, microbatch)
# loss_fn(last stage output, targets, scale) -> the microbatch's loss, a scalar with its graph.
LossFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    """Sum of the token cross-entropies of logits (b, T, vocab) against targets (b, T), times scale."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") * scale


@dataclass
class ActionTime:
    action: Action
    start: float
    end: float
    # Emulation only (`emulate.layer_timing=emulated`): the compute action's emulated seconds, which the
    # monitor and the balancer read instead of end - start (balance/monitor.py `stage_times`).
    emulated: float | None = None


@dataclass
class StepOutput:
    loss: torch.Tensor | None  # sum over this rank's microbatches of scaled token losses (last stage only)
    timeline: list[ActionTime] = field(default_factory=list)
    waits: list[ActionTime] = field(default_factory=list)  # time blocked on a message, inside F/B actions
    out_of_memory: str | None = None  # this rank ran out of memory: the step's gradients are garbage


@dataclass
class _Step:
    """Tensors in flight during one step."""

    inputs: Sequence[torch.Tensor | None]
    targets: Sequence[torch.Tensor | None]
    shapes: list[tuple[int, ...]]
    loss_scale: float
    train: bool
    split: bool  # B and W are separate actions
    saved: dict[Key, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    to_send: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)  # awaiting SEND_F/SEND_B
    local_act: dict[Key, torch.Tensor] = field(default_factory=dict)
    local_grad: dict[Key, torch.Tensor] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    waits: list[ActionTime] = field(default_factory=list)
    failed: str | None = None  # out of memory: the rest of the step only keeps messages flowing
    emulated: dict[Action, float] = field(default_factory=dict)  # compute action -> its emulated seconds
    documents: Sequence[Any] | None = None  # per microbatch: positions and mask (model/documents.py)


class PipelineRuntime:
    """Runs actions for the stages this rank holds. `stage_peer(s)` is the global rank holding stage s
    (same dp and tp coordinates as us). `loss_fn` turns the last stage's output into the loss."""

    def __init__(
        self,
        stages: dict[int, nn.Module],
        n_stages: int,
        stage_peer: Callable[[int], int],
        p2p: P2P,
        hidden: int,
        loss_fn: LossFn = token_cross_entropy,
    ) -> None:
        self.stages, self.n_stages, self.loss_fn = stages, n_stages, loss_fn
        self.stage_peer, self.p2p, self.hidden = stage_peer, p2p, hidden
        self._deferral: dict[int, WeightGradDeferral] = {}
        # Emulation only (emulate/): a compute action takes stretch x its own compute time, or with an
        # emulated cost max(own, stretch x the cost), message waits excluded; the rank sleeps the rest.
        # `stretch` (slowdown.py) makes this rank a device `stretch` times slower, 1.0 = off.
        # `emulated_cost(stage, samples)` (layer_cost.py) is one forward's emulated seconds (backward
        # twice that; a split backward's B and W once each): the real compute inside an action is absorbed
        # up to that cost, so a loaded machine's contention does not change the emulated speeds.
        # `report_emulated`: the timeline carries each compute action's emulated seconds (ActionTime.emulated).
        self.stretch = 1.0
        self.emulated_cost: Callable[[int, int], float] | None = None
        self.report_emulated = False
        self.meter: ActivationMeter | None = None  # counts the activations forward passes save
        # Mixed precision (train.precision=bf16): stages compute under autocast to this dtype; their
        # parameters, gradients and the residual stream inside a stage stay fp32. Messages between ranks
        # travel in the P2P's dtype and are widened back to fp32 on arrival, so the only rounding the
        # pipeline adds to the one-device bf16 model is one per stage boundary and direction.
        self.autocast: torch.dtype | None = None
        # The residual stream's dtype inside a stage, which a received message is widened (or not) to: bf16
        # under bf16 working copies (train.bf16_weights=copies: the parameters themselves are bf16, no autocast).
        self.compute_dtype = torch.float32
        self.profiling = False  # name each action as a torch.profiler range (set for profiled steps only)
        # Called with the stage after each of its compute actions (ZeRO-3 frees gathered parameters there).
        self.after_compute: Callable[[int], None] | None = None
        # Sequence parallelism (model/tp.py): a message holds this tp rank's 1/seq_shards of the sequence.
        self.seq_shards = 1

    def _precision(self) -> contextlib.AbstractContextManager:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.p2p.device.type, dtype=self.autocast)

    def _step_casts(self, train: bool) -> contextlib.AbstractContextManager:
        return step_casts(self.p2p.device.type, self.autocast, self.stages.values(), train)

    def _remote(self, a: int, b: int) -> bool:
        return self.stage_peer(a) != self.stage_peer(b)

    def layers_changed(self) -> None:
        """The stages' layers were replaced (a live re-partition): the split backward's hooks sit on the old
        ones (a layer moved between two stages of this rank carries its old stage's), so drop them all; each
        stage's next B/W hooks its current layers afresh."""
        for d in self._deferral.values():
            d.detach()
        self._deferral.clear()
        for st in self.stages.values():  # moved layers' sequence-parallel re-gathers follow their new stage
            rebind_regather(st)
            st.sp_regather = getattr(st, "sp_backward", "saved") == "regather"
            st.rebuild_now = st.rebuild_saved

    def _split(self, s: int) -> WeightGradDeferral:
        if s not in self._deferral:
            self._deferral[s] = WeightGradDeferral(self.stages[s])
            self._deferral[s].meter = self.meter
            # W keeps each linear layer's input from F on: a sequence-parallel re-gather would save nothing.
            self.stages[s].sp_regather = self.stages[s].rebuild_now = False  # nor would a rebuild
        return self._deferral[s]

    def run(
        self,
        actions: Sequence[Action],
        inputs: Sequence[torch.Tensor | None],
        targets: Sequence[torch.Tensor | None],
        loss_scale: float,
        *,
        train: bool = True,
        on_stage_done: Callable[[int], None] | None = None,
        documents: Sequence[Any] | None = None,
    ) -> StepOutput:
        """Execute one step. inputs[m]/targets[m]: token ids (b_m, T) of microbatch m. The loss of
        microbatch m is loss_fn(output, targets[m], loss_scale), by default sum(token CE) * loss_scale, so
        that with loss_scale = 1 / tokens-in-global-batch
        the gradients summed over every replica and microbatch are exactly those of the global token
        mean. `documents[m]`, where given, goes to every stage's forward of microbatch m (attention within
        documents: model/documents.py). `on_stage_done(s)` fires once stage s's gradients are complete on
        this rank (its last backward or weight action), where the data-parallel reduction of them can start."""
        ref = inputs[0] if inputs[0] is not None else targets[0]
        sizes = [t.shape[0] for t in (inputs if inputs[0] is not None else targets)]
        split = any(a.op == Op.WEIGHT for a in actions)
        T = ref.shape[1] // self.seq_shards
        st = _Step(inputs, targets, [(b, T, self.hidden) for b in sizes], loss_scale, train, split)
        st.documents = documents
        final_op = Op.WEIGHT if split else Op.BACKWARD
        done_at = {a.stage: i for i, a in enumerate(actions) if a.op == final_op}
        timeline: list[ActionTime] = []
        p2p = self.p2p
        with self._step_casts(train):
            for i, a in enumerate(actions):
                t0 = time.perf_counter()
                # Under torch.profiler (report/profile.py) each action is a range named like the trace's.
                with record_function(str(a)) if self.profiling else contextlib.nullcontext():
                    self._act(st, a, split, t0)
                if on_stage_done is not None and done_at.get(a.stage) == i and train:
                    on_stage_done(a.stage)
                timeline.append(ActionTime(a, t0, time.perf_counter(), st.emulated.pop(a, None)))
        p2p.wait_sends()
        assert not (st.saved or st.to_send or st.local_act or st.local_grad), f"unfinished work: {sorted(st.saved)}"
        return StepOutput(loss=st.loss, timeline=timeline, waits=st.waits, out_of_memory=st.failed)

    def _act(self, st: _Step, a: Action, split: bool, t0: float) -> None:
        s, m, op, p2p = a.stage, a.microbatch, a.op, self.p2p
        # Borrowed receives (the message where it landed, no copy) are released as soon as
        # nothing reads them; with a split backward W may read them later, so they are not.
        if op == Op.RECV_F:
            p2p.queue_recv(("F", s, m), st.shapes[m], self.stage_peer(s - 1), borrow=not split)
        elif op == Op.RECV_B:
            p2p.queue_recv(("B", s, m), st.shapes[m], self.stage_peer(s + 1), borrow=not split)
        elif op == Op.SEND_F:
            p2p.queue_send(st.to_send.pop(("F", s, m)), self.stage_peer(s + 1))
        elif op == Op.SEND_B:
            p2p.queue_send(st.to_send.pop(("B", s, m)), self.stage_peer(s - 1))
        elif op in (Op.FORWARD, Op.BACKWARD, Op.WEIGHT):
            n_waits = len(st.waits)
            if op == Op.FORWARD:
                self._forward(st, s, m)
            elif op == Op.BACKWARD:
                self._backward(st, s, m)
            elif st.failed is None:
                p2p.flush()  # like F and B: the preceding B's SEND_B must not wait behind this W
                self._compute(st, lambda: self._split(s).weight((s, m)))
            if self.after_compute is not None:
                self.after_compute(s)
            if self.stretch > 1.0 or self.emulated_cost is not None:
                self._emulate(st, a, split, t0, n_waits)
        else:
            raise ValueError(f"runtime cannot execute {a}")

    def _emulate(self, st: _Step, a: Action, split: bool, t0: float, n_waits: int) -> None:
        """Sleep so that compute action `a` (begun at `t0`) lasts stretch x its own time, or with an emulated
        cost at least stretch x that cost."""
        own = time.perf_counter() - t0 - sum(w.end - w.start for w in st.waits[n_waits:])
        if self.emulated_cost is None:
            time.sleep((self.stretch - 1.0) * max(0.0, own))
            return
        units = 2.0 if a.op == Op.BACKWARD and not split else 1.0  # B = 2F; split: B = W = F
        # The emulated device is `stretch` x slower: its cost stretches, the real compute stays noise.
        emulated = self.stretch * units * self.emulated_cost(a.stage, st.shapes[a.microbatch][0])
        if self.report_emulated:
            st.emulated[a] = emulated
        time.sleep(max(0.0, emulated - own))

    def _compute(self, st: _Step, work: Callable[[], None]) -> None:
        """Run `work`; on out-of-memory drop the step's graphs and go on without computing: peers
        still get every message they wait for (zeros), so no rank hangs, and the trainer, told through
        the step's result, throws the step away and redoes it with smaller microbatches."""
        try:
            work()
        except torch.OutOfMemoryError as e:
            st.failed = str(e).splitlines()[0] if str(e) else "out of memory"
            if not st.split:  # the graphs that read them go with st.saved
                for _, _, buf in st.saved.values():
                    if buf is not None:
                        self.p2p.release(buf)
            st.saved.clear()
            for d in self._deferral.values():
                d.clear()
            if self.meter is not None:
                self.meter.clear()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _recv(self, st: _Step, kind: str, s: int, m: int) -> torch.Tensor:
        t0 = time.perf_counter()
        buf = self.p2p.wait_recv((kind, s, m))
        st.waits.append(ActionTime(Action(s, Op.RECV_F if kind == "F" else Op.RECV_B, m), t0, time.perf_counter()))
        return buf

    def _forward(self, st: _Step, s: int, m: int) -> None:
        self.p2p.flush()  # put queued sends and early receives on the wire before computing
        buf = None
        if s == 0:
            x = st.inputs[m]
        else:
            if self._remote(s - 1, s):
                buf = self._recv(st, "F", s, m)
                x = buf.detach().to(self.compute_dtype)  # the buffer itself where the dtypes agree
            else:
                x = st.local_act.pop((s, m))
            x.requires_grad_(st.train)
        out: list[torch.Tensor] = []
        if st.failed is None:
            self._compute(st, lambda: out.append(self._forward_compute(st, s, m, x, buf)))
        if buf is not None and st.saved.get((s, m), (None,) * 3)[2] is not buf:
            # Nothing will read it: evaluation, a failed step, or a bf16 message, which the stage read through
            # its fp32 copy (x) — so it goes back now rather than after the backward.
            self.p2p.release(buf)
        if s == self.n_stages - 1:
            return
        y = (
            out[0] if out else torch.zeros(st.shapes[m], dtype=self.p2p.dtype, device=self.p2p.device)
        )  # failed: keep peers going
        if self._remote(s, s + 1):
            st.to_send[("F", s, m)] = y.to(self.p2p.dtype)
        else:
            st.local_act[(s + 1, m)] = y

    def _forward_compute(self, st: _Step, s: int, m: int, x: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
        if st.split and st.train:
            self._split(s).key = (s, m)
        with (
            torch.set_grad_enabled(st.train),
            self.meter.measuring() if self.meter is not None and st.train else contextlib.nullcontext(),
        ):
            try:
                with self._precision():
                    y = self.stages[s](x) if st.documents is None else self.stages[s](x, st.documents[m])
                if s == self.n_stages - 1:
                    y = self.loss_fn(y, st.targets[m], st.loss_scale)
                    st.loss = y.detach() if st.loss is None else st.loss + y.detach()
            finally:
                if st.split and st.train:
                    self._split(s).key = None
        if st.train:  # an fp32 message is x itself, read by the backward; a bf16 one was copied into x
            st.saved[(s, m)] = (x if s > 0 else None, y, buf if buf is not None and buf.dtype == x.dtype else None)
        return y.detach()

    def _backward(self, st: _Step, s: int, m: int) -> None:
        self.p2p.flush()
        g = None
        remote = s < self.n_stages - 1 and self._remote(s, s + 1)
        if s < self.n_stages - 1:
            g = self._recv(st, "B", s, m) if remote else st.local_grad.pop((s, m))
        out: list[torch.Tensor | None] = []
        if st.failed is None:
            self._compute(st, lambda: out.append(self._backward_compute(st, s, m, g)))
        if remote and not st.split:  # the graph that read it is gone (or, failed, never ran)
            self.p2p.release(g)
        if s > 0:
            dx = out[0] if out else torch.zeros(st.shapes[m], dtype=self.p2p.dtype, device=self.p2p.device)
            if self._remote(s - 1, s):
                st.to_send[("B", s, m)] = dx.to(self.p2p.dtype)
            else:
                st.local_grad[(s - 1, m)] = dx

    def _backward_compute(self, st: _Step, s: int, m: int, g: torch.Tensor | None) -> torch.Tensor | None:
        x, y, buf = st.saved.pop((s, m))
        if g is not None and g.dtype != y.dtype:  # a bf16 message: the graph's output is fp32
            g = g.to(y.dtype)
        # Buffers go back once nothing can read them: after a full backward the graph that saved them is
        # gone; with a split backward, W may still read tensors that alias them (autograd hands the
        # incoming gradient through the residual add unchanged), so they are not given back: each is freed
        # when its last reader drops it (the P2P keeps no reference to a landed receive, P2P._forget).
        try:
            if st.split:
                return self._split(s).backward_input(y, g, x, (s, m))
            torch.autograd.backward(y, g)
            return x.grad if x is not None else None
        finally:
            if buf is not None and not st.split:
                self.p2p.release(buf)


def step_casts(
    device: str, dtype: torch.dtype | None, stages: Iterable[nn.Module], train: bool
) -> contextlib.AbstractContextManager:
    """One bf16 copy of each weight per step instead of one per microbatch. Autocast caches the cast of a
    weight (an fp32 leaf that requires grad) until the outermost autocast region exits; each compute
    action enters its own, so without this every microbatch's forward casts every weight again and its
    graph saves that copy until its backward: at seq 8192 tp8 that was 0.74 GiB per layer and microbatch
    in flight. A disabled autocast around the step is an outer region that changes nothing about what
    runs under autocast (the actions still enable it, backward still runs outside it) but keeps the cache
    until the step ends; the copies are the same bits, so results are bit-identical. The cached copy's
    graph node reaches the fp32 master, so every microbatch's weight gradient still flows into it.

    Only for training steps (a cast made without grad would be cached without its graph: evaluation
    steps stay per action) and only where no stage of the rank recomputes: a recomputed layer saves no
    copies between its forward and its backward, and a step-long cache would hold them all the same."""
    if dtype is None or not train or any(getattr(s, "recompute", "none") != "none" for s in stages):
        return contextlib.nullcontext()
    return torch.autocast(device, dtype=dtype, enabled=False)


def forward_actions(actions: Sequence[Action]) -> list[Action]:
    """The forward-only part of a schedule (evaluation): drop backward work and gradient messages."""
    return [a for a in actions if a.op in (Op.FORWARD, Op.SEND_F, Op.RECV_F)]
