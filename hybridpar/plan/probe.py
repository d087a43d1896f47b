"""`hybridpar plan --probe`: measure this machine and describe it as a hardware file (plan/hardware.py).

In `ranks` processes on loopback, one intra-op thread each (as the trainer's ranks get), after a
barrier:

* matmul FLOP/s per device: fp32 and bf16 products of n x n matrices on rank 0 alone, the others
  waiting (what one rank gets on a core of its own: the peak);
* cores_per_node: every rank multiplying fp32 matrices at once, their summed rate over the one-rank
  rate (how many ranks' worth of compute the machine sustains; foreign load on a shared machine
  lowers it, as it would slow the run); alone and together alternate three times, medians kept;
* the calibration's `core_share`: the CPU time rank 0 got over the wall time while multiplying alone
  (under foreign load, below 1);
* memory_bandwidth_gbs: an elementwise add over activation-sized arrays (read two, write one);
* op_overhead_us: the same add on 8-element tensors, i.e. dispatching one operation;
* intra_node link: one-way time of a message between ranks 0 and 1 through the pipeline's own
  transport (pipeline/p2p.py; shared memory between CPU ranks of one host), round trips halved:
  latency from a 4-byte message, bandwidth from a 4 MiB one;
* collective_latency_us: an 8-byte all-reduce over all ranks (gloo, the process group's transport),
  over its 2 (ranks - 1) ring steps;
* collective_bandwidth_gbs: a fresh 4 MiB all-reduce over all ranks after SYNC_WORK_S of compute (a
  data-parallel gradient reduction), its time less the ring's hops over the bytes each step moves;
* step_sync_us: a step's three closing all-reduces (plan/hardware.py), every rank computing for
  `SYNC_WORK_S` of CPU time before them as a step's optimizer does, no barrier between: the way ranks
  reach them in a step, which idle back-to-back all-reduces do not show.
* sync_wait: per group size n dividing the world, groups of ranks world / n apart (as data-parallel
  replicas are placed) all at once, an 8-byte all-reduce after each of `SYNC_WAIT_WORK_S` of compute on
  every rank, less the same all-reduce back to back: how far apart ranks that did the same work reach a
  collective (averaged over the ranks).

* with a model and its shapes: the `[calibration]` table (plan/calibrate.py), every rank at once (the
  figures averaged over them): the model's own layer, embedding, head and optimizer timed at each (tp,
  sequences per microbatch); then one tensor-parallel all-reduce of a microbatch's activations at each
  tp > 1 of them.

Collectives' figures are means over their rounds, the other figures medians (see `_after_work`).

One machine is one node; inter_node repeats intra_node (there is no other node to measure).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

from hybridpar.config import ModelConfig
from hybridpar.plan.calibrate import Calibration, CollectiveTime, EndTime, LayerTime, calibrate
from hybridpar.plan.hardware import Hardware, Link
from hybridpar.plan.in_place import action_overhead, in_step, mean_over_ranks, rank_mean, tp_layers

MATMUL_N = 512
REPEATS = 3
ELEMENTS = 1 << 17  # 512 KiB per fp32 array: one microbatch's activations of a small model
SYNC_WORK_S = 2e-3  # CPU seconds each rank computes before a step's closing reductions (an optimizer step)
# CPU seconds of compute before the collective whose wait `sync_wait` measures: a few layers' worth and a
# small model's whole pipeline per rank (the default model's is 50-60 ms at 4 ranks); the cost model
# reads between them and holds the last beyond.
SYNC_WAIT_WORK_S = (0.002, 0.05)


def _rate(fn, work: float, seconds: float) -> float:
    """work / seconds of `fn()` run back to back for about `seconds` (after one warm-up call)."""
    fn()
    count, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds or count < 3:
        fn()
        count += 1
    return work * count / elapsed


def _matmul(dtype: Any, seconds: float) -> float:
    import torch

    a, b = torch.randn(MATMUL_N, MATMUL_N, dtype=dtype), torch.randn(MATMUL_N, MATMUL_N, dtype=dtype)
    c = torch.empty(MATMUL_N, MATMUL_N, dtype=dtype)
    return _rate(lambda: torch.mm(a, b, out=c), 2.0 * MATMUL_N**3, seconds)


def _add(n: int, seconds: float) -> float:
    """Seconds per torch.add of two n-element fp32 tensors."""
    import torch

    x, y, z = torch.randn(n), torch.randn(n), torch.empty(n)
    return 1.0 / _rate(lambda: torch.add(x, y, out=z), 1.0, seconds)


def _worker(
    seconds: float, round_trips: int, model: dict | None, seq_len: int, shapes: list, timeout_s: float
) -> dict[str, Any]:
    import torch.distributed as dist

    # A rank that finishes calibrating first waits at the next collective for the others (every shape
    # under foreign load took over a minute); the launch's own deadline (run_ranks kills all ranks) is
    # what bounds the wait.
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    m = None if model is None else ModelConfig(**model)
    return measure(seconds, round_trips, m, seq_len, [tuple(x) for x in shapes])


def measure(
    seconds: float = 0.5,
    round_trips: int = 50,
    model: ModelConfig | None = None,
    seq_len: int = 0,
    shapes: list[tuple[int, int]] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """Collective over the initialised default group (every rank calls it); rank 0's result holds the
    figures (`describe` turns them into a Hardware). With `model`: every rank also times its layers at
    each (tp, sequences per microbatch) of `shapes` (plan/calibrate.py), all at once."""
    import torch
    import torch.distributed as dist

    from hybridpar.pipeline.p2p import P2P
    from hybridpar.pipeline.ping import ping_pong

    me = dist.get_rank()
    out: dict[str, Any] = {"alone": [], "together": [], "share": []}
    # Alone and together alternate `REPEATS` times (medians kept): foreign load on a shared machine comes
    # and goes, and the ratio of the two is only meaningful when both see the same load.
    for _ in range(REPEATS):
        dist.barrier()
        if me == 0:  # alone: the others wait at the barrier below
            cpu0, wall0 = time.thread_time(), time.perf_counter()
            out["alone"].append(_matmul(torch.float32, seconds))
            out["share"].append((time.thread_time() - cpu0) / (time.perf_counter() - wall0))
        dist.barrier()
        together = torch.tensor([_matmul(torch.float32, seconds)], dtype=torch.float64)
        dist.all_reduce(together)
        out["together"].append(float(together))
    if me == 0:
        out["bf16"] = _matmul(torch.bfloat16, seconds)
        out["add_s"] = _add(ELEMENTS, seconds)
        out["op_s"] = _add(8, seconds)
    if model is not None and shapes:
        # Every rank at once, as a run's ranks compute: where they share cores, each operation costs more
        # CPU time than alone (caches, switches; the default model's layer +10% at 4 ranks on 2 cores).
        dist.barrier()
        cal = mean_over_ranks(calibrate(model, seq_len, list(shapes), min(seconds, 0.25)))
        coll = tp_layers(cal, model, seq_len, list(shapes), max(5, round_trips // 5))
        if me == 0:
            out["calibration"] = dataclasses.asdict(dataclasses.replace(cal, collectives=tuple(coll)))
    p2p = P2P(torch.device("cpu"), torch.float32, 60.0)
    for label, shape in (("small", (1,)), ("large", (1 << 20,))):
        dist.barrier()
        if me in (0, 1):
            rtts = ping_pong(p2p, me, 0, 1, lambda r: r, shape, round_trips, 3)
            if rtts:
                out[label] = statistics.median(rtts) / 2
    if model is not None and shapes:
        dist.barrier()
        overhead = action_overhead(p2p, model, seq_len, shapes[len(shapes) // 2][1], seconds)
        if me == 0:
            out["calibration"]["action_overhead_s"] = overhead
    dist.barrier()
    x = torch.zeros(2)
    times = []
    for i in range(round_trips + 3):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    out["all_reduce_s"] = statistics.median(times)
    out["step_sync_s"] = _step_sync(2 * round_trips)
    out["sync_wait"] = _sync_wait(max(10, round_trips // 2))
    out["big_all_reduce_s"] = _after_work(lambda: dist.all_reduce(torch.zeros(1 << 20)), max(5, round_trips // 4))
    return out


def _after_work(fn: Any, rounds: int, work_s: float = SYNC_WORK_S) -> float:
    """Mean wall seconds of `fn()` run on every rank after `work_s` of CPU work each, no barrier: how
    ranks reach a collective in a step. The mean, not the median: a step pays every call, and under
    shared cores the slow ones are a tenth of the calls and half the time (gloo's tensor-parallel
    all-reduce in a tp=2 step on 2 cores: median 1.1 ms, mean 2.1, 90th percentile 5)."""
    import torch

    a, c = torch.randn(64, 64), torch.empty(64, 64)
    calls = []
    for k in range(rounds + 3):
        end = time.thread_time() + work_s
        while time.thread_time() < end:
            torch.mm(a, a, out=c)
        t0 = time.perf_counter()
        fn()
        if k >= 3:
            calls.append(time.perf_counter() - t0)
    return statistics.fmean(calls)


def _step_sync(rounds: int) -> float:
    """Mean wall seconds of a step's closing reductions (trainer/step.py: the loss and out-of-memory
    flags with the ranks' timings, the step time and peak by max, the gradient norm's square), each
    round after SYNC_WORK_S of CPU work on every rank; collective over the default group."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()

    def closing() -> None:
        dist.all_reduce(torch.zeros(2 + 5 * world, dtype=torch.float64))
        dist.all_reduce(torch.zeros(2, dtype=torch.float64), op=dist.ReduceOp.MAX)
        dist.all_reduce(torch.zeros((), dtype=torch.float64))

    return _after_work(closing, rounds)


