"""`hybridpar serve --help` lists the values an option with a fixed set accepts, as `train --help` does:
the strategies the docs name must be findable from the help alone. Pure."""

from __future__ import annotations

from hybridpar.serve.config import help_text
from hybridpar.serve.router import STRATEGIES


def test_serve_help_names_every_strategy_and_dtype() -> None:
    lines = {line.split()[0]: line for line in help_text().splitlines()}
    assert lines["--strategy"].endswith(f"(default 'hybrid'; one of {', '.join(STRATEGIES)})")
    assert lines["--dtype"].endswith("(default 'fp32'; one of fp32, bf16)")
    assert lines["--port"].endswith("(default 8000)")  # an open-ended option lists nothing
