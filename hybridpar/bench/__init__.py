"""Benchmarks runnable from the CLI: `hybridpar bench pipeline ...` (hybridpar's pipeline runtime side
by side with torch.distributed.pipelining) and `hybridpar bench balance ...` (static layout vs live
load balancing with a slow rank, against the capacity bound). Submodules are imported lazily: they
import torch."""

from __future__ import annotations

import sys

BENCHES = ("pipeline", "balance")


def main(argv: list[str]) -> int:
    """`hybridpar bench NAME [args]` -> hybridpar.bench.NAME.main(args)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: hybridpar bench {{{','.join(BENCHES)}}} [--help] [args ...]", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in BENCHES:
        print(f"hybridpar: unknown benchmark {argv[0]!r}; benchmarks: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    if argv[0] == "balance":
        from hybridpar.bench.balance import main as balance_main

        return balance_main(argv[1:])
    from hybridpar.bench.pipeline import main as pipeline_main

    return pipeline_main(argv[1:])
