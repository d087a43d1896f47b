"""No function in the package is longer than MAX_LINES (decorators not counted, docstring and comments
counted): a longer one is split into named helpers. Pure: reads the sources, imports nothing."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridpar"
MAX_LINES = 80


def long_functions(root: Path, limit: int) -> list[str]:
    """`path:line name (n lines)` of every function or method under `root` longer than `limit` lines, the
    path from `root`'s parent (hybridpar/...)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_is_longer_than_the_limit() -> None:
    offenders = long_functions(PACKAGE, MAX_LINES)
    assert not offenders, f"functions over {MAX_LINES} lines (split them into named helpers):\n" + "\n".join(offenders)


def test_the_check_sees_a_long_function_and_its_length(tmp_path: Path) -> None:
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}")
    found = long_functions(tmp_path, MAX_LINES)
    assert found == [f"{tmp_path.name}/m.py:6 long ({MAX_LINES + 1} lines)"]