def _sync_wait(rounds: int) -> list[list[float]]:
    """Collective over the default group: [ranks, work_us, wait_us] rows (plan/hardware.py's
    `sync_wait`), per group size n dividing the world (groups of ranks world / n apart, all at once) and
    work in SYNC_WAIT_WORK_S: the mean wall of an 8-byte all-reduce after that work on every rank, less
    its mean back to back, averaged over the ranks. On 2 cores shared by 4 ranks: 1-2 ms after 2 ms of
    work, 3-5 ms after 50 ms in groups of 2 (noisy: the scheduler's placement of ranks decides it)."""
    import torch
    import torch.distributed as dist

    world, me = dist.get_world_size(), dist.get_rank()
    x = torch.zeros(2)
    rows = []
    for n in [d for d in range(2, world + 1) if world % d == 0]:
        mine = None  # the default group
        if n < world:  # every rank creates every group, in the same order (new_group is collective)
            stride = world // n  # replicas as the mesh places them (topology/mesh.py: dp outermost)
            mine = [dist.new_group(list(range(s, world, stride))) for s in range(stride)][me % stride]
        dist.barrier()
        reduce = lambda: dist.all_reduce(x, group=mine)  # noqa: E731
        idle = _after_work(reduce, rounds, 0.0)
        rows += [[n, w * 1e6, max(0.0, _after_work(reduce, rounds, w) - idle) * 1e6] for w in SYNC_WAIT_WORK_S]
    waits = rank_mean([r[2] for r in rows])
    return [[n, w, x] for (n, w, _), x in zip(rows, waits)]


