#!/usr/bin/env bash
# The test command: installs what it needs, then lint, type check and tests.
# Extra arguments go to pytest (e.g. bash tests/run.sh -k scheduler).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../config/bootstrap.sh"
cd "$BATCHD_ROOT"
echo "== ruff" >&2
ruff check .
echo "== mypy" >&2
# mypy reads the installed layout (batchd.engine, ...) from a tree of links to the folders
# (it cannot follow setuptools' editable import hook): build/typecheck, see pyproject.toml.
bash config/typecheck_tree.sh
mypy
echo "== pytest" >&2
exec python -m pytest -m "not slow" "$@"
