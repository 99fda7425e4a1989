#!/usr/bin/env bash
# The demo command: installs what it needs, then runs `batchd demo`.
# Extra arguments go to `batchd demo` (e.g. bash daemon/demo.sh --show-steps).
# It uses the Redis of $BATCHD_REDIS_URL if one answers, else starts a private one.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../config/bootstrap.sh"
cd "$BATCHD_ROOT"
exec batchd --log-level "${BATCHD_LOG_LEVEL:-WARNING}" demo "$@"
