"""batchd's settings: one object, three layers.

Precedence, highest first: ``BATCHD_*`` environment variables (nested options
use a double underscore, e.g. ``BATCHD_ENGINE__MAX_NUM_SEQS``), then a TOML
file (``--config FILE`` or ``BATCHD_CONFIG``), then the defaults below. The
documented default file ``config/batchd.toml`` lists every option.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

import tomllib
from pydantic import (
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings import SettingsError as PydanticSettingsError
from redis.connection import parse_url

from batchd.config.cluster import is_cluster_url, parse_cluster_url
from batchd.config.limits import DEFAULT_REDIS_URL, NAME_PATTERN, LimitSettings, Section
from batchd.config.secrets import redact
from batchd.config.sections import BulkSettings, GatewaySettings, QueueSettings
from batchd.config.sentinel import SentinelSettings, is_sentinel_url, parse_sentinel_url
from batchd.engine.config import EngineConfig

CONFIG_ENV_VAR = "BATCHD_CONFIG"
# Schemes of redis_url: redis-py's own, and a master found through Sentinel.
SCHEMES = (
    "redis://",
    "rediss://",
    "unix://",
    "redis+sentinel://",
    "rediss+sentinel://",
    "redis+cluster://",
    "rediss+cluster://",
)


class DaemonSettings(Section):
    """The long-lived worker process."""

    consumer_name: str | None = None
    """Consumer name in the group; unset: host:pid (unique per process)."""
    heartbeat_interval_s: float = Field(1.0, gt=0)
    """How often the heartbeat is set."""
    heartbeat_ttl_s: float = Field(10.0, gt=0)
    """Heartbeat lifetime; a daemon silent this long counts as dead."""
    claim_interval_s: float = Field(5.0, gt=0)
    """How often to look for jobs of dead consumers to take over."""
    intake_buffer: int = Field(4, ge=0)
    """Jobs read beyond what the engine can run now (backpressure)."""
    block_ms: int = Field(1000, ge=1)
    """How long an idle daemon blocks on XREADGROUP, in ms."""
    publish_interval_ms: int | None = Field(None, ge=0, le=60_000)
    """While busy, send the jobs' tokens to Redis at most this often, in ms (0: after every
    step); a job's first token and its end go out at once. Unset: 100 where the engine
    computes on the CPU (each publish stops it for a round trip), else 0."""
    grace_period_s: float = Field(30.0, ge=0)
    """On SIGTERM/SIGINT, time running jobs get to finish."""
    max_deliveries: int = Field(5, ge=1)
    """Deliveries after which a job runs alone (at most two crashes with it in a batch);
    it is dead-lettered as poison only when its daemon dies twice while running it alone
    with no progress."""
    redis_retry_max_s: float = Field(5.0, gt=0)
    """Longest backoff between Redis reconnection attempts."""
    metrics_port: int | None = Field(None, ge=1, le=65535)
    """Port of the Prometheus /metrics endpoint; unset: off."""
    metrics_addr: str = Field("127.0.0.1", min_length=1)
    """Address the metrics endpoint listens on."""
    stall_timeout_s: float = Field(300.0, gt=0)
    """A daemon with work and no completed step this long counts as dead: its jobs become
    claimable and it exits non-zero for its supervisor to restart it."""

    @field_validator("consumer_name")
    @classmethod
    def _no_colon_only(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be blank")
        return value


class Settings(BaseSettings):
    """Every option of batchd. Build it with :func:`load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix="BATCHD_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        use_attribute_docstrings=True,
    )

    redis_url: str = DEFAULT_REDIS_URL
    """Redis URL (redis://, rediss://, unix://; redis+sentinel://host:port,.../service/db
    or rediss+sentinel:// for a master behind Sentinel, see also [sentinel];
    redis+cluster://host:port,... or rediss+cluster:// for a Redis Cluster)."""
    key_prefix: str = Field("batchd", min_length=1)
    """Prefix of every Redis key."""
    model: str | None = None
    """Model served: local path, hub id, .gguf file or preset (smollm2)."""
    queues: list[Annotated[str, StringConstraints(pattern=NAME_PATTERN)]] = Field(
        default_factory=lambda: ["default"],
        min_length=1,
    )
    """Queues (streams <prefix>:queue:<name>) the daemon consumes."""
    queue: QueueSettings = Field(default_factory=QueueSettings)
    result_ttl_s: int = Field(86400, ge=1)
    """Seconds a finished job's events and status are kept."""
    log_level: str = "INFO"
    """Logging level (DEBUG, INFO, WARNING, ERROR)."""
    log_format: Literal["text", "json"] = "text"
    """Log lines as text, or one JSON object per line."""
    # The engine's own dataclass is the one definition of its options: pydantic validates
    # the fields by their types and runs EngineConfig's cross-field checks.
    engine: EngineConfig = Field(default_factory=EngineConfig)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    daemon: DaemonSettings = Field(default_factory=DaemonSettings)
    bulk: BulkSettings = Field(default_factory=BulkSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    sentinel: SentinelSettings = Field(default_factory=SentinelSettings)

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(SCHEMES):
            raise ValueError("must start with " + ", ".join(SCHEMES))
        if is_sentinel_url(value):
            parse_sentinel_url(value)  # ValueError naming the bad part
        elif is_cluster_url(value):
            parse_cluster_url(value)
        else:
            # What redis-py would refuse at the first command (a port that is no number,
            # a bad query option): refused here, naming the setting, not as a traceback.
            try:
                parse_url(value)
            except ValueError as exc:
                raise ValueError(f"{exc} (expected redis://[USER:PASSWORD@]HOST:PORT/DB)") from None
        return value

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_mappings(cls, value: Any) -> Any:
        # The environment gives engine.adapters as JSON text: pydantic-settings decodes the
        # complex fields of models only, and the engine's options are a dataclass.
        if isinstance(value, dict) and isinstance(value.get("adapters"), str):
            try:
                return {**value, "adapters": json.loads(value["adapters"])}
            except ValueError as exc:
                raise ValueError(f"adapters: not a JSON object of name -> path: {exc}") from None
        return value

    def connection_url(self) -> str:
        """The URL every batchd process connects with: the ``redis+sentinel://`` URL of the
        ``[sentinel]`` section when it lists Sentinels (it wins over ``redis_url``), else
        ``redis_url``."""
        return self.sentinel.url() or self.redis_url

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
        return level

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file comes from the class's own model_config (see load_settings).
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls)


_ENGINE_FIELD = re.compile(r"\bEngineConfig\.(\w+)")
# pydantic's words for an option no model declares (a BaseModel section, a dataclass).
_UNKNOWN = frozenset({"extra_forbidden", "unexpected_keyword_argument"})
UNKNOWN_OPTION = (
    "unknown option (a typo? docs/reference/configuration.md lists every option batchd has)"
)


class SettingsError(ValueError):
    """Invalid configuration; the message names each bad option and value."""


def load_settings(config_file: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Build Settings from overrides > environment > TOML file > defaults.

    ``overrides`` are explicit values (command-line flags); ``None`` values are
    ignored so unset flags do not mask the other layers. Raises SettingsError
    with one line per bad option.
    """
    path = config_file or os.environ.get(CONFIG_ENV_VAR) or None
    resolved = Path(path) if path else None
    if resolved is not None and not resolved.is_file():
        missing = "is not a file" if resolved.exists() else "does not exist"
        raise SettingsError(f"config file {str(resolved)!r} {missing}: give a TOML file")
    settings_cls = Settings if resolved is None else _reading(resolved)
    try:
        return settings_cls(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise SettingsError(_describe(exc, resolved)) from None
    except PydanticSettingsError as exc:  # a list or table option's env value is no JSON
        raise SettingsError(
            f"invalid settings: {exc} ({exc.__cause__}): a list or table option takes JSON in "
            """the environment, e.g. BATCHD_QUEUES='["default"]'"""
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {str(resolved)!r} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise SettingsError(f"cannot read config file {str(resolved)!r}: {exc}") from None


def _reading(toml_file: Path) -> type[Settings]:
    """Settings whose TOML layer is ``toml_file`` (passed down, never held globally)."""

    class FileSettings(Settings):
        model_config = SettingsConfigDict(toml_file=toml_file)

    return FileSettings


def _describe(exc: ValidationError, config_file: Path | None) -> str:
    lines = ["invalid settings:"]
    for err in exc.errors():
        loc = tuple(str(part) for part in err["loc"])
        value = err.get("input")
        message = UNKNOWN_OPTION if err["type"] in _UNKNOWN else err["msg"]
        message = message.removeprefix("Value error, ")
        # EngineConfig (a dataclass) checks its fields together, so pydantic places the
        # error on the whole section: name the field its message names instead.
        field = _ENGINE_FIELD.search(message)
        if loc == ("engine",) and field and isinstance(value, dict):
            loc, value = ("engine", field.group(1)), value.get(field.group(1))
        option = ".".join(loc)
        env_name = "BATCHD_" + "__".join(part.upper() for part in loc)
        lines.append(f"  {option} (env {env_name}) = {redact(repr(value))}: {message}")
    if config_file is not None:
        lines.append(f"  (config file: {config_file})")
    return "\n".join(lines)


def default_consumer_name() -> str:
    """host:pid, unique per process on a host."""
    return f"{socket.gethostname()}:{os.getpid()}"