def probe(
    ranks: int = 2,
    seconds: float = 0.5,
    round_trips: int = 50,
    model: ModelConfig | None = None,
    seq_len: int = 0,
    shapes: list[tuple[int, int]] = (),  # type: ignore[assignment]
) -> Hardware:
    """Measure this machine with `ranks` processes (at least 2: the links need two ends); with a model,
    calibrate its layers at `shapes` too."""
    from hybridpar.topology.spawn import run_ranks

    if ranks < 2:
        raise ValueError(f"--world must be at least 2 to measure the links between ranks, got {ranks}")
    m = None if model is None else dataclasses.asdict(model)
    timeout = 120 + 30 * seconds * ranks + 5 * len(shapes)
    return describe(
        [run_ranks(_worker, ranks, seconds, round_trips, m, seq_len, list(shapes), timeout, timeout_s=timeout)[0]],
        ranks,
    )


def _pooled_calibration(measured: list[dict[str, Any]], ranks: int, cores: float) -> Calibration | None:
    """Element-wise medians of the measurements' calibrations (same shapes in each); None if any lacks one."""
    cals = [r.get("calibration") for r in measured]
    if not cals or any(c is None for c in cals):
        return None
    med = lambda rows, cls: tuple(  # noqa: E731
        cls(**{k: statistics.median(c[i][k] for c in rows) for k in rows[0][i]}) for i in range(len(rows[0]))
    )
    return Calibration(
        cals[0]["model"],
        tuple(
            dataclasses.replace(x, tp=int(x.tp), tokens=int(x.tokens))
            for x in med([c["layers"] for c in cals], LayerTime)
        ),
        tuple(dataclasses.replace(x, tokens=int(x.tokens)) for x in med([c["ends"] for c in cals], EndTime)),
        statistics.median(c["optimizer_layer_s"] for c in cals),
        statistics.median(c["action_overhead_s"] for c in cals),
        min(1.0, statistics.median(x for r in measured for x in r["share"])),
        tuple(
            dataclasses.replace(x, tp=int(x.tp), tokens=int(x.tokens))
            for x in med([[in_step(r, ranks, cores) for r in c.get("collectives", [])] for c in cals], CollectiveTime)
        ),
    )


