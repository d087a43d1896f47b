"""The pre-flight's checks of the data (run/preflight.py calls them): the corpus, its token file and
description, the tokenizer and the model's vocabulary, each refused in one line naming the file and
what would be right, before any worker starts."""

from __future__ import annotations

from pathlib import Path

from hybridpar.config import Config


def check_tokens(cfg: Config) -> None:
    """data <-> tokenizer <-> model: a token file prepared with the tokenizer the run is given, a
    tokenizer whose ids the model can embed. Reads the sidecar and tokenizer.json, not the tokens."""
    from hybridpar.data.tokenfile import read_sidecar
    from hybridpar.data.tokenizer import Tokenizer

    d, vocab = cfg.data, cfg.model.vocab_size
    meta = read_sidecar(d.path) if d.path and d.path.endswith(".bin") and Path(d.path).is_file() else None
    if d.tokenizer is None:
        if meta is not None:
            raise ValueError(
                f"data.path={d.path!r} was prepared with the tokenizer {meta.get('tokenizer')!r}: give it as "
                f"data.tokenizer, so that the run's samples and final/ use it"
            )
        return
    tok = Tokenizer(d.tokenizer)  # ValueError naming tokenizer.json
    if tok.vocab_size > vocab:
        raise ValueError(
            f"data.tokenizer={d.tokenizer!r} has {tok.vocab_size} ids but model.vocab_size={vocab}: the model "
            f"cannot embed its ids; set model.vocab_size to {tok.vocab_size} (or more, e.g. for tp to divide it)"
        )
    if meta is None:
        raise ValueError(
            f"data.tokenizer={d.tokenizer!r} needs a token file prepared with it as data.path (now "
            f"{d.path!r}): hybridpar data prepare --tokenizer {d.tokenizer} --out DATA.bin"
        )
    if meta.get("tokenizer_sha256") != tok.sha256:
        raise ValueError(
            f"data.path={d.path!r} was prepared with another tokenizer ({meta.get('tokenizer')!r}, sha256 "
            f"{str(meta.get('tokenizer_sha256'))[:12]}…) than data.tokenizer={d.tokenizer!r} (sha256 "
            f"{tok.sha256[:12]}…): prepare it again with this tokenizer"
        )


def check_corpus(cfg: Config) -> list[str]:
    """The corpus opened as the workers will open it (too short for a window, ids the model cannot
    embed), without reading its tokens but to find the largest id of a file not prepared here; returns
    the line to print where data.max_tokens cuts it."""
    from hybridpar.data.corpus import TokenData
    from hybridpar.data.sources import corpus_note
    from hybridpar.data.tokenfile import check_index, read_sidecar

    d, t = cfg.data, cfg.train
    if d.path and d.path.endswith(".bin") and Path(d.path).is_file() and (meta := read_sidecar(d.path)) is not None:
        check_index(d.path, meta)
    data = TokenData.open(d.path, d.max_tokens, t.seq_len, t.seed, d.val_fraction)
    assert data.corpus is not None
    if data.vocab_needed > cfg.model.vocab_size:
        raise ValueError(
            f"{data.corpus.name} holds token ids up to {data.vocab_needed - 1}: model.vocab_size="
            f"{cfg.model.vocab_size} must be at least {data.vocab_needed}"
        )
    note = corpus_note(data.corpus, d.max_tokens)
    return [note] if note else []
