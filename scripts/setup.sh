#!/usr/bin/env bash
# Creates .venv (once) and installs hybridpar into it with the pinned PyTorch.
# `bash scripts/setup.sh test` also installs what the tests need. Python 3.11 or newer (PYTHON=...).
# torch is pinned: an unpinned or ranged torch can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "setup.sh: hybridpar needs Python 3.11 or newer, and $PY is $("$PY" -V 2>&1); run PYTHON=python3.11 bash scripts/setup.sh" >&2
    exit 2
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
extras="[report,serve]"  # the report's plots and /metrics: `hybridpar report` and `serve` work after the first command
[ "${1:-}" = "test" ] && extras="[test]"
pip_q=(-q --disable-pip-version-check)
.venv/bin/pip install "${pip_q[@]}" "torch==2.13.0" numpy 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/pip install "${pip_q[@]}" -e ".${extras}" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, hybridpar; assert torch.__version__.startswith('2.13.0'), torch.__version__"