def _pooled_sync_wait(measured: list[dict[str, Any]]) -> tuple[tuple[int, float, float], ...] | None:
    """The measurements' `sync_wait` rows, the waits' medians (the same rows in each); None if any lacks them."""
    if not all(r.get("sync_wait") for r in measured):
        return None
    rows = zip(*(r["sync_wait"] for r in measured))
    return tuple((int(rs[0][0]), float(rs[0][1]), statistics.median(r[2] for r in rs)) for rs in rows)


def _ring_gbs(measured: list[dict[str, Any]], ranks: int) -> float | None:
    """GB/s of a ring step from the 4 MiB all-reduce: each of its 2 (ranks - 1) steps moves 1/ranks of
    the bytes after one hop's latency (the 8-byte all-reduce's share)."""
    if not all("big_all_reduce_s" in r for r in measured):
        return None
    steps = 2 * (ranks - 1)
    big = statistics.median(r["big_all_reduce_s"] for r in measured)
    hop = statistics.median(r["all_reduce_s"] for r in measured) / steps
    return (4 << 20) / ranks / max(big / steps - hop, 1e-9) / 1e9


def describe(measured: list[dict[str, Any]], ranks: int, memory_gib: float | None = None) -> Hardware:
    """The hardware file of one or more `measure` results of rank 0 (several: pooled, medians)."""
    pool = lambda k: [x for r in measured for x in r[k]]  # noqa: E731
    med = lambda k: statistics.median(r[k] for r in measured)  # noqa: E731
    alone = statistics.median(pool("alone"))
    cores = statistics.median(t / a for t, a in zip(pool("together"), pool("alone")))
    latency = med("small")
    bandwidth = (1 << 22) / max(med("large") - latency, 1e-9)
    link = Link(bandwidth / 1e9, latency * 1e6)
    if memory_gib is None:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / ranks
    return Hardware(
        name=f"{socket.gethostname()}: {os.cpu_count()} CPUs as {ranks} ranks, one thread each (measured)",
        source=f"hybridpar plan --probe, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
        + " ".join(f"{x:.2f}" for x in os.getloadavg()),
        nodes=1,
        devices_per_node=ranks,
        device_memory_gib=round(memory_gib, 3),
        peak_tflops={"fp32": alone / 1e12, "bf16": med("bf16") / 1e12},
        intra_node=link,
        inter_node=link,
        memory_bandwidth_gbs=3 * 4 * ELEMENTS / med("add_s") / 1e9,
        cores_per_node=min(float(ranks), cores),
        op_overhead_us=med("op_s") * 1e6,
        collective_latency_us=med("all_reduce_s") / (2 * (ranks - 1)) * 1e6,
        collective_bandwidth_gbs=_ring_gbs(measured, ranks),
        step_sync_us=med("step_sync_s") * 1e6 if all("step_sync_s" in r for r in measured) else None,
        sync_wait=_pooled_sync_wait(measured),
        calibration=_pooled_calibration(measured, ranks, min(float(ranks), cores)),
    )
