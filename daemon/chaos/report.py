"""The chaos run's table: what was done to the system, and the counts that must be zero."""

from __future__ import annotations

from batchd.daemon.chaos.faults import FaultKind
from batchd.daemon.chaos.run import ChaosResult


def render(result: ChaosResult, *, command: str) -> str:
    verdict, ledger = result.verdict, result.ledger
    rate = (verdict.completed + verdict.cancelled_as_asked) / max(result.seconds, 1e-9)
    rows: list[tuple[str, str]] = [
        ("submitted", f"{verdict.submitted} (+{verdict.resubmitted} again after Redis lost them)"),
        ("completed, equal to the reference", str(verdict.completed)),
        ("cancelled as asked", f"{verdict.cancelled_as_asked} of {verdict.cancel_asked} asked"),
        ("cancels of unknown ids answered JobNotFound", str(ledger.unknown_cancels)),
        (
            "hostile entries dead-lettered",
            f"{verdict.hostile_dead_lettered}/{verdict.hostile_sent} "
            f"(+{len(ledger.hostile_lost)} resent after Redis lost them, "
            f"{ledger.hostile_unanswered} unanswered)",
        ),
    ]
    rows += [(name, _zero(count)) for name, count in verdict.zeros().items()]
    rows += [
        ("keys left after result TTLs expired", _zero(result.keys_left)),
        ("keys whose TTL started late (gone within it)", str(len(result.late))),
        ("jobs still queued or running after the run", _zero(result.stuck_running)),
        ("per-job keys without a TTL", _zero(result.keys_without_ttl)),
        ("jobs/s (under faults)", f"{rate:.1f}"),
        ("reference run (in-process, no faults)", f"{result.reference_seconds:.1f} s"),
        ("run time", f"{result.seconds:.1f} s"),
        ("peak Redis memory", f"{result.peak_redis_bytes / 2**20:.1f} MiB"),
        ("subscriber disconnects + resumes", str(ledger.resumes)),
        (
            "ids a hostile entry took once their results were gone",
            str(verdict.renamed_after_expiry),
        ),
    ]
    rows += [
        (f"fault: {FaultKind[kind].value}", str(count))
        for kind, count in sorted(ledger.faults.items())
    ]
    width = max(len(name) for name, _ in rows)
    lines = [
        f"$ {command}",
        "",
        f"| {'check'.ljust(width)} | value |",
        f"|{'-' * (width + 2)}|-------|",
    ]
    lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    lines.append("")
    lines.append("PASS" if result.passed else "FAIL")
    problems = result.failures + verdict.findings
    if problems:
        lines.append("findings:")
        lines += [f"  {line}" for line in problems[:40]]
        if len(problems) > 40:
            lines.append(f"  ... and {len(problems) - 40} more")
    for title, described in (
        ("keys left after result TTLs expired", result.left),
        ("keys whose TTL started late, as they were when the result TTL passed", result.late),
    ):
        if described:
            lines.append(f"{title}:")
            lines += [f"  {line}" for line in described[:40]]
    if result.other_keys:
        lines.append(
            f"other keys (queues, dead letters, cancel stream): {', '.join(result.other_keys)}"
        )
    return "\n".join(lines)


def _zero(count: int) -> str:
    return f"**{count}**" if count == 0 else f"**{count}** FAIL"
