"""config/batchd.toml documents every option once, with its real default.

The options are defined in code (Settings and the engine's EngineConfig); the
file is the reader's copy. This test keeps the two from drifting: every option
appears in the file (commented out when it has no default), every value shown
is the default, and the file names nothing the code does not know.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from batchd.config.settings import Settings, load_settings

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

DOC_FILE = Path(__file__).resolve().parents[2] / "config" / "batchd.toml"
SECTION = re.compile(r"^\[(\w+)\]$")
COMMENTED_OPTION = re.compile(r"^#\s*(\w+)\s*=")


@pytest.fixture
def defaults(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    for name in [n for n in os.environ if n.startswith("BATCHD_")]:
        monkeypatch.delenv(name)
    return Settings().model_dump(mode="json")


def commented_options(text: str) -> set[tuple[str, ...]]:
    """Options shown as ``# name = example`` (no default), with their section."""
    found: set[tuple[str, ...]] = set()
    section: tuple[str, ...] = ()
    for line in text.splitlines():
        if match := SECTION.match(line.strip()):
            section = (match.group(1),)
        elif match := COMMENTED_OPTION.match(line.strip()):
            found.add((*section, match.group(1)))
    return found


def flatten(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    flat: dict[tuple[str, ...], Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:  # an empty table is an option's value ({})
            flat.update(flatten(value, (*prefix, key)))
        else:
            flat[(*prefix, key)] = value
    return flat


def test_every_option_is_documented_with_its_default(defaults: dict[str, Any]) -> None:
    text = DOC_FILE.read_text()
    shown = flatten(tomllib.loads(text))
    commented = commented_options(text)
    for option, default in flatten(defaults).items():
        name = ".".join(option)
        if default is None:
            assert option in commented, f"{name} (no default) is not shown commented out"
        else:
            assert option in shown, f"{name} is not in {DOC_FILE.name}"
            assert shown[option] == default, (
                f"{name}: file says {shown[option]!r}, code {default!r}"
            )


def test_the_file_names_only_known_options(defaults: dict[str, Any]) -> None:
    known = set(flatten(defaults))
    unknown = (
        set(flatten(tomllib.loads(DOC_FILE.read_text()))) | commented_options(DOC_FILE.read_text())
    ) - known
    assert not unknown, unknown
    assert load_settings(DOC_FILE).model_dump(mode="json") == defaults


def test_commented_options_are_recognised() -> None:
    text = 'a = 1\n# b = 2\n[engine]\n# dtype = "float32"\n# a plain comment\n'
    assert commented_options(text) == {("b",), ("engine", "dtype")}
