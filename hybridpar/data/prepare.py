"""`hybridpar data`: train a byte-level BPE tokenizer on a corpus (`train-tokenizer`), and turn a corpus
into a token file for training with a tokenizer (`prepare`).

A prepared dataset is `NAME.bin` (little-endian uint16 ids when the vocabulary fits, else uint32),
`NAME.idx` (the document boundaries, little-endian uint64) and `NAME.json` describing them (tokenfile.py).
Each document is closed by the tokenizer's end-of-text token (its `eos_token`, or the one given). The
trainer reads the dtype from the description and checks it against the tokenizer and the model before
any worker starts (run/data_checks.py).

A corpus is read as documents: each file of a folder (or of the default corpus, the Python standard
library's source) is one; a single text file is one. Documents stream through the encoder in batches
and out to the files, so memory stays bounded whatever the corpus's size; nothing is capped unless
--max-bytes asks. The files appear only once complete (tokenfile.TokenFileWriter).
"""

from __future__ import annotations

import collections
import functools
import itertools
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from hybridpar.data.inputs import documents
from hybridpar.data.tokenfile import TOKEN_DTYPES, TokenFileWriter, document_count
from hybridpar.data.tokenizer import Tokenizer, train_bpe
from hybridpar.topology.spawn import environ

# A batch for the encoder: enough documents to keep its threads busy, few enough characters that its
# output (ids, offsets and token strings of every token, ~100 bytes a token) stays small.
BATCH_DOCS, BATCH_CHARS = 512, 1 << 20


