"""Benchmarks have one home (hybridpar/bench/__init__.py): every bench module is a registered
`hybridpar bench NAME` whose --help works, the package imports nothing from tests/, and the source tree's
bench/ holds only results/. Pure: in-process, and any attempt to start a process fails the test."""

from __future__ import annotations

import ast
import multiprocessing.process
import subprocess
from pathlib import Path

import pytest

from hybridpar.bench import BENCHES
from hybridpar.bench import main as bench_main

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridpar"
# Modules of hybridpar/bench/ with a main() that are not benchmarks, and why.
NOT_BENCHES = {
    "gpu_check": "the steps of scripts/gpu_check.sh, run as python -m hybridpar.bench.gpu_check under its timeouts",
}


def defines_main(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)


def test_every_bench_module_with_a_main_is_registered() -> None:
    with_main = {p.stem for p in (PACKAGE / "bench").glob("*.py") if p.stem != "__init__" and defines_main(p)}
    assert not with_main - set(BENCHES) - set(NOT_BENCHES), "add them to BENCHES in hybridpar/bench/__init__.py"
    assert not set(BENCHES) - with_main, "registered names without a module that defines main()"
    assert len(set(BENCHES)) == len(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_help_of_each_bench_exits_0_and_starts_nothing(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"hybridpar bench {name} --help started a process")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    with pytest.raises(SystemExit) as exit_:  # argparse's --help prints and exits
        bench_main([name, "--help"])
    assert exit_.value.code in (0, None)
    assert f"hybridpar bench {name}" in capsys.readouterr().out


def test_bench_help_says_what_each_measures(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, what in BENCHES.items():
        assert len(what) > 20 and f"  {name:<18} {what}" in lines, name
    assert bench_main([]) == 2  # no name: the same listing on stderr, exit 2


def test_the_package_imports_nothing_from_tests() -> None:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "tests"]
    assert not bad, bad


def test_the_source_trees_bench_folder_holds_only_results() -> None:
    entries = sorted(p.name for p in (ROOT / "bench").iterdir() if p.name != "__pycache__")
    assert entries == ["results"], f"bench/ holds {entries}: benchmarks live in hybridpar/bench/"
