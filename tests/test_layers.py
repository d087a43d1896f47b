"""The layer order of docs/architecture.md, enforced: every `hybridpar` import (at module level or inside
a function) points to the same layer or one below. A module added without a layer fails too, so the map
stays complete."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "hybridpar"

# Bottom to top; a module may import its own layer and the layers below it. Keys are top-level modules
# or packages of hybridpar (docs/architecture.md says what each owns).
LAYERS: list[set[str]] = [
    {"config"},  # typed configs and their validation: pure
    {"topology"},  # ranks, meshes, collectives, CPUs, rendezvous, the spawn helper
    {"model", "data"},  # the model, AdamW, the single-device reference; corpus, tokenizers, token files
    {"pipeline", "dataparallel"},  # schedules, runtime, p2p; gradient reductions, the sharded optimizer
    {"batching", "balance", "resilience", "report"},  # microbatch policy, load balancing, recovery, records
    {"trainer"},  # one training step over every dimension, export to Hugging Face
    # A training run, its pre-flight and launch, the layout planner it may ask, and the emulated devices and
    # faults it may attach (above the trainer and resilience, so that neither can import them).
    {"run", "plan", "emulate"},
    {"serve", "bench", "cli"},  # what users run (cli.py: the one module besides __init__ at the root)
]
EXEMPT = {"__init__"}  # the package's public names (Config, launch) gather from every layer


def layer_of(top: str) -> int:
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise KeyError(top)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported hybridpar top-level name) for every hybridpar import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "hybridpar" else [f"hybridpar.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("hybridpar.")]
    return out


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        top = path.relative_to(root).with_suffix("").parts[0]
        if top in EXEMPT:
            continue
        try:
            mine = layer_of(top)
        except KeyError:
            bad.append(f"{path}: module '{top}' has no layer in tests/test_layers.py (and docs/architecture.md)")
            continue
        for line, other in imports(path):
            try:
                theirs = layer_of(other)
            except KeyError:
                continue  # reported for that module's own file
            if theirs > mine:
                bad.append(
                    f"{path.relative_to(root.parent)}:{line}: '{top}' (layer {mine}) imports "
                    f"'{other}' (layer {theirs}), a layer above it"
                )
    return bad


def test_imports_point_down() -> None:
    assert not violations(), "\n".join(violations())


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """The check itself: a model module importing the trainer is reported with its line."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "bad.py").write_text("import os\n\ndef f():\n    from hybridpar.trainer import Trainer\n")
    (tmp_path / "trainer.py").write_text("from hybridpar.model.bad import f\n")
    assert violations(tmp_path) == [
        f"{tmp_path.name}/model/bad.py:4: 'model' (layer 2) imports 'trainer' " f"(layer 5), a layer above it"
    ]


@pytest.mark.parametrize("doc", ["README.md", "docs"])
def test_docs_stand_on_their_own(doc: str) -> None:
    """README, docs/ and help texts never point outside the repository nor to a tutorial users lack."""
    paths = [ROOT.parent / doc] if doc.endswith(".md") else sorted((ROOT.parent / doc).rglob("*.md"))
    for path in paths:
        text = path.read_text(encoding="utf-8")
        assert "../shared" not in text and "tutorial" not in text.lower(), path


def test_help_texts_stand_on_their_own() -> None:
    from hybridpar.cli import USAGE
    from hybridpar.config import help_text

    for text in (USAGE, help_text()):
        assert "tutorial" not in text.lower() and "../shared" not in text


def test_the_package_root_holds_folders_only() -> None:
    """Every module lives in its layer's folder; the root keeps the public names and the command."""
    assert sorted(p.name for p in ROOT.glob("*.py")) == ["__init__.py", "cli.py"]
