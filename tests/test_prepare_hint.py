"""`hybridpar data prepare` ends with the training command to run next. With a model directory's tokenizer
(the README's fine-tuning path) that is `--model.init_from DIR`: the `--model.vocab_size` it printed
before is refused beside init_from, and the tokenizer's own count (500) is not the model's padded
vocabulary (504). A tokenizer of its own still gets the vocabulary size to give the model."""

from __future__ import annotations

from pathlib import Path

from hybridpar.data.prepare import train_hint


def test_a_model_directory_is_fine_tuned(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    hint = train_hint("data/x.bin", str(tmp_path), 500)
    assert f"--data.path data/x.bin --model.init_from {tmp_path}" in hint and "vocab_size" not in hint


def test_a_tokenizer_of_its_own_names_the_vocabulary(tmp_path: Path) -> None:
    hint = train_hint("data/x.bin", str(tmp_path), 500)
    assert f"--data.tokenizer {tmp_path} --model.vocab_size 500 (or more)" in hint
