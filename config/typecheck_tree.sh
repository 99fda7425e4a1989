#!/usr/bin/env bash
# Lay out build/typecheck/batchd as the installed package looks (batchd.engine -> engine/,
# ...) with links to the repository's folders, for mypy (pyproject.toml's mypy_path):
# setuptools' editable install maps the folders with an import hook that mypy cannot read.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tree="$root/build/typecheck/batchd"
mkdir -p "$tree"
for part in engine daemon producers config; do ln -sfn "$root/$part" "$tree/$part"; done
for file in __init__.py py.typed; do ln -sfn "$root/batchd/$file" "$tree/$file"; done
