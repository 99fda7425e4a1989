"""The settings a producer needs: Redis's default URL, the name rule and the job limits.

Kept apart from :mod:`batchd.config.settings` (which holds the engine's options) so that a
service that only enqueues jobs imports nothing of the engine.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# Job ids and queue names become parts of Redis keys (``batchd:job:<id>:events``): no ``:``
# (job ``X:events`` would collide with job X's events stream), no spaces or glob characters.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class Section(BaseModel):
    # Each option's docstring is its description (JSON schema, documentation).
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


class LimitSettings(Section):
    """Limits applied to every job at validation time."""

    max_prompt_tokens: int = Field(32768, ge=1)
    """Longest prompt accepted, in tokens."""
    max_prompt_chars: int = Field(200_000, ge=1)
    """Longest prompt text (or all messages) in characters."""
    max_tokens_cap: int = Field(4096, ge=1)
    """Largest max_tokens a job may ask for."""
    max_message_bytes: int = Field(1_000_000, ge=1)
    """Largest job payload on the queue stream, in bytes."""
    max_messages: int = Field(256, ge=1)
    """Most chat messages in one job."""
