"""The pre-flight's checks of the data (run/preflight.py calls them): the corpus, its token file and
description, the tokenizer and the model's vocabulary, each refused in one line naming the file and
what would be right, before any worker starts."""

from __future__ import annotations

import math
from collections.abc import Sized
from pathlib import Path

from hybridpar.config import Config


def use_init_tokenizer(cfg: Config) -> None:
    """model.init_from brings its tokenizer: data.tokenizer, left unset, becomes that directory where it
    has a tokenizer.json (so fine-tuning reads, samples and exports text as the model was trained to)."""
    from hybridpar.data.tokenizer import TOKENIZER_FILE

    init = cfg.model.init_from
    if init is not None and cfg.data.tokenizer is None and (Path(init) / TOKENIZER_FILE).is_file():
        cfg.data.tokenizer = init


def _token_file(path: str | None) -> dict | None:
    from hybridpar.data.tokenfile import read_sidecar

    return read_sidecar(path) if path and path.endswith(".bin") and Path(path).is_file() else None


def _byte_level(path: str | None) -> bool:
    """Text read as bytes: the default corpus, a folder, any file but a `.bin` token file."""
    return path is None or Path(path).is_dir() or not path.endswith(".bin")


def check_tokens(cfg: Config) -> None:
    """data <-> tokenizer <-> model: a token file prepared with the tokenizer the run is given (data.tokenizer,
    or model.init_from's own), a tokenizer whose ids the model can embed, no bytes for a model of another
    vocabulary; each source of a mixture alike, so all of them share the tokenizer (by its hash). Reads the
    sidecars and tokenizer.json, not the tokens."""
    from hybridpar.data.mixture import corpus_paths

    for path in corpus_paths(cfg.data.path):  # a bad mixture: ValueError naming data.path and the item
        _check_source_tokens(cfg, path)


def _check_source_tokens(cfg: Config, path: str | None) -> None:
    from hybridpar.data.sources import check_path
    from hybridpar.data.tokenizer import TOKENIZER_FILE, Tokenizer

    d, vocab, init = cfg.data, cfg.model.vocab_size, cfg.model.init_from
    meta = _token_file(path)
    if meta is None and path is not None and (d.document_mask or d.tokenizer is not None):
        check_path(path)  # missing, or a prepared file's .idx/.json: said so, not "without its description"
    if d.document_mask and meta is None:
        what = "byte-level text" if _byte_level(path) else "a token file without a description or index"
        raise ValueError(
            f"data.document_mask needs the document index of a prepared token file, and data.path={path!r} is "
            f"{what}: prepare it (hybridpar data prepare --out DATA.bin), or leave data.document_mask off"
        )
    if d.tokenizer is None:
        if meta is not None:
            raise ValueError(
                f"data.path={path!r} was prepared with the tokenizer {meta.get('tokenizer')!r}: give it as "
                f"data.tokenizer, so that the run's samples and final/ use it"
            )
        if init is not None and vocab != 256 and _byte_level(path):
            raise ValueError(
                f"model.init_from={init!r} has a vocabulary of {vocab} ids and no {TOKENIZER_FILE}, but data.path="
                f"{path!r} is byte-level text (ids 0-255): give the model's tokenizer as data.tokenizer and a "
                f"token file prepared with it (hybridpar data prepare --tokenizer DIR --out DATA.bin) as data.path"
            )
        return
    tok = Tokenizer(d.tokenizer)  # ValueError naming tokenizer.json
    who = f"model.init_from={init!r} (its tokenizer)" if d.tokenizer == init else f"data.tokenizer={d.tokenizer!r}"
    if tok.vocab_size > vocab:
        # model.init_from's config.json fixes the vocabulary (a --model.vocab_size contradicting it is refused)
        fix = (
            f"model.init_from={init!r} fixes model.vocab_size: use its own tokenizer (leave data.tokenizer unset) "
            f"or one of at most {vocab} ids"
            if init is not None
            else f"set model.vocab_size to {tok.vocab_size} (or more, e.g. for tp to divide it)"
        )
        raise ValueError(
            f"{who} has {tok.vocab_size} ids but model.vocab_size={vocab}: the model cannot embed its ids; {fix}"
        )
    if meta is None:
        what = "byte-level text (ids 0-255)" if _byte_level(path) else "a token file without its description"
        raise ValueError(
            f"{who} needs a token file prepared with it as data.path, and data.path={path!r} is {what}: "
            f"hybridpar data prepare --tokenizer {d.tokenizer} --out DATA.bin, then --data.path DATA.bin"
        )
    if meta.get("tokenizer_sha256") != tok.sha256:
        raise ValueError(
            f"data.path={path!r} was prepared with another tokenizer ({meta.get('tokenizer')!r}, sha256 "
            f"{str(meta.get('tokenizer_sha256'))[:12]}…) than {who} (sha256 {tok.sha256[:12]}…): prepare it "
            f"again with hybridpar data prepare --tokenizer {d.tokenizer} --out DATA.bin"
        )


