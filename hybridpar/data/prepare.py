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

import itertools
import pathlib
import sys
import time
from collections.abc import Iterator

import numpy as np

from hybridpar.data.sources import BINARY_SNIFF_BYTES, _walk_sorted, default_corpus_files
from hybridpar.data.tokenfile import TOKEN_DTYPES, TokenFileWriter, document_count
from hybridpar.data.tokenizer import Tokenizer, train_bpe

BATCH_DOCS = 512  # documents per call of the batch encoder: its threads stay busy, memory stays bounded


def documents(path: str | None, max_bytes: int | None = None) -> Iterator[str]:
    """The corpus at `path` (None: the default one) as texts, one per file, read as they are asked for;
    at most `max_bytes` bytes of UTF-8 in all where given. Binary and empty files are skipped, as in
    training's byte-level corpus (sources.py). ValueError at once if it holds no text at all."""
    if path is None:
        files = default_corpus_files()
    else:
        p = pathlib.Path(path)
        if not p.exists():
            raise ValueError(f"--input {path!r} does not exist")
        files = _walk_sorted(p, frozenset(), None) if p.is_dir() else [p]
    texts = _texts(files, max_bytes)
    first = next(texts, None)
    if first is None:
        raise ValueError(f"--input {path!r} holds no (non-empty) text file")
    return itertools.chain([first], texts)


def _texts(files: list[pathlib.Path], max_bytes: int | None) -> Iterator[str]:
    used = 0
    for f in files:
        if max_bytes is not None and used >= max_bytes:
            return
        with open(f, "rb") as fh:
            raw = fh.read() if max_bytes is None else fh.read(max_bytes - used)
        if not raw or b"\0" in raw[:BINARY_SNIFF_BYTES]:
            continue
        used += len(raw)
        yield raw.decode("utf-8", errors="replace")


def prepare(
    tokenizer: str,
    out: str,
    path: str | None = None,
    max_bytes: int | None = None,
    dtype: str = "auto",
    eos_token: str | None = None,
    eos_id: int | None = None,
) -> dict:
    """Encode the corpus at `path` with the tokenizer directory `tokenizer` into `out` (a .bin), its index
    and its description; returns the description."""
    if not out.endswith(".bin"):
        raise ValueError(f"--out {out!r} must end in .bin (its index and description go beside it)")
    tok = Tokenizer(tokenizer)
    fits16 = tok.vocab_size <= 1 << 16
    if dtype == "auto":
        dtype = "uint16" if fits16 else "uint32"
    if dtype not in TOKEN_DTYPES or (dtype == "uint16" and not fits16):
        raise ValueError(f"--dtype {dtype!r} must be auto or uint32, or uint16 for a vocabulary of at most 65536")
    eos, eos_text = tok.end_of_text(eos_token, eos_id)
    texts = documents(path, max_bytes)
    np_dtype = np.dtype(TOKEN_DTYPES[dtype])
    with TokenFileWriter(out, dtype) as writer:
        while batch := list(itertools.islice(texts, BATCH_DOCS)):
            writer.add([np.asarray([*ids, eos], dtype=np_dtype) for ids in tok.encode_batch(batch)])
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
       hybridpar data prepare --tokenizer DIR --out DATA.bin [--input PATH] [--max-bytes N] [--dtype D]
                              [--eos-token TEXT | --eos-id N]

train-tokenizer  trains a byte-level BPE tokenizer of N ids (3 special tokens, the 256 bytes, merges)
                 on a corpus and writes tokenizer.json and tokenizer_config.json (with a chat template)
prepare          encodes a corpus with a tokenizer into DATA.bin (uint16 ids when the vocabulary fits,
                 else uint32; --dtype uint32 forces it), DATA.idx (document boundaries) and DATA.json
                 (dtype, counts, vocabulary, tokenizer hash); train on it with --data.path DATA.bin
                 --data.tokenizer DIR
--input          a text file or a folder of them (default: the Python standard library's source files)
--max-bytes      read only the first N bytes of the corpus (default: all of it)
--eos-token      the token closing each document (default: the tokenizer's eos_token); --eos-id by id"""


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
    for p in (tok, prep):
        p.add_argument("--out", required=True)
        p.add_argument("--input")
        p.add_argument("--max-bytes", "--max_bytes", dest="max_bytes", type=positive_int)
    a = vars(ap.parse(argv))
    return a.pop("cmd"), {k: None if v is None else str(v) for k, v in a.items()}


def _int(v: str | None) -> int | None:
    return None if v is None else int(v)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or any(a in ("-h", "--help") for a in argv):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        cmd, o = parse_data_args(argv)
        t0 = time.perf_counter()
        if cmd == "train-tokenizer":
            out = train_bpe(documents(o["input"], _int(o["max_bytes"])), int(o["vocab_size"]), o["out"])
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
            )
            s = time.perf_counter() - t0
            print(
                f"hybridpar: wrote {meta['tokens']:,} {meta['dtype']} tokens of {document_count(meta):,} documents, "
                f"each closed by {meta['eos_token']!r} (id {meta['eos_id']}), to {o['out']} "
                f"({meta['tokens'] / s:,.0f} tokens/s); train with --data.path {o['out']} "
                f"--data.tokenizer {o['tokenizer']} --model.vocab_size {meta['vocab_size']} (or more)"
            )
    except ValueError as e:
        print(f"hybridpar: error: {e}", file=sys.stderr)
        return 2
    return 0
