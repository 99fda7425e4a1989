"""Typed errors of the producer side; each carries what a caller acts on."""

from __future__ import annotations


class BatchdError(Exception):
    """Base of every batchd client error."""


class ValidationError(BatchdError, ValueError):
    """A job request breaks the protocol; ``field`` names the offending field."""

    def __init__(self, field: str, message: str, *, value: object = None) -> None:
        self.field = field
        self.message = message
        self.value = value
        super().__init__(f"{field}: {message}" if field else message)


class TooComplex(ValidationError):
    """A value (a response_format's JSON schema) is nested too deep or holds too many
    values to be validated safely; refused before any validator reads it."""


class JobFailed(BatchdError):
    """The job ended without a result (error, cancelled or expired)."""

    def __init__(self, job_id: str, reason: str, error: str | None = None) -> None:
        self.job_id = job_id
        self.reason = reason
        self.error = error
        detail = f": {error}" if error else ""
        super().__init__(f"job {job_id} ended with {reason}{detail}")


class JobTimeout(BatchdError, TimeoutError):
    """The job did not finish within the caller's timeout (it may still run)."""

    def __init__(self, job_id: str, timeout: float) -> None:
        self.job_id = job_id
        self.timeout = timeout
        super().__init__(f"job {job_id} did not finish within {timeout:g}s")


class JobNotFound(BatchdError, LookupError):
    """No status hash for this job id: never submitted, or its results expired."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(f"job {job_id} not found (never submitted, or expired)")


class NotReplicated(BatchdError):
    """Fewer replicas than asked confirmed a submit in time (``replicas`` of the client).

    The master has the jobs; a failover before its replicas catch up would lose them.
    Submitting again with ``idempotent=True`` attaches to them where they survived.
    """

    def __init__(self, job_ids: list[str], acked: int, wanted: int) -> None:
        self.job_ids = job_ids
        self.acked = acked
        self.wanted = wanted
        shown = ", ".join(job_ids[:3]) + (", ..." if len(job_ids) > 3 else "")
        super().__init__(f"job(s) {shown}: {acked} of {wanted} replica(s) confirmed the submit")


class ProtocolError(BatchdError):
    """A job's events stream breaks the protocol (a gap in seq, an undecodable event)."""

    def __init__(self, job_id: str, message: str) -> None:
        self.job_id = job_id
        super().__init__(f"job {job_id}: {message}")


class BulkBusy(BatchdError):
    """Another bulk run is writing this output file (it is locked)."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"another bulk run is writing {path}")


class UnsafePath(ValidationError):
    """A bulk run named a file it may not touch: not one plain name inside the worker's
    files folder, a link, not a regular file, or an output batchd did not create."""