def _encode(tokenizer: str, eos: int, dtype: str, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A batch of documents as (their ids one after another, each closed by `eos`; each one's length)."""
    encoded = _tokenizer(tokenizer).encode_batch(texts)
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    ids = np.fromiter(
        itertools.chain.from_iterable([*ids, eos] for ids in encoded),
        dtype=np.dtype(TOKEN_DTYPES[dtype]),
        count=int(lengths.sum()),
    )
    return ids, lengths


def _batches(texts: Iterator[str], docs: int, chars: int) -> Iterator[list[str]]:
    """Consecutive documents in batches of at most `docs` documents and, past the first, `chars` characters."""
    batch, size = [], 0
    for t in texts:
        if batch and (len(batch) == docs or size + len(t) > chars):
            yield batch
            batch, size = [], 0
        batch.append(t)
        size += len(t)
    if batch:
        yield batch


@functools.lru_cache(maxsize=1)
def _tokenizer(path: str) -> Tokenizer:
    return Tokenizer(path)  # once per process: the workers of --workers load it on their first batch


def _encoded(
    tokenizer: str, eos: int, dtype: str, texts: Iterator[str], workers: int, batch_docs: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The corpus's batches encoded, in order: here, or by `workers` processes, each batch a task, at most
    two per worker in flight (the reader waits for the writer, so memory stays bounded)."""
    batches = _batches(texts, batch_docs, BATCH_CHARS)
    if workers == 1:
        yield from (_encode(tokenizer, eos, dtype, b) for b in batches)
        return
    # spawn: fresh interpreters, never a fork of a process whose tokenizer threads already ran. Each
    # worker's tokenizer gets its share of the cores, not all of them (RAYON_NUM_THREADS, read at start).
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    with environ(RAYON_NUM_THREADS=threads), mp.get_context("spawn").Pool(workers) as pool:
        pending: collections.deque = collections.deque()
        for b in batches:
            pending.append(pool.apply_async(_encode, (tokenizer, eos, dtype, b)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def prepare(
    tokenizer: str,
    out: str,
    path: str | None = None,
    max_bytes: int | None = None,
    dtype: str = "auto",
    eos_token: str | None = None,
    eos_id: int | None = None,
    *,
    text_key: str = "text",
    workers: int = 1,
    batch_docs: int = BATCH_DOCS,
    progress: Callable[[str], None] | None = None,
    progress_every_s: float = 10.0,
) -> dict:
    """Encode the corpus at `path` with the tokenizer directory `tokenizer` into `out` (a .bin), its index
    and its description; returns the description. `progress` gets a line (tokens, documents, tokens/s)
    every `progress_every_s` seconds."""
    if not out.endswith(".bin"):
        raise ValueError(f"--out {out!r} must end in .bin (its index and description go beside it)")
    tok = Tokenizer(tokenizer)
    fits16 = tok.vocab_size <= 1 << 16
    if dtype == "auto":
        dtype = "uint16" if fits16 else "uint32"
    if dtype not in TOKEN_DTYPES or (dtype == "uint16" and not fits16):
        raise ValueError(f"--dtype {dtype!r} must be auto or uint32, or uint16 for a vocabulary of at most 65536")
    eos, eos_text = tok.end_of_text(eos_token, eos_id)
    texts = documents(path, max_bytes, text_key)
    t0 = last = time.perf_counter()
    with TokenFileWriter(out, dtype) as writer:
        for ids, lengths in _encoded(str(tok.path), eos, dtype, texts, workers, batch_docs):
            writer.add(ids, lengths)
            if progress is not None and (now := time.perf_counter()) - last >= progress_every_s:
                last = now
                progress(
                    f"hybridpar: {writer.tokens:,} tokens of {writer.documents:,} documents so far "
                    f"({writer.tokens / (now - t0):,.0f} tokens/s)"
                )
        meta = {
            "dtype": dtype,
            "vocab_size": tok.vocab_size,
            "tokenizer_sha256": tok.sha256,
            "tokenizer": str(tok.path),
            "eos_id": eos,
            "eos_token": eos_text,
            "source": path,
        }
        return writer.commit(meta)


USAGE = """usage: hybridpar data train-tokenizer --vocab-size N --out DIR [--input PATH] [--max-bytes N]
                                      [--text-key KEY]
       hybridpar data prepare --tokenizer DIR --out DATA.bin [--input PATH] [--max-bytes N] [--dtype D]
                              [--eos-token TEXT | --eos-id N] [--text-key KEY] [--workers N]

train-tokenizer  trains a byte-level BPE tokenizer of N ids (3 special tokens, the 256 bytes, merges)
                 on a corpus and writes tokenizer.json and tokenizer_config.json (with a chat template)
prepare          encodes a corpus with a tokenizer into DATA.bin (uint16 ids when the vocabulary fits,
                 else uint32; --dtype uint32 forces it), DATA.idx (document boundaries) and DATA.json
                 (dtype, counts, vocabulary, tokenizer hash); train on it with --data.path DATA.bin
                 --data.tokenizer DIR
--input          a text file (one document), a JSON Lines file (*.jsonl, *.ndjson: a document per line),
                 either gzipped (*.gz), a Parquet file (*.parquet: a document per row; needs pyarrow), or a
                 folder of them (default: the Python standard library's source)
--text-key       the key of a JSON line, or the Parquet column, that holds its text (default: text)
--max-bytes      read only the first N bytes of the corpus's text (default: all of it)
--eos-token      the token closing each document (default: the tokenizer's eos_token); --eos-id by id
--workers        processes encoding batches of documents, written in order (default 1)"""


def parse_data_args(argv: list[str]) -> tuple[str, dict[str, str | None]]:
    """`train-tokenizer|prepare --key VALUE ...` -> (command, options), or ValueError; reads no file."""
    from hybridpar.config.args import ArgParser, nonnegative_int, positive_int

    ap = ArgParser(prog="hybridpar data", add_help=False)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="train-tokenizer|prepare")
    tok = sub.add_parser("train-tokenizer", add_help=False)
    tok.add_argument("--vocab-size", "--vocab_size", dest="vocab_size", type=positive_int, required=True)
    prep = sub.add_parser("prepare", add_help=False)
    prep.add_argument("--tokenizer", required=True)
    prep.add_argument("--dtype", default="auto")
    prep.add_argument("--eos-token", "--eos_token", dest="eos_token")
    prep.add_argument("--eos-id", "--eos_id", dest="eos_id", type=nonnegative_int)
    prep.add_argument("--workers", type=positive_int, default=1)
    for p in (tok, prep):
        p.add_argument("--text-key", "--text_key", dest="text_key", default="text")
        p.add_argument("--out", required=True)
        p.add_argument("--input")
        p.add_argument("--max-bytes", "--max_bytes", dest="max_bytes", type=positive_int)
    a = vars(ap.parse(argv))
    return a.pop("cmd"), {k: None if v is None else str(v) for k, v in a.items()}


def _int(v: str | None) -> int | None:
    return None if v is None else int(v)


def train_hint(out: str, tokenizer: str, vocab_size: int) -> str:
    """How to train on a prepared file: a model directory's tokenizer (config.json beside it) means
    fine-tuning that model, whose config.json gives the vocabulary (a --model.vocab_size is refused
    there); a tokenizer of its own needs a model with room for its ids."""
    if (Path(tokenizer) / "config.json").is_file():
        return f"fine-tune with --data.path {out} --model.init_from {tokenizer} (its config.json gives the shape)"
    return f"train with --data.path {out} --data.tokenizer {tokenizer} --model.vocab_size {vocab_size} (or more)"


class Stopped(Exception):
    """SIGTERM (a scheduler's preemption, `kill`) while `hybridpar data` works: raised in the main thread,
    so that the writer's `with` removes its temporary files as it does for ^C; SIGTERM's default, dying at
    once, left `NAME.bin.tmp` and `NAME.idx.tmp` (the corpus's size on disk) behind."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped


def main(argv: list[str]) -> int:
    if threading.current_thread() is not threading.main_thread():  # signal handlers are the main thread's
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return _main(argv)
    except (KeyboardInterrupt, Stopped) as e:
        what, code = ("SIGTERM", 143) if isinstance(e, Stopped) else ("an interrupt", 130)
        print(f"hybridpar: data {argv[0]} stopped by {what}: nothing written", file=sys.stderr)
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or any(a in ("-h", "--help") for a in argv):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        cmd, o = parse_data_args(argv)
        t0 = time.perf_counter()
        if cmd == "train-tokenizer":
            texts = documents(o["input"], _int(o["max_bytes"]), o["text_key"])
            out = train_bpe(texts, int(o["vocab_size"]), o["out"])
            print(f"hybridpar: wrote a tokenizer of {Tokenizer(out).vocab_size} ids to {out}")
        else:
            meta = prepare(
                o["tokenizer"],
                o["out"],
                o["input"],
                _int(o["max_bytes"]),
                o["dtype"],
                o["eos_token"],
                _int(o["eos_id"]),
                text_key=o["text_key"],
                workers=int(o["workers"]),
                progress=print,
            )
            s = time.perf_counter() - t0
            print(
                f"hybridpar: wrote {meta['tokens']:,} {meta['dtype']} tokens of {document_count(meta):,} documents, "
                f"each closed by {meta['eos_token']!r} (id {meta['eos_id']}), to {o['out']} "
                f"({meta['tokens'] / s:,.0f} tokens/s); {train_hint(o['out'], o['tokenizer'], meta['vocab_size'])}"
            )
    except ValueError as e:
        print(f"hybridpar: error: {e}", file=sys.stderr)
        return 2
    return 0
