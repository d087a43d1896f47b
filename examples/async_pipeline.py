"""An asynchronous pipeline with real messages: a 12-layer model over 4 pipeline stages (4 worker
processes), a batch of 16 requests in micro-batches of 4. With 4 micro-batches in flight
every stage works on a different micro-batch at once; with 1 at a time the stages take turns.
Both runs generate the same tokens (greedy); the numbers printed are measured.

    .venv/bin/python examples/async_pipeline.py
"""

from __future__ import annotations

import time

from hybridpar.config import ModelConfig
from hybridpar.serve.config import ServeConfig
from hybridpar.serve.service import Service

MODEL = ModelConfig(dim=128, n_layers=12, n_heads=4, ffn_dim=352)
BATCH, MICROBATCH, NEW_TOKENS = 16, 4, 32


def run(groups_in_flight: int) -> tuple[float, int, list[list[int]]]:
    cfg = ServeConfig(
        source="init:0", pp=4, max_batch=MICROBATCH, max_groups=groups_in_flight, kv_tokens=BATCH * 128, max_seq_len=128
    )
    svc = Service(cfg, MODEL, cfg.source)
    try:
        prompts = [list(f"request {i}: ".encode()) for i in range(BATCH)]
        t0 = time.perf_counter()
        pend = [svc.submit(p, NEW_TOKENS, 0.0, 1.0, 0) for p in prompts]
        outs = []
        for p in pend:
            toks = []
            while (ev := p.events.get(timeout=300))[0] == "token":
                toks.append(ev[1])
            outs.append(toks)
        wall = time.perf_counter() - t0
        time.sleep(0.2)  # one more status report from the driver
        return wall, svc.replica_status[0]["max_in_flight"], outs
    finally:
        svc.close()


if __name__ == "__main__":
    print(
        f"{MODEL.n_layers} layers over 4 stages, batch {BATCH}, microbatch {MICROBATCH}, {NEW_TOKENS} new tokens each"
    )
    seq_wall, seq_flight, seq_out = run(groups_in_flight=1)
    pipe_wall, pipe_flight, pipe_out = run(groups_in_flight=BATCH // MICROBATCH)
    assert seq_out == pipe_out, "pipelining must not change the tokens"
    total = BATCH * NEW_TOKENS
    print(
        f"one micro-batch    : {seq_wall:6.2f} s  {total / seq_wall:7.1f} tokens/s"
        f"  (max micro-batches in flight {seq_flight})"
    )
    print(
        f"4 in flight         : {pipe_wall:6.2f} s  {total / pipe_wall:7.1f} tokens/s"
        f"  (max micro-batches in flight {pipe_flight})"
    )
    print(f"speedup {seq_wall / pipe_wall:.2f}x, identical tokens")
