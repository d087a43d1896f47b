"""`hybridpar bench prepare`: `hybridpar data prepare` (read the corpus, encode, write the token file and
its description) against the `tokenizers` batch encoder alone on the same texts, already in memory.

Both encode with the same tokenizer through the same batch call; what prepare adds is reading the
files, joining the ids and writing them. The two run alternately, `--repeats` times each, so drift in
the machine's load hits both alike; the medians and their ratio (prepare / encoder, in tokens/s) are
reported with the load average before and after. JSON on stdout, and to --out if given.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from hybridpar.bench import emit
from hybridpar.data.prepare import BATCH_DOCS, documents, prepare
from hybridpar.data.tokenizer import Tokenizer, train_bpe


def corpus_options(ap: argparse.ArgumentParser, repeats: int) -> argparse.ArgumentParser:
    """The options the prepare benchmarks share: tokenizer, corpus, size, repeats, output."""
    ap.add_argument("--tokenizer", help="tokenizer directory (default: a byte-level BPE trained here)")
    ap.add_argument("--vocab-size", type=int, default=1000, help="of the tokenizer trained here")
    ap.add_argument("--input", default=None, help="corpus (default: the embedded one, the stdlib's source)")
    ap.add_argument("--max-bytes", type=int, default=16_000_000)
    ap.add_argument("--repeats", type=int, default=repeats, help="runs of each contender, alternating")
    ap.add_argument("--out", help="also write the JSON here")
    return ap


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hybridpar bench prepare", description=__doc__.split("\n\n")[0])
    a = corpus_options(ap, 5).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hybridpar-bench-prepare-") as tmp:
        tok_dir = a.tokenizer or str(train_bpe(documents(a.input, 2_000_000), a.vocab_size, Path(tmp) / "tok"))
        tok = Tokenizer(tok_dir)
        texts = list(documents(a.input, a.max_bytes))
        load_before = os.getloadavg()
        rows: dict[str, list[float]] = {"prepare": [], "encoder": []}
        tokens = {}
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            meta = prepare(tok_dir, str(Path(tmp) / "data.bin"), a.input, a.max_bytes)
            # The text's tokens, as the encoder counts them (less the end-of-text token closing each document).
            tokens["prepare"] = meta["tokens"] - meta["documents"]
            rows["prepare"].append(tokens["prepare"] / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            n = sum(
                len(ids)
                for i in range(0, len(texts), BATCH_DOCS)
                for ids in tok.encode_batch(texts[i : i + BATCH_DOCS])
            )
            rows["encoder"].append(n / (time.perf_counter() - t0))
            tokens["encoder"] = n
        load_after = os.getloadavg()
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "benchmark": "data prepare vs the tokenizers batch encoder alone",
        "corpus": a.input or "embedded (Python standard library source)",
        "corpus_bytes": sum(len(t.encode("utf-8")) for t in texts),
        "documents": len(texts),
        "vocab_size": tok.vocab_size,
        "tokens": tokens,
        "repeats": a.repeats,
        "tokens_per_s": {k: [round(x) for x in v] for k, v in rows.items()},
        "median_tokens_per_s": {k: round(v) for k, v in med.items()},
        "ratio_prepare_over_encoder": round(med["prepare"] / med["encoder"], 3),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "cpus": os.cpu_count(),
    }
    emit(result, a.out)
    return 0
