"""What Sentinel costs a producer: connecting, submitting, and submitting with ``replicas=1``
(WAIT 1), on one deployment, in alternating rounds; then how long a failover takes.

``cd tests && python -m measure.sentinel`` starts a master, a replica and three Sentinels
on 127.0.0.1 (:mod:`support.sentinel`), then prints the median and p90 of: a new client
and its first PING (standalone URL vs ``redis+sentinel://``: the Sentinel lookup), a
submit through each URL, and a submit that waits for its replica; finally the seconds
from SIGKILL of the master until a replica is promoted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from batchd.producers.client import Client
from batchd.producers.connection import redis_client
from support.sentinel import sentinel_deployment


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m measure.sentinel", description=__doc__)
    p.add_argument("--submits", type=int, default=2000, help="submits per path and round")
    p.add_argument("--connects", type=int, default=200, help="new clients per URL")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--down-after-ms", type=int, default=500, help="Sentinel failure detection")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        with sentinel_deployment(Path(tmp), down_after_ms=args.down_after_ms) as deployment:
            urls = {"standalone": deployment.master.url, "sentinel": deployment.url}
            for name, url in urls.items():
                _show(f"{name}: new client + first PING", _timed(_connect(url), args.connects))
            for round_ in range(args.rounds):
                paths = [("standalone", 0), ("sentinel", 0), ("sentinel", 1)]
                for name, replicas in paths:
                    with Client(urls[name], replicas=replicas) as client:
                        submit = _submitter(client, f"{round_}-{name}-{replicas}")
                        label = f"round {round_} {name} submit, replicas={replicas}"
                        _show(label, _timed(submit, args.submits))
            started = time.monotonic()
            deployment.kill_master()
            print(f"master SIGKILL -> replica promoted: {time.monotonic() - started:.2f} s")
    return 0


def _connect(url: str) -> Callable[[], None]:
    def once() -> None:
        client = redis_client(url, socket_connect_timeout=2)
        client.ping()
        client.close()

    return once


def _submitter(client: Client, prefix: str) -> Callable[[], None]:
    count = iter(range(1 << 30))

    def once() -> None:
        client.submit("hi", id=f"{prefix}-{next(count)}", max_tokens=4)

    return once


def _timed(call: Callable[[], None], n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return sorted(times)


def _show(label: str, times: list[float]) -> None:
    p90 = times[int(0.9 * (len(times) - 1))]
    print(f"{label}: median {statistics.median(times) * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
