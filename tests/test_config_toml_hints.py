"""A TOML config holding a value as the command line spells it (a quoted number, "none", "3,3") is refused
with the TOML spelling that would be right. Pure: parse_args over a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpar.config import parse_args


@pytest.mark.parametrize(
    "toml, hint",
    [
        ('[model]\nn_kv_heads = "none"\n', "TOML has no none; leave the key out to keep it unset"),
        ('[train]\nmicrobatch_sizes = "3,3"\n', "a TOML list is written in brackets, e.g. [3, 3]"),
        ('[train]\nsteps = "3"\n', "write 3 without quotes"),
        ('[train]\nlr = "1e-3"\n', "write 1e-3 without quotes"),
        ('[train]\ncompile = "true"\n', "write true without quotes"),
    ],
)
def test_a_value_spelled_as_on_the_command_line_gets_its_toml_spelling(tmp_path: Path, toml: str, hint: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(toml, encoding="utf-8")
    with pytest.raises(ValueError) as e:
        parse_args(["--config", str(f)])
    assert str(e.value).endswith(hint)


def test_a_string_that_is_no_spelling_of_the_type_gets_no_hint(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = "three"\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"expects int, got 'three' \(str\)$"):
        parse_args(["--config", str(f)])
