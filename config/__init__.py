"""batchd configuration: the Settings object and its documented defaults."""

from config.settings import (
    DEFAULT_REDIS_URL,
    NAME_PATTERN,
    DaemonSettings,
    LimitSettings,
    Settings,
    SettingsError,
    default_consumer_name,
    load_settings,
)

__all__ = [
    "DEFAULT_REDIS_URL",
    "NAME_PATTERN",
    "DaemonSettings",
    "LimitSettings",
    "Settings",
    "SettingsError",
    "default_consumer_name",
    "load_settings",
]
