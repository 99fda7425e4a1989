"""Where the producers' services keep their state (the gateway's uploaded and result files).

1. ``$BATCHD_HOME`` when set (everything batchd keeps goes under it; the engine's cache,
   :mod:`batchd.engine.cache`, follows the same rule);
2. ``$STATE_DIRECTORY`` when systemd runs the service with ``StateDirectory=batchd``;
3. the platform's data directory (platformdirs): ``~/.local/share/batchd`` on Linux,
   ``~/Library/Application Support/batchd`` on macOS.

Never the working directory: a service started elsewhere must find its files again.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

HOME_ENV = "BATCHD_HOME"
SYSTEMD_STATE_ENV = "STATE_DIRECTORY"


def state_home() -> Path:
    """The folder batchd's state goes under (not created here)."""
    home = os.environ.get(HOME_ENV)
    if home:
        return Path(home).expanduser().absolute()
    systemd = os.environ.get(SYSTEMD_STATE_ENV)
    if systemd:
        return Path(systemd.split(":")[0])
    return platformdirs.user_data_path("batchd")


def gateway_files() -> Path:
    """The gateway's Files API folder (``<state home>/gateway-files``)."""
    return state_home() / "gateway-files"
