"""Slow-link emulation (`--emulate.slow_link "1:10"`): a named testing/benchmark mode, off by default, that
makes one pipeline boundary slower than the others, so the balancer and the microbatch policy meet a job
whose bottleneck is a link, not a device.

`"B:F"` slows the link between pipeline ranks B and B + 1 (of every replica and tp rank) by a factor F:
every message received across it, either way, arrives `(F - 1) x emulate.link_ms` later than it would
(the receiver sleeps that long once the message is there, counted as a message wait). `emulate.link_ms`
is the emulated time of one message on a normal link; on one host the other links really take well under
it (shared memory), so they are left as they are. Fewer, larger microbatches send fewer messages over the
slow link, which is the answer (the adaptive microbatch policy, batching/adaptive.py): moving layers does
not help, and the balancer, which times compute with message waits taken out, sees no slow device.

Grammar: "" (off) or "B:F" with 0 <= B < pp - 1 and F >= 1.
"""

from __future__ import annotations

import re

from hybridpar.emulate.slowdown import parse_factor

EXPECTED_FORM = "<boundary>:<factor>, e.g. '1:10' (pipeline ranks 1 and 2, 10x slower)"


def parse_slow_link(spec: str, pp: int | None = None) -> tuple[int, float] | None:
    """(boundary, factor) of `emulate.slow_link`, None when off; ValueError naming the key otherwise."""
    text = spec.replace(" ", "")
    if not text:
        return None
    m = re.fullmatch(r"(\d+):([0-9.eE+-]+)", text)
    if m is None:
        raise ValueError(f"emulate.slow_link={spec!r} is malformed: expected {EXPECTED_FORM}")
    boundary = int(m[1])
    factor = parse_factor(m[2], f"emulate.slow_link={spec!r}", EXPECTED_FORM)
    if pp is not None and not boundary < pp - 1:
        raise ValueError(
            f"emulate.slow_link={spec!r}: boundary {boundary} is not between two of parallel.pp={pp} "
            f"pipeline ranks (0..{pp - 2})"
        )
    return boundary, factor


def link_delays(spec: str, link_ms: float, pp: int, pp_rank: int, peer_of: dict[int, int]) -> dict[int, float]:
    """Seconds to add to each message this rank receives, by sending global rank: the slow boundary's other
    end, if this rank is at it. `peer_of[r]`: the global rank of pipeline rank r beside this one."""
    parsed = parse_slow_link(spec, pp)
    if parsed is None:
        return {}
    boundary, factor = parsed
    other = {boundary: boundary + 1, boundary + 1: boundary}.get(pp_rank)
    return {} if other is None else {peer_of[other]: (factor - 1.0) * link_ms / 1000.0}
