"""docs/configuration.md, rendered from the config's own help texts (sections.py), so the reference and
`hybridpar train --help` read one source. A test (tests/test_docs.py) fails when the file differs from
what `render()` gives; regenerate it with

    .venv/bin/python -m hybridpar.config.reference_doc --write docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from hybridpar.config.config import Config
from hybridpar.config.keys import _known_keys, _type_name
from hybridpar.config.parse import _flag, _format, one_of

COMMAND = ".venv/bin/python -m hybridpar.config.reference_doc --write docs/configuration.md"

INTRO = f"""# Configuration reference

<!-- Generated from the help texts in hybridpar/config/sections.py by
     {COMMAND}
     Edit the help texts, not this file: tests/test_docs.py fails when the two differ. -->

A run's configuration is typed dataclasses (`hybridpar/config/`), one TOML table per section below. Set
a key in a TOML file given with `--config FILE` (`[train]` then `lr = 1e-3`), or on the command line as
`--section.key VALUE` (`--train.lr 1e-3`, also `--train.lr=1e-3`; `-` and `_` are interchangeable),
applied after the file in order. Lists are comma-separated on the command line (`--train.microbatch_sizes
3,3,2,2`; TOML: `microbatch_sizes = [3, 3, 2, 2]`); `none` unsets an optional key (TOML has no null: leave
the key out). A run's own `<run-dir>/config.toml` reads back with `--config`. `hybridpar train --help`
prints the same table. Everything is validated before any process starts
([training.md](training.md#configuration))."""


def _cell(text: str) -> str:
    """Text for one markdown table cell: a literal '|' would end the cell."""
    return text.replace("|", "\\|")


def render() -> str:
    """The whole reference, as markdown."""
    about = {f.name: f.metadata["help"] for f in dataclasses.fields(Config)}
    by_section: dict[str, list[str]] = {}
    for key, f in _known_keys(Config).items():
        section = key.rpartition(".")[0]
        choices = one_of(f.metadata)
        by_section.setdefault(section, []).append(
            f"| `{_flag(key)}` | {_cell(_type_name(f.type))} | `{_cell(_format(f.default))}` | "
            f"{_cell(f.metadata['help'] + choices)} |"
        )
    by_section[""].insert(0, "| `--config` | file | | TOML file of these sections and top-level keys, applied first |")
    out = [INTRO]
    for section, rows in sorted(by_section.items(), key=lambda kv: kv[0] != ""):  # top-level keys first
        title = f"## `[{section}]`: {about[section]}" if section else "## Top-level keys (TOML: before any table)"
        out += ["", title, "", "| flag | type | default | meaning |", "|---|---|---|---|", *rows]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    """No arguments: print the reference. `--write FILE`: write it there."""
    if argv[:1] == ["--write"] and len(argv) == 2:
        Path(argv[1]).write_text(render(), encoding="utf-8")
        return 0
    if argv:
        print(f"usage: python -m hybridpar.config.reference_doc [--write FILE]\n\n{__doc__}", file=sys.stderr)
        return 2
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
