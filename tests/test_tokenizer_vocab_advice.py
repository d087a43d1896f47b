"""A tokenizer with more ids than the model embeds is refused with advice that can be followed: set
model.vocab_size for a model trained from scratch; for a model.init_from (whose config.json fixes the
vocabulary, so a --model.vocab_size is refused) use its own tokenizer or a smaller one. Pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpar import cli
from hybridpar.config import Config
from hybridpar.run.data_checks import check_tokens


@pytest.fixture(scope="module")
def tok300(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("tok")
    (tmp / "text").mkdir()
    (tmp / "text" / "a.txt").write_text("def parse(text):\n    return text.split()\n" * 400, encoding="utf-8")
    argv = ["data", "train-tokenizer", "--vocab-size", "300", "--input", str(tmp / "text"), "--out", str(tmp / "t")]
    assert cli.main(argv) == 0
    return tmp / "t"


def test_from_scratch_the_advice_is_a_larger_vocabulary(tok300: Path) -> None:
    cfg = Config()
    cfg.data.tokenizer = str(tok300)
    with pytest.raises(ValueError, match=r"has \d+ ids but model.vocab_size=256.*set model.vocab_size to \d+"):
        check_tokens(cfg)


def test_from_a_hugging_face_model_the_advice_leaves_its_vocabulary_alone(tok300: Path, tmp_path: Path) -> None:
    cfg = Config()
    cfg.data.tokenizer, cfg.model.init_from = str(tok300), str(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"fixes model.vocab_size: use its own tokenizer .* or one of at most 256 ids"):
        check_tokens(cfg)
