"""Ring collectives' time on a hardware description (plan/cost.py's communication terms).

An all-reduce moves 2 (n-1)/n of the bytes and takes 2 (n-1) hops, an all-gather half of that; on a GPU
(NCCL) an all-reduce takes the tree instead where that is faster (few bytes over many ranks). A ring step
moves its bytes at `Hardware.link_bps`: the link's bandwidth, at the GPU calibration's bus fraction where the
hardware file has one (plan/gpu_model.py; nccl-tests' bus bandwidth is what one ring step reaches), or at
the probe's measured collective figure on a CPU host where that is lower.
"""

from __future__ import annotations

import math

from hybridpar.plan.hardware import Hardware, Link


def all_reduce_s(nbytes: float, n: int, link: Link, hw: Hardware) -> float:
    """The ring's time; on a GPU (a `[gpu_calibration]`: NCCL) the faster of the ring and the tree."""
    if n <= 1:
        return 0.0
    ring = 2 * (n - 1) * (_hop_s(link, hw) + nbytes / n / _ring_bps(link, hw))
    return ring if hw.gpu_calibration is None else min(ring, tree_all_reduce_s(nbytes, n, link, hw))


def tree_all_reduce_s(nbytes: float, n: int, link: Link, hw: Hardware) -> float:
    """NCCL's tree all-reduce (double binary trees, after Sanders et al. 2009; NCCL chooses between it and
    the ring by size): a reduce up and a broadcast down a tree of depth log2 n, pipelined in chunks, so its
    latency is 2 log2 n hops where the ring's is 2 (n - 1), and every byte crosses a link twice at full
    rate. Small collectives over thousands of ranks (a step's loss and norm reductions) take the tree."""
    return 2 * math.ceil(math.log2(n)) * _hop_s(link, hw) + 2 * nbytes / _ring_bps(link, hw)


def all_gather_s(nbytes: float, n: int, link: Link, hw: Hardware) -> float:
    """All-gather whose result is `nbytes` in all."""
    if n <= 1:
        return 0.0
    return (n - 1) * (_hop_s(link, hw) + nbytes / n / _ring_bps(link, hw))


def _ring_bps(link: Link, hw: Hardware) -> float:
    """Bytes/s of one ring step: `Hardware.link_bps`, or the hardware's collective figure where that is lower."""
    bw = hw.link_bps(link)
    return bw if hw.collective_bandwidth_gbs is None else min(bw, hw.collective_bandwidth_gbs * 1e9)


def _hop_s(link: Link, hw: Hardware) -> float:
    """Latency of one step of a ring collective: the hardware's collective figure where it has one."""
    return (hw.collective_latency_us if hw.collective_latency_us is not None else link.latency_us) * 1e-6


def p2p_s(nbytes: float, link: Link, hw: Hardware) -> float:
    """One point-to-point message (a pipeline hand-off, a hop of ring attention's key/value blocks): the
    link's latency and its bytes at `Hardware.link_bps`, as the simulator moves pipeline messages."""
    return link.latency_us * 1e-6 + nbytes / hw.link_bps(link)


def reduce_scatter_s(nbytes: float, n: int, link: Link, hw: Hardware) -> float:
    """Reduce-scatter of `nbytes` in all (each rank keeps 1/n of the sum): the all-gather's steps, reversed."""
    return all_gather_s(nbytes, n, link, hw)
