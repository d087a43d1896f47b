"""`hybridpar data`: train a byte-level BPE tokenizer on a corpus (`train-tokenizer`), and turn a corpus
into a token file for training with a tokenizer (`prepare`).

A prepared dataset is `NAME.bin` (little-endian uint16 ids when the vocabulary fits, else uint32) and
`NAME.json` beside it: format, dtype, token count, vocabulary size, the tokenizer's sha256 and path, the
document boundaries (the first token of each document; an end-of-text token closes each one when the
tokenizer has one) and the source. The trainer reads the dtype from it and checks it against the
tokenizer and the model before any worker starts (preflight.py).

A corpus is read as documents: each file of a folder (or of the default corpus, the Python standard
library's source) is one; a single text file is one.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import numpy as np

from hybridpar.data.sources import BINARY_SNIFF_BYTES, _walk_sorted, default_corpus_files
from hybridpar.data.tokenfile import FORMAT as SIDECAR_FORMAT
from hybridpar.data.tokenfile import TOKEN_DTYPES, sidecar_path
from hybridpar.data.tokenizer import END_OF_TEXT, Tokenizer, train_bpe

BATCH_DOCS = 512  # documents per call of the batch encoder: its threads stay busy, memory stays bounded


def documents(path: str | None, max_bytes: int) -> list[str]:
    """The corpus at `path` (None: the default one) as texts, one per file, at most `max_bytes` bytes of
    UTF-8 in all; binary and empty files are skipped, as in training's byte-level corpus (data.py)."""
    if path is None:
        files = default_corpus_files()
    else:
        p = pathlib.Path(path)
        if not p.exists():
            raise ValueError(f"--input {path!r} does not exist")
        files = _walk_sorted(p, frozenset(), None) if p.is_dir() else [p]
    docs: list[str] = []
    used = 0
    for f in files:
        if used >= max_bytes:
            break
        raw = f.read_bytes()[: max_bytes - used]
        if not raw or b"\0" in raw[:BINARY_SNIFF_BYTES]:
            continue
        docs.append(raw.decode("utf-8", errors="replace"))
        used += len(raw)
    if not docs:
        raise ValueError(f"--input {path!r} holds no (non-empty) text file")
    return docs


def prepare(
    tokenizer: str, out: str, path: str | None = None, max_bytes: int = 16_000_000, dtype: str = "auto"
) -> dict:
    """Encode the corpus at `path` with the tokenizer directory `tokenizer` into `out` (a .bin) and its
    sidecar; returns the sidecar's content."""
    if not out.endswith(".bin"):
        raise ValueError(f"--out {out!r} must end in .bin (its description goes beside it, as .json)")
    tok = Tokenizer(tokenizer)
    fits16 = tok.vocab_size <= 1 << 16
    if dtype == "auto":
        dtype = "uint16" if fits16 else "uint32"
    if dtype not in TOKEN_DTYPES or (dtype == "uint16" and not fits16):
        raise ValueError(f"--dtype {dtype!r} must be auto or uint32, or uint16 for a vocabulary of at most 65536")
    docs = documents(path, max_bytes)
    eos = tok.token_id(END_OF_TEXT)
    np_dtype = np.dtype(TOKEN_DTYPES[dtype])
    starts, parts, n = [], [], 0
    for i in range(0, len(docs), BATCH_DOCS):
        for ids in tok.encode_batch(docs[i : i + BATCH_DOCS]):
            starts.append(n)
            parts.append(np.asarray(ids + ([eos] if eos is not None else []), dtype=np_dtype))
            n += len(parts[-1])
    target = pathlib.Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    np.concatenate(parts).tofile(target)
    meta = {
        "format": SIDECAR_FORMAT,
        "dtype": dtype,
        "tokens": n,
        "vocab_size": tok.vocab_size,
        "tokenizer_sha256": tok.sha256,
        "tokenizer": str(tok.path),
        "eos_id": eos,
        "source": path,
        "documents": starts,
    }
    sidecar_path(target).write_text(json.dumps(meta) + "\n", encoding="utf-8")
    return meta


USAGE = """usage: hybridpar data train-tokenizer --vocab-size N --out DIR [--input PATH] [--max-bytes N]
       hybridpar data prepare --tokenizer DIR --out DATA.bin [--input PATH] [--max-bytes N] [--dtype D]

train-tokenizer  trains a byte-level BPE tokenizer of N ids (3 special tokens, the 256 bytes, merges)
                 on a corpus and writes tokenizer.json and tokenizer_config.json (with a chat template)
prepare          encodes a corpus with a tokenizer into DATA.bin (uint16 ids when the vocabulary fits,
                 else uint32; --dtype uint32 forces it) and DATA.json (dtype, vocabulary, tokenizer
                 hash, document boundaries); train on it with --data.path DATA.bin --data.tokenizer DIR
--input          a text file or a folder of them (default: the Python standard library's source files)
--max-bytes      corpus bytes read (default 16000000)"""


def parse_data_args(argv: list[str]) -> tuple[str, dict[str, str | None]]:
    """`train-tokenizer|prepare --key VALUE ...` -> (command, options), or ValueError; reads no file."""
    from hybridpar.config.args import ArgParser, positive_int

    ap = ArgParser(prog="hybridpar data", add_help=False)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="train-tokenizer|prepare")
    tok = sub.add_parser("train-tokenizer", add_help=False)
    tok.add_argument("--vocab-size", "--vocab_size", dest="vocab_size", type=positive_int, required=True)
    prep = sub.add_parser("prepare", add_help=False)
    prep.add_argument("--tokenizer", required=True)
    prep.add_argument("--dtype", default="auto")
    for p in (tok, prep):
        p.add_argument("--out", required=True)
        p.add_argument("--input")
        p.add_argument("--max-bytes", "--max_bytes", dest="max_bytes", type=positive_int, default=16_000_000)
    a = vars(ap.parse(argv))
    return a.pop("cmd"), {k: None if v is None else str(v) for k, v in a.items()}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or any(a in ("-h", "--help") for a in argv):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        cmd, opts = parse_data_args(argv)
        t0 = time.perf_counter()
        if cmd == "train-tokenizer":
            out = train_bpe(documents(opts["input"], int(opts["max_bytes"])), int(opts["vocab_size"]), opts["out"])
            print(f"hybridpar: wrote a tokenizer of {Tokenizer(out).vocab_size} ids to {out}")
        else:
            meta = prepare(opts["tokenizer"], opts["out"], opts["input"], int(opts["max_bytes"]), opts["dtype"])
            s = time.perf_counter() - t0
            print(
                f"hybridpar: wrote {meta['tokens']:,} {meta['dtype']} tokens of {len(meta['documents'])} documents "
                f"to {opts['out']} ({meta['tokens'] / s:,.0f} tokens/s); train with --data.path {opts['out']} "
                f"--data.tokenizer {opts['tokenizer']} --model.vocab_size {meta['vocab_size']} (or more)"
            )
    except ValueError as e:
        print(f"hybridpar: error: {e}", file=sys.stderr)
        return 2
    return 0
