"""The generated reference pages (docs/reference/) are what the code gives now, and the
code gives them something to say: every command line option and every setting has a
description.

When one of these fails after a change to a parser, a setting or the protocol, run
``python -m batchd.daemon.docs`` and commit the pages it writes.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from batchd.config.settings import Settings
from batchd.daemon.docs import __main__ as generator
from batchd.daemon.docs import cli_page, settings_page
from batchd.daemon.docs.markdown import cell, prose

# Arguments that had no help text when the reference was first generated, owned by the
# modules that define them (producers/commands, daemon/commands/model.py). The list may
# only shrink: a new argument without help fails, and so does an entry here that has
# gained its help (take it out) or no longer exists.
PENDING_HELP = {
    ("bulk", "IN.jsonl"),
    ("bulk", "--out"),
}


def test_the_generated_pages_are_current() -> None:
    stale = generator.stale_pages(generator.DEFAULT_OUT)
    assert not stale, f"out of date: {stale}; run python -m batchd.daemon.docs and commit"


def test_every_command_line_argument_has_help() -> None:
    arguments = {(a.command, a.names[0]): a for a in cli_page.every_argument()}
    missing = {key for key, a in arguments.items() if not a.help.strip()}
    assert not missing - PENDING_HELP, f"arguments without help: {sorted(missing - PENDING_HELP)}"
    fixed = PENDING_HELP - missing
    assert not fixed, f"these have help (or are gone) now: take them out of PENDING_HELP: {fixed}"


def test_every_command_has_a_description_and_a_section() -> None:
    parser = cli_page.build_parser()
    page = cli_page.render()
    for name, sub in cli_page.subcommands(parser).items():
        assert (sub.description or "").strip(), f"batchd {name} has no description"
        assert f"## batchd {name} {{#{name}}}" in page
    assert all(cli_page.summaries(parser).values())


def test_every_setting_has_a_description() -> None:
    for section in settings_page.sections():
        assert section.description.strip(), f"[{section.name}] has no description"
        for option in section.options:
            assert option.description.strip(), f"{option.name} has no docstring"


def test_the_configuration_page_lists_every_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's walk over the models finds exactly the options Settings has."""
    for name in [n for n in os.environ if n.startswith("BATCHD_")]:
        monkeypatch.delenv(name)
    defaults = Settings().model_dump(mode="json")
    listed = {o.path: o for s in settings_page.sections() for o in s.options}
    assert set(listed) == set(_flatten(defaults))
    for path, value in _flatten(defaults).items():
        assert listed[path].default == value, path
    assert listed[("engine", "max_num_seqs")].env == "BATCHD_ENGINE__MAX_NUM_SEQS"


def test_every_option_is_in_the_default_file() -> None:
    lines = settings_page.toml_lines(settings_page.DEFAULT_FILE.read_text())
    for section in settings_page.sections():
        for option in section.options:
            assert option.path in lines, f"{option.name} is not in config/batchd.toml"


def test_prose_escapes_markup_outside_code() -> None:
    assert prose("streams <prefix>:queue:<name>") == "streams &lt;prefix&gt;:queue:&lt;name&gt;"
    assert prose("see ``x<y>`` and :mod:`a.b`") == "see `x<y>` and `a.b`"
    assert prose("a\nb\n\nc") == "a b\n\nc"
    assert prose("2 * 3") == "2 \\* 3"


def test_cell_escapes_pipes_outside_code_only() -> None:
    assert cell("N|none or `a|b`") == "N&#124;none or `a|b`"


def _flatten(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    flat: dict[tuple[str, ...], Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and (not prefix or value):  # a section; else a mapping option
            flat.update(_flatten(value, (*prefix, key)))
        else:
            flat[(*prefix, key)] = value
    return flat
