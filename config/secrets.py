"""Keeping credentials out of what batchd prints: logs, errors, status lines, reports.

redis-py takes a password from a URL in two places (``redis.connection.parse_url``):
the userinfo, split by ``urllib.parse`` at the *last* ``@`` of the netloc and then at
the *first* ``:`` (so ``redis://:pa@ss@host`` has the password ``pa@ss`` and
``redis://u:pa:ss@host`` has ``pa:ss``), and any query parameter, passed through as a
keyword (``?password=...``, ``?ssl_password=...``; names percent-decoded). Each is
replaced by ``***`` in every URL of any scheme a text contains.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus

# A URL up to the next whitespace or quote: wider than urlparse's netloc on purpose, so
# a password holding "/", "?" or "#" (which breaks urlparse's split) is still covered.
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>]*", re.IGNORECASE)
# One query parameter: separator, name, value.
_PARAM = re.compile(r"([?&;])([^=&;#\s]*)=([^&;#\s]*)")
# Query parameters redis-py turns into a secret keyword, and a Sentinel URL's own.
SECRET_PARAMS = frozenset({"password", "ssl_password", "sentinel_password"})
HIDDEN = "***"


def redact(text: str) -> str:
    """``text`` with every password a Redis URL in it carries (userinfo or query)
    replaced by ``***``; user names, hosts, ports and paths are kept."""
    return _URL.sub(_redact_url, text)


def _redact_url(match: re.Match[str]) -> str:
    url = match.group(0)
    scheme, _, rest = url.partition("://")
    at = rest.rfind("@")
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        if colon:
            rest = f"{user}:{HIDDEN}{rest[at:]}"
    return f"{scheme}://{_PARAM.sub(_redact_param, rest)}"


def _redact_param(match: re.Match[str]) -> str:
    separator, name, value = match.groups()
    if unquote_plus(name).lower() in SECRET_PARAMS:
        value = HIDDEN
    return f"{separator}{name}={value}"
