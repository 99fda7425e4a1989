"""A Redis master behind Sentinel: its URL (parsed, built) and the ``[sentinel]`` settings.

redis-py parses ``redis://``, ``rediss://`` and ``unix://`` URLs (``Redis.from_url``)
and follows a Sentinel-managed master (``redis.sentinel``), but has no URL for a
Sentinel deployment. batchd takes the form other Python tools settled on (the
``redis-sentinel-url`` package, Prefect and docket), so one string still names the
whole deployment in ``redis_url``, ``BATCHD_REDIS_URL`` and ``--redis-url``::

    redis+sentinel://[user:password@]host[:port][,host[:port]...]/service_name[/db][?options]
    rediss+sentinel://...   TLS to the master and to the Sentinels

Sentinels default to port 26379. The user and password are the master's (ACL); the
``sentinel_username`` and ``sentinel_password`` options are the Sentinels' own (they
may differ). Every other option is a redis-py URL option for the master's
connections, parsed by redis-py itself (``ssl_ca_certs``, ``ssl_cert_reqs``, ...);
on TLS the ``ssl_*`` options also apply to the Sentinels.

The ``[sentinel]`` section is the same deployment part by part (the form a config file
takes best); :meth:`SentinelSettings.url` turns it into the URL. The connection is made
from the URL by :mod:`batchd.producers.connection`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

from pydantic import Field, field_validator
from redis.connection import parse_url

from batchd.config.limits import Section
from batchd.config.secrets import redact

# Scheme -> TLS.
SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
DEFAULT_SENTINEL_PORT = 26379
# Options of the URL that belong to the Sentinels rather than the master.
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True)
class SentinelTarget:
    """A parsed ``redis+sentinel://`` URL: where the Sentinels are, which master they
    watch, and the keywords of the connections to each."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    tls: bool
    # redis-py connection keywords: db, credentials and URL options of the master ...
    master: dict[str, Any] = field(default_factory=dict)
    # ... and the Sentinels' credentials (and TLS options).
    sentinel: dict[str, Any] = field(default_factory=dict)


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a Sentinel deployment (by its scheme only)."""
    return url.partition("://")[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The deployment a ``redis+sentinel://`` URL names; ValueError (the URL shown
    without its passwords) when it has no Sentinel, no service name or a bad part."""
    tls, userinfo, hosts, path, query = split_url(url, SENTINEL_SCHEMES)
    service_name, _, db = path.strip("/").partition("/")
    if not service_name:
        raise ValueError(f"{redact(url)}: no service name (redis+sentinel://host/service_name)")
    try:
        sentinels = tuple(host_port(part) for part in hosts.split(",") if part)
        if not sentinels:
            raise ValueError("no Sentinel address")
        options = dict(parse_qsl(query, keep_blank_values=True))
        own = {
            name[len("sentinel_") :]: options.pop(name)
            for name in SENTINEL_OPTIONS
            if name in options
        }
        credentials = f"{userinfo}@" if userinfo else ""
        master = dict(parse_url(f"redis://{credentials}sentinel/{db or 0}?{urlencode(options)}"))
    except ValueError as exc:
        raise ValueError(f"{redact(url)}: {exc}") from None
    master.pop("host", None)
    if tls:
        master["ssl"] = True
        own.update({k: v for k, v in master.items() if k.startswith("ssl")})
    return SentinelTarget(sentinels, service_name, tls, master, own)


def split_url(url: str, schemes: dict[str, bool]) -> tuple[bool, str, str, str, str]:
    """``(tls, userinfo, hosts, path, query)`` of a URL naming several hosts, one of
    ``schemes`` (scheme -> TLS); ValueError (the URL shown without its password) for
    another scheme."""
    scheme, _, rest = url.partition("://")
    tls = schemes.get(scheme.lower())
    if tls is None:
        names = " or ".join(f"{name}://" for name in schemes)
        raise ValueError(f"{redact(url)}: not a {names} URL")
    rest, _, query = rest.partition("?")
    at = rest.rfind("@")
    userinfo, located = (rest[:at], rest[at + 1 :]) if at >= 0 else ("", rest)
    hosts, _, path = located.partition("/")
    return tls, userinfo, hosts, path, query


def host_port(address: str, default_port: int = DEFAULT_SENTINEL_PORT) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port``; ``default_port`` when none is given."""
    if address.startswith("["):
        host, _, port = address[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = address.rpartition(":") if ":" in address else (address, "", "")
    if not host:
        raise ValueError(f"address {address!r} has no host")
    if not port:
        return host, default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {address!r}: bad port")
    return host, int(port)


class SentinelSettings(Section):
    """A Redis master found through Sentinel; used by every batchd process (daemon,
    clients, gateway, bulk workers, CLI) when ``addresses`` is set, in place of
    ``redis_url``."""

    addresses: list[str] = Field(default_factory=list)
    """Sentinels as host:port (port 26379 when left out); set, they name the Redis and
    redis_url is not used; empty: redis_url is the Redis."""
    service_name: str = Field("mymaster", min_length=1)
    """The master's name in the Sentinels' configuration (sentinel monitor NAME ...)."""
    db: int = Field(0, ge=0)
    """Database number on the master."""
    username: str | None = None
    """ACL user on the master (and its replicas); unset: the default user."""
    password: str | None = None
    """Password on the master (and its replicas)."""
    sentinel_username: str | None = None
    """ACL user on the Sentinels, which may differ from the master's."""
    sentinel_password: str | None = None
    """Password on the Sentinels (sentinel requirepass), which may differ from the master's."""
    tls: bool = False
    """TLS to the master and to the Sentinels (rediss+sentinel://)."""

    @field_validator("addresses")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        for address in value:
            host_port(address)  # ValueError naming the bad address
        return value

    def url(self) -> str | None:
        """The deployment as a ``redis+sentinel://`` URL (credentials percent-encoded);
        None when no Sentinel is configured."""
        if not self.addresses:
            return None
        scheme = "rediss+sentinel" if self.tls else "redis+sentinel"
        userinfo = ""
        if self.username is not None or self.password is not None:
            userinfo = quote(self.username or "", safe="")
            if self.password is not None:
                userinfo += ":" + quote(self.password, safe="")
            userinfo += "@"
        options = {
            "sentinel_username": self.sentinel_username,
            "sentinel_password": self.sentinel_password,
        }
        query = urlencode({k: v for k, v in options.items() if v is not None})
        hosts = ",".join(self.addresses)
        url = f"{scheme}://{userinfo}{hosts}/{quote(self.service_name, safe='')}/{self.db}"
        return f"{url}?{query}" if query else url
