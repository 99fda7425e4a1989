"""The service files: systemd units pass ``systemd-analyze verify``, the plist parses and
runs the right program; both restart a failed daemon and leave a clean stop alone."""

from __future__ import annotations

import configparser
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).resolve().parents[3] / "systemd"
UNITS = (
    "batchd.service",
    "batchd@.service",
    "batchd-bulk-worker.service",
    "batchd-gateway.service",
)
INSTALLED_BATCHD = "/opt/batchd/bin/batchd"


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(SYSTEMD / name)
    return parser


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    # verify checks that ExecStart exists: point it at this checkout's batchd.
    batchd = Path(sys.executable).parent / "batchd"
    for name in UNITS:
        text = (SYSTEMD / name).read_text().replace(INSTALLED_BATCHD, str(batchd))
        target = name.replace("@.", "@test.")  # a template is verified as an instance
        (tmp_path / target).write_text(text)
        if target != name:
            (tmp_path / name).write_text(text)
    names = [str(tmp_path / name.replace("@.", "@test.")) for name in UNITS]
    done = subprocess.run(
        [analyze, "verify", "--man=no", *names], capture_output=True, text=True, timeout=60
    )
    # Unknown keys and unparsable values are only warnings: no output at all is the pass.
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), (
        done.stdout + done.stderr
    )


@pytest.mark.parametrize("name", ["batchd.service", "batchd@.service"])
def test_daemon_units_are_supervised_and_confined(name: str) -> None:
    service = unit(name)["Service"]
    assert service["Type"] == "notify" and int(service["WatchdogSec"]) > 0
    assert service["ExecStart"].split()[:2] == [INSTALLED_BATCHD, "serve"]
    assert service["Restart"] == "on-failure" and service["RestartPreventExitStatus"] == "2"
    assert service["EnvironmentFile"].startswith("-/etc/batchd/")
    assert service["User"] == "batchd" and service["ProtectSystem"] == "strict"
    assert service["ProtectHome"] == "true" and service["NoNewPrivileges"] == "true"
    assert service["StateDirectory"] == "batchd" and service["CacheDirectory"] == "batchd"
    assert "WorkingDirectory" not in service  # every command works from any directory


def test_gateway_unit_is_supervised_and_confined_like_the_daemon() -> None:
    service = unit("batchd-gateway.service")["Service"]
    assert service["ExecStart"].split()[:2] == [INSTALLED_BATCHD, "gateway"]
    assert "--log-format json" in service["ExecStart"]
    assert service["Restart"] == "on-failure" and service["RestartPreventExitStatus"] == "2"
    assert service["User"] == "batchd" and service["StateDirectory"] == "batchd"
    daemon = unit("batchd.service")["Service"]
    hardening = [k for k in daemon if k.startswith(("Protect", "Restrict", "Private"))]
    hardening += ["NoNewPrivileges", "LockPersonality", "CapabilityBoundingSet", "UMask"]
    for key in hardening:
        assert service.get(key) == daemon[key], key
    # The keys come from a private environment file, never the unit or the command line.
    assert "api-key" not in service["ExecStart"]
    text = (SYSTEMD / "batchd-gateway.service").read_text()
    assert "EnvironmentFile=-/etc/batchd/gateway.env" in text
    assert "WorkingDirectory" not in service


def test_template_instances_read_their_own_settings() -> None:
    text = (SYSTEMD / "batchd@.service").read_text()
    assert "Environment=BATCHD_CONFIG=/etc/batchd/%i.toml" in text
    assert "EnvironmentFile=-/etc/batchd/%i.env" in text
    assert "Environment=BATCHD_DAEMON__CONSUMER_NAME=%H-%i" in text


def test_plist_runs_batchd_serve_and_restarts_only_on_failure() -> None:
    with open(SYSTEMD / "com.batchd.daemon.plist", "rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == "com.batchd.daemon"
    program = plist["ProgramArguments"]
    assert Path(program[0]).name == "batchd" and program[1] == "serve"
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ThrottleInterval"] >= 5 and plist["ExitTimeOut"] > 30
    assert plist["StandardErrorPath"] and plist["StandardOutPath"]
    assert plist["EnvironmentVariables"]["BATCHD_CONFIG"].endswith(".toml")
    assert "WorkingDirectory" not in plist
