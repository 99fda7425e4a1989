"""Who may act: operator sessions, Bearer operator keys, and the CSRF rules of a POST.

Reading is open (unless the dashboard is private); every action needs an operator. A
browser logs in once with an operator key and gets a session cookie: HttpOnly,
SameSite=Strict, Secure on https, signed with the key (HMAC-SHA256) so the server keeps
no session state and rotating the key ends every session made with it. A script may
instead send ``Authorization: Bearer <operator key>`` (never sent by a browser on its
own, so not forgeable cross-site).

A cookie is ambient, so a POST made with one must also carry the session's CSRF token
(form field ``csrf`` or header ``X-CSRF-Token``; an HMAC of the session's nonce) and
must not come from another origin (``Origin``/``Sec-Fetch-Site``). No credentials:
401; credentials refused or a forged request: 403. Operator keys are never stored or
logged: an operator is named by the key's digest.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request

COOKIE = "batchd_operator"
CSRF_FIELD = "csrf"
CSRF_HEADER = "x-csrf-token"


@dataclass(frozen=True)
class Operator:
    """An authenticated operator: ``id`` is its key's digest (what the audit log names);
    ``csrf`` the token its forms carry (empty for a Bearer caller, who needs none)."""

    id: str
    csrf: str
    bearer: bool = False


class Refused(Exception):
    """An action refused: ``status`` 401 (no credentials) or 403 (refused, forged)."""

    def __init__(self, status: int, reason: str) -> None:
        self.status = status
        self.reason = reason
        super().__init__(reason)


def key_id(key: str) -> str:
    """The name of an operator key in logs and the audit stream: a digest, never the key."""
    return "op-" + hashlib.sha256(f"batchd-operator\0{key}".encode()).hexdigest()[:12]


def _mac(key: str, *parts: str) -> str:
    message = "\0".join(parts).encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


class OperatorAuth:
    """Operator keys and the sessions signed with them."""

    def __init__(self, keys: tuple[str, ...], *, session_ttl_s: float) -> None:
        self.keys = keys
        self.session_ttl_s = session_ttl_s

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def matching_key(self, given: str) -> str | None:
        """The operator key equal to ``given`` (compared in constant time), or None."""
        found = None
        for key in self.keys:
            if hmac.compare_digest(key.encode(), given.encode()):
                found = key
        return found

    def new_session(self, key: str, *, now: float | None = None) -> str:
        """A cookie value for ``key``: ``expires.nonce.mac``."""
        expires = str(int((now or time.time()) + self.session_ttl_s))
        nonce = secrets.token_hex(16)
        return f"{expires}.{nonce}.{_mac(key, 'session', expires, nonce)}"

    def session(self, value: str, *, now: float | None = None) -> Operator | None:
        """The operator of a cookie value, or None (unsigned, expired, or its key gone)."""
        parts = value.split(".")
        if len(parts) != 3 or not parts[0].isdigit():
            return None
        expires, nonce, mac = parts
        if int(expires) < (now or time.time()):
            return None
        for key in self.keys:
            if hmac.compare_digest(mac, _mac(key, "session", expires, nonce)):
                return Operator(key_id(key), _mac(key, "csrf", nonce))
        return None

    def operator(self, request: Request) -> Operator | None:
        """The request's operator (Bearer key or session cookie), or None."""
        if not self.enabled:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token:
            key = self.matching_key(token.strip())
            return Operator(key_id(key), "", bearer=True) if key else None
        cookie = request.cookies.get(COOKIE)
        return self.session(cookie) if cookie else None

    def require(self, request: Request, form_token: str | None) -> Operator:
        """The operator allowed to make this POST; raises Refused (401 or 403)."""
        if not self.enabled:
            raise Refused(403, "this dashboard has no operator key: it is read-only")
        given_bearer = request.headers.get("authorization", "").lower().startswith("bearer ")
        operator = self.operator(request)
        if operator is None:
            if given_bearer or request.cookies.get(COOKIE):
                raise Refused(403, "operator key or session refused (log in again)")
            raise Refused(401, "operator login required")
        if operator.bearer:
            return operator
        if not same_origin(request):
            raise Refused(403, "cross-origin request refused")
        token = form_token or request.headers.get(CSRF_HEADER) or ""
        if not hmac.compare_digest(token.encode(), operator.csrf.encode()):
            raise Refused(403, "missing or wrong CSRF token (reload the page)")
        return operator


def same_origin(request: Request) -> bool:
    """False when the browser says the request comes from another site or origin."""
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin") or request.headers.get("referer")
    if not origin or origin == "null":
        return origin is None
    parts = urlsplit(origin)
    return parts.netloc == request.headers.get("host", "") and parts.scheme in ("http", "https")
