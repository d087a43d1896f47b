"""`hybridpar bench prepare_scaling`: how `hybridpar data prepare --workers N` scales, against the
`tokenizers` batch encoder alone on the same cores and documents.

The `tokenizers` library encodes a batch on its own threads (all the cores unless RAYON_NUM_THREADS says
otherwise, read once when a process starts), so one `prepare` process already uses every core and a
comparison of worker counts must fix the threads. Each contender therefore runs in a fresh process with
its thread count set at start:

* `encoder-1-thread`: the batch encoder alone on texts already in memory, one thread;
* `encoder-threads`: the same with the library's own threads (every core);
* `prepare-1-worker`: `prepare` in one process, its encoder on one thread;
* `prepare-2-workers`: `prepare --workers 2`, each worker's encoder on cpus // 2 threads (one on 2 cores);
* `prepare-threads`: `prepare` in one process with the library's own threads (the default).

`prepare` counts reading the corpus and writing the token file; the encoders only the encoding. The
contenders alternate (in a rotated order each repeat) so drift in the machine's load hits all alike;
reported: every run's tokens/s, the medians, the ratios the scaling targets name, and the load average
before and after. JSON on stdout, and to --out if given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridpar.bench import emit
from hybridpar.bench.prepare import corpus_options

KINDS = ("encoder-1-thread", "encoder-threads", "prepare-1-worker", "prepare-2-workers", "prepare-threads")
ONE_THREAD = {"encoder-1-thread", "prepare-1-worker", "prepare-2-workers"}  # the parent of 2 workers encodes nothing


def _child(kind: str, tok_dir: str, corpus: str | None, max_bytes: int, out: str) -> dict[str, float]:
    """One contender's run, in this (fresh) process: tokens of text encoded and the seconds it took."""
    from hybridpar.data.prepare import BATCH_DOCS, documents, prepare
    from hybridpar.data.tokenizer import Tokenizer

    if kind.startswith("encoder"):
        tok, texts = Tokenizer(tok_dir), list(documents(corpus, max_bytes))
        t0 = time.perf_counter()
        n = sum(
            len(ids) for i in range(0, len(texts), BATCH_DOCS) for ids in tok.encode_batch(texts[i : i + BATCH_DOCS])
        )
        return {"tokens": n, "seconds": time.perf_counter() - t0}
    t0 = time.perf_counter()
    meta = prepare(tok_dir, out, corpus, max_bytes, workers=2 if kind == "prepare-2-workers" else 1)
    # The text's tokens, as the encoder counts them (less the end-of-text id closing each document).
    return {"tokens": meta["tokens"] - meta["documents"], "seconds": time.perf_counter() - t0}


def _run(kind: str, tok_dir: str, corpus: str | None, max_bytes: int, tmp: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "RAYON_NUM_THREADS"}
    if kind in ONE_THREAD:
        env["RAYON_NUM_THREADS"] = "1"
    args = [sys.executable, "-m", "hybridpar.bench.prepare_scaling", "--child", kind, "--tokenizer", tok_dir]
    args += ["--max-bytes", str(max_bytes), "--out", str(Path(tmp) / f"{kind}.bin")]
    args += ["--input", corpus] if corpus else []
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"hybridpar bench prepare_scaling: {kind} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench prepare_scaling", description=__doc__.split("\n\n")[0])
    # --child: one contender's run, in the fresh process `_run` starts
    corpus_options(ap, 3).add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child, a.tokenizer, a.input, a.max_bytes, a.out)))
        return 0
    from hybridpar.data.prepare import documents
    from hybridpar.data.tokenizer import train_bpe

    rows: dict[str, list[float]] = {k: [] for k in KINDS}
    tokens: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="hybridpar-bench-prepare-scaling-") as tmp:
        tok_dir = a.tokenizer or str(train_bpe(documents(a.input, 2_000_000), a.vocab_size, Path(tmp) / "tok"))
        load_before = os.getloadavg()
        for r in range(a.repeats):
            for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
                res = _run(kind, tok_dir, a.input, a.max_bytes, tmp)
                rows[kind].append(res["tokens"] / res["seconds"])
                tokens[kind] = int(res["tokens"])
                print(f"{kind}: {rows[kind][-1]:,.0f} tokens/s", file=sys.stderr, flush=True)
        load_after = os.getloadavg()
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "benchmark": "data prepare: 1 and 2 workers (one encoder thread each) against the tokenizers batch encoder",
        "corpus": a.input or "embedded (Python standard library source)",
        "max_bytes": a.max_bytes,
        "tokens": tokens,
        "repeats": a.repeats,
        "cpus": os.cpu_count(),
        "tokens_per_s": {k: [round(x) for x in v] for k, v in rows.items()},
        "median_tokens_per_s": {k: round(v) for k, v in med.items()},
        "two_workers_over_one": round(med["prepare-2-workers"] / med["prepare-1-worker"], 3),
        "two_workers_over_threaded_encoder": round(med["prepare-2-workers"] / med["encoder-threads"], 3),
        "threaded_encoder_over_one_thread": round(med["encoder-threads"] / med["encoder-1-thread"], 3),
        "prepare_one_thread_over_encoder_one_thread": round(med["prepare-1-worker"] / med["encoder-1-thread"], 3),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
    }
    emit(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
