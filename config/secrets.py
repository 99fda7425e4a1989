"""Keeping credentials out of what batchd prints: logs, errors, status lines, reports."""

from __future__ import annotations

import re

# user:password@ in any scheme://...: the password part is replaced.
_URL_SECRET = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s]+@", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the password of any ``scheme://user:password@`` replaced by ``***``."""
    return _URL_SECRET.sub(r"\1***@", text)
