#!/usr/bin/env bash
# The test command: installs what it needs, then lint, type check, the docs site and tests.
# Extra arguments go to pytest (e.g. bash tests/run.sh -k scheduler).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../config/bootstrap.sh"
batchd_install_test_tools
cd "$BATCHD_ROOT"
echo "== ruff" >&2
ruff check .
echo "== mypy" >&2
# mypy reads the installed layout (batchd.engine, ...) from a tree of links to the folders
# (it cannot follow setuptools' editable import hook): build/typecheck, see pyproject.toml.
bash config/typecheck_tree.sh
mypy
echo "== docs" >&2
# The documentation site, strictly: a broken link or anchor fails (mkdocs.yml, docs/).
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet
echo "== pytest" >&2
# Three workers (pytest-xdist), a test file each at a time: most tests wait on the
# processes they start (redis-server, daemons, gateways), so three overlap well on two
# cores. BATCHD_TEST_WORKERS=0 runs them one by one, in this process.
exec python -m pytest -m "not slow" -n "${BATCHD_TEST_WORKERS:-3}" --dist loadfile "$@"
