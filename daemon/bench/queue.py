"""The queue workload: the mixed requests through Redis against the engine in-process.

Producers push the jobs onto the stream, the daemon runs them on its engine
and publishes every token; the same engine settings driven in-process give
the reference. The ratio (queue throughput over in-process) is the queue
layer's cost.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from daemon.bench.progress import Progress
from daemon.bench.systems import Systems
from daemon.bench.workloads import Workload

_DAEMON_MODULE = "daemon.worker"


def daemon_unavailable() -> str | None:
    """Why the queue workload cannot run here, or None when it can."""
    if importlib.util.find_spec(_DAEMON_MODULE) is None:
        return "not available: daemon missing"
    return None


def run_queue(
    systems: Systems, workload: Workload, *, redis_url: str, progress: Progress
) -> dict[str, Any]:
    reason = daemon_unavailable()
    if reason is not None:
        progress.say(f"queue: {reason}")
        return {"available": False, "reason": reason}
    raise NotImplementedError
