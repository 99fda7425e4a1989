"""What the pages say a command prints, or a daemon exports, is what it does: the parts
of getting-started.md's ``batchd doctor`` listing are the ones a real run reports, and
operations.md's metrics table names every series a daemon exports. A new check or series
without its line on the page fails here, so the pages a stranger reads stay whole."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from support.daemon_harness import ROOT
from support.redis_server import RedisServer

DOCS = ROOT / "docs"
TEXT_BLOCK = re.compile(r"^```text\n(.*?)^```$", re.M | re.S)
# A doctor line: its verdict, then the part's name, then two spaces or more before what
# it found.
DOCTOR_LINE = re.compile(r"^(ok|FAIL|warn)\s+(\S+(?: \S+)*?)\s{2,}\S")


def doctor_parts_on_the_page() -> list[str]:
    """The part names of getting-started.md's doctor listing, in order."""
    page = (DOCS / "getting-started.md").read_text()
    (listing,) = [b for b in TEXT_BLOCK.findall(page) if b.startswith("ok   batchd ")]
    parts = []
    for line in listing.splitlines():
        found = DOCTOR_LINE.match(line)
        assert found, f"not a doctor line: {line!r}"
        parts.append(found.group(2))
    return parts


def test_the_doctor_listing_names_the_parts_doctor_reports(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHD_")}
    done = subprocess.run(
        [sys.executable, "-m", "batchd.daemon.cli", "doctor", "--json"],
        cwd=tmp_path,
        env={**env, "BATCHD_REDIS_URL": redis_server.url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    reported = [check["name"] for check in json.loads(done.stdout)]
    assert doctor_parts_on_the_page() == reported


def test_the_metrics_table_names_every_exported_series() -> None:
    from batchd.daemon.ops.prom import DaemonMetrics

    metrics = DaemonMetrics(model="m", consumer="c")
    metrics.backend("mlx", "device", "the series exists once a daemon has chosen")
    # A counter's family is named without the _total its samples carry.
    names = {m.name + ("_total" if m.type == "counter" else "") for m in metrics.registry.collect()}
    page = (DOCS / "operations.md").read_text()
    section = page.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `batchd_")]
    listed = {name for row in rows for name in re.findall(r"`(batchd_\w+)", row.split(" | ")[0])}
    assert names <= listed, sorted(names - listed)
    assert listed <= names, sorted(listed - names)
