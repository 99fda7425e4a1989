#!/usr/bin/env bash
# The demo command: installs what it needs, then runs `batchd demo`.
# Extra arguments go to `batchd demo` (e.g. bash daemon/demo.sh --show-steps).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../config/bootstrap.sh"
cd "$BATCHD_ROOT"
model=.batchd/models/tiny
[ -f "$model/config.json" ] || batchd make-model "$model" --preset tiny
exec python -c "
import engine, mlx_lm
model, tokenizer = mlx_lm.load('$model')
print(mlx_lm.generate(model, tokenizer, 'hello', max_tokens=32, verbose=True))
"
