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