def check_corpus(cfg: Config) -> list[str]:
    """The corpus opened as the workers will open it (too short for a window, ids the model cannot
    embed), without reading its tokens but to find the largest id of a file not prepared here; returns
    the line to print where data.max_tokens cuts it."""
    from hybridpar.data.inputs import JSONL_SUFFIXES
    from hybridpar.data.mixture import corpus_paths, open_data
    from hybridpar.data.sources import corpus_note
    from hybridpar.data.tokenfile import check_index

    d, t = cfg.data, cfg.train
    notes = []
    for path in corpus_paths(d.path):
        if (meta := _token_file(path)) is not None:
            check_index(path, meta)
        elif path is not None and path.endswith(JSONL_SUFFIXES):  # bytes, JSON syntax and all: rarely meant
            notes.append(
                f"data: data.path={path!r} is read as bytes, its JSON syntax included; to train on the documents' "
                f"text, hybridpar data prepare --input {path} --out DATA.bin (then --data.path DATA.bin)"
            )
    data = open_data(d.path, d.max_tokens, t.seq_len, t.seed, d.val_fraction)
    for source in getattr(data, "sources", [data]):
        assert source.corpus is not None
        if source.vocab_needed > cfg.model.vocab_size:
            raise ValueError(
                f"{source.corpus.name} holds token ids up to {source.vocab_needed - 1}: model.vocab_size="
                f"{cfg.model.vocab_size} must be at least {source.vocab_needed}"
            )
        if note := corpus_note(source.corpus, d.max_tokens):
            notes.append(note)
    if t.val_every:
        _check_val_windows(cfg, data.n_val_windows, getattr(data, "tokens", None))
        if hasattr(data, "val_sources"):  # a mixture: every source's tail holds the validation set
            data.val_sources(t.val_batches * t.global_batch)
    return notes


def _check_val_windows(cfg: Config, have: int, tokens: Sized | None) -> None:
    """Validation reads train.val_batches × train.global_batch windows of the held-out tail, which a small
    corpus may not hold: refused here, with settings that fit, rather than by every worker after the
    launch. `tokens`: one corpus's tokens (its length gives the data.val_fraction that would fit)."""
    t, d = cfg.train, cfg.data
    need = t.val_batches * t.global_batch
    if need <= have:
        return
    fixes = [f"--train.val_batches {have // t.global_batch}"] if have >= t.global_batch else []
    if tokens is not None:
        n, tail = len(tokens), need * t.seq_len + 1  # the tail is int(n × val_fraction) tokens
        frac = math.ceil(tail / n * 1000) / 1000
        frac += 0.001 if int(n * frac) < tail else 0.0  # float rounding
        if frac <= 0.5:  # beyond, validation would take more of the corpus than training
            fixes.append(f"--data.val_fraction {frac:g}")
    fixes += ["--train.val_every 0 (no validation)", "a larger corpus"]
    corpus = "the embedded corpus" if d.path is None else f"data.path={d.path!r}"
    raise ValueError(
        f"validation reads train.val_batches × train.global_batch = {t.val_batches} × {t.global_batch} = {need} "
        f"windows of train.seq_len={t.seq_len} tokens, and the held-out tail of {corpus} (data.val_fraction="
        f"{d.val_fraction}) holds {have}: use {', '.join(fixes[:-1])} or {fixes[-1]}"
    )
