"""Tokenizers: a Hugging Face tokenizer directory (`tokenizer.json`, read with the `tokenizers` library,
and `tokenizer_config.json` for the special tokens and the chat template), the byte-level BPE that
`hybridpar data train-tokenizer` trains, and decoding a stream of ids into text as it grows.

hybridpar's default stays byte-level (ids 0-255 are UTF-8 bytes, data.py): `Tokenizer` is for models with a
real vocabulary. A tokenizer is named in a prepared dataset's sidecar by the sha256 of its
`tokenizer.json`, so a dataset can be checked against the tokenizer a run is given.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

TOKENIZER_FILE, CONFIG_FILE, SPECIAL_TOKENS_FILE = "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# The chat template written with a trained tokenizer (ChatML, as transformers' chat templates are written:
# Jinja over `messages` and `add_generation_prompt`).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tokenizer_hash(path: str | Path) -> str:
    """sha256 of the directory's tokenizer.json: what a prepared dataset records of its tokenizer."""
    return hashlib.sha256((Path(path) / TOKENIZER_FILE).read_bytes()).hexdigest()


class Tokenizer:
    """A tokenizer directory loaded for encoding and decoding. ValueError naming the file if unreadable."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.path = Path(path)
        file = self.path / TOKENIZER_FILE
        try:
            self.tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # missing file, bad JSON, unknown model: the library's own exception types
            raise ValueError(f"{file} cannot be read as a tokenizer: {e}") from None
        self.config: dict[str, Any] = {}
        if (self.path / CONFIG_FILE).is_file():
            try:
                self.config = json.loads((self.path / CONFIG_FILE).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as e:
                raise ValueError(f"{self.path / CONFIG_FILE} cannot be read: {e}") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.sha256 = tokenizer_hash(self.path)

    def encode(self, text: str) -> list[int]:
        # No special tokens added: a prompt (or a rendered chat) is taken as it is, as the chat template
        # already holds whatever markers the model was trained with.
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    def special(self, key: str) -> str | None:
        """A special token named in tokenizer_config.json (eos_token, bos_token), as its text."""
        v = self.config.get(key)
        return v.get("content") if isinstance(v, dict) else v if isinstance(v, str) else None

    def end_of_text(self, eos_token: str | None = None, eos_id: int | None = None) -> tuple[int, str]:
        """The id (and text) that closes each document of a prepared corpus: the one given (`eos_token` or
        `eos_id`), else the tokenizer's own `eos_token` (tokenizer_config.json, else special_tokens_map.json).
        ValueError naming the directory where there is none, or the given one is not in the vocabulary."""
        if eos_token is not None and eos_id is not None:
            raise ValueError("give --eos-token or --eos-id, not both")
        if eos_id is not None:
            if not 0 <= eos_id < self.vocab_size:
                raise ValueError(
                    f"--eos-id {eos_id} is not an id of {self.path / TOKENIZER_FILE} (0..{self.vocab_size - 1})"
                )
            return eos_id, self.tok.id_to_token(eos_id)
        token, where = eos_token, "--eos-token"
        if token is None:
            token, where = self.special("eos_token"), f"the eos_token of {self.path / CONFIG_FILE}"
        if token is None and (self.path / SPECIAL_TOKENS_FILE).is_file():
            try:
                v = json.loads((self.path / SPECIAL_TOKENS_FILE).read_text(encoding="utf-8")).get("eos_token")
            except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
                raise ValueError(f"{self.path / SPECIAL_TOKENS_FILE} cannot be read: {e}") from None
            token = v.get("content") if isinstance(v, dict) else v if isinstance(v, str) else None
            where = f"the eos_token of {self.path / SPECIAL_TOKENS_FILE}"
        if token is None:
            raise ValueError(
                f"the tokenizer {self.path} names no end-of-text token (no eos_token in {CONFIG_FILE} or "
                f"{SPECIAL_TOKENS_FILE}), so nothing would separate documents: give --eos-token TEXT or --eos-id N"
            )
        if (found := self.tok.token_to_id(token)) is None:
            raise ValueError(f"{where} {token!r} is not a token of {self.path / TOKENIZER_FILE}")
        return found, token

    @property
    def chat_template(self) -> str | None:
        """tokenizer_config.json's chat_template, else chat_template.jinja (where transformers 5 saves it)."""
        t = self.config.get("chat_template")
        if isinstance(t, str):
            return t
        file = self.path / "chat_template.jinja"
        return file.read_text(encoding="utf-8") if file.is_file() else None


class StreamDecoder:
    """Text of a growing id sequence, piece by piece, through the `tokenizers` streaming decoder
    (`decoders.DecodeStream`): each new id costs a decode of a few ids, not of all so far (decoding the
    whole sequence again per token is quadratic in its length). A character split over several tokens
    (a byte-level BPE's partial UTF-8) comes out once complete, so the pieces join to the full decoding."""

    def __init__(self, tok: Tokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        self.tok, self._stream = tok, DecodeStream(skip_special_tokens=False)

    def feed(self, token: int) -> str:
        return self._stream.step(self.tok.tok, token) or ""  # None: an incomplete character, held back

    def flush(self) -> str:
        return ""  # what DecodeStream holds is an incomplete character: no text (decode would give U+FFFD)


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | Path) -> Path:
    """Train a byte-level BPE tokenizer (GPT-2's pre-tokenizer and byte alphabet, so any text encodes)
    of `vocab_size` ids on `texts`, and write it with a ChatML chat template as a tokenizer directory
    that `tokenizers` and transformers' AutoTokenizer load."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = [END_OF_TEXT, IM_START, IM_END]
    if vocab_size < 256 + len(specials):
        raise ValueError(f"--vocab-size {vocab_size} must be at least {256 + len(specials)} (256 bytes + specials)")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / TOKENIZER_FILE))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": END_OF_TEXT,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    return out
