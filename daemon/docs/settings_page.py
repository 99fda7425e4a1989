"""docs/reference/configuration.md: every option of Settings, with default, environment
variable, its line in config/batchd.toml and its meaning (the attribute's docstring).

The options come from the models themselves: pydantic sections (their fields'
descriptions are the attribute docstrings, ``use_attribute_docstrings``) and the
engine's plain dataclass (its attribute docstrings read from the source), so an
option added in code shows up here, and one without a docstring is found by tests/docs.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

import batchd.config
from batchd.config.settings import Settings
from batchd.daemon.docs.markdown import cell, code, generated_note, prose, table

DEFAULT_FILE = Path(batchd.config.__file__).with_name("batchd.toml")
SOURCE = "`batchd.config.settings.Settings` and `config/batchd.toml`"
ENV_PREFIX = "BATCHD_"
UNSET = object()  # an option with no default value
# What a table is for, where its class's docstring speaks to programmers instead.
SECTION_INTROS = {
    "engine": "The daemon's engine: its batch, its step budget and its KV-cache pool. The "
    "same options, as `batchd.engine.EngineConfig`, configure the engine used as a library.",
}


@dataclass(frozen=True)
class Option:
    """One option: its path (``("engine", "max_num_seqs")``) and what the page says."""

    path: tuple[str, ...]
    type: str
    default: Any  # UNSET, None (unset by default) or the value
    rules: tuple[str, ...]
    description: str

    @property
    def name(self) -> str:
        return ".".join(self.path)

    @property
    def env(self) -> str:
        return ENV_PREFIX + "__".join(part.upper() for part in self.path)


@dataclass(frozen=True)
class Section:
    """A table of options (``[engine]``), or the top level (name "")."""

    name: str
    description: str
    options: tuple[Option, ...]


def sections() -> list[Section]:
    """The top-level options, then each table, in the order Settings defines them."""
    top: list[Option] = []
    tables: list[Section] = []
    for name, (annotation, info) in _fields(Settings).items():
        if _is_section(annotation):
            doc = SECTION_INTROS.get(name) or inspect.cleandoc(annotation.__doc__ or "")
            options = tuple(_options(annotation, (name,)))
            tables.append(Section(name, doc, options))
        else:
            top.append(_option((name,), annotation, info))
    return [Section("", "Options outside any table.", tuple(top)), *tables]


def render() -> str:
    """The whole page."""
    every = sections()
    file_lines = toml_lines(DEFAULT_FILE.read_text())
    lines = [
        generated_note(SOURCE),
        "",
        "# Configuration reference",
        "",
        "Every option of batchd, with its default, its environment variable and its line in "
        "the documented default file, `config/batchd.toml` (shown whole at the end). "
        "Precedence, highest first:",
        "",
        "1. `BATCHD_*` environment variables; an option in a table is named with a double "
        "underscore, e.g. `BATCHD_ENGINE__MAX_NUM_SEQS=64`;",
        "2. a TOML file given with `batchd --config FILE ...` or `BATCHD_CONFIG=FILE`;",
        "3. the defaults below.",
        "",
        "Command-line flags (`--redis-url`, `batchd serve --queue`, ...) override all three "
        "for that command; see the [command line reference](cli.md). An invalid value stops "
        "a command at start with a message naming the option, its environment variable and "
        "the value. A list in an environment variable is written as JSON: "
        '`BATCHD_QUEUES=\'["default", "batch"]\'`.',
        "",
        "## All options",
        "",
    ]
    rows = [
        (f"[{code(o.name)}](#{o.name})", _default_cell(o), code(o.env))
        for section in every
        for o in section.options
    ]
    lines += table(["Option", "Default", "Environment variable"], rows)
    for section in every:
        title = f"[{section.name}]" if section.name else "Top level"
        anchor = section.name or "top-level"
        lines += ["", f"## {title} {{#{anchor}}}", "", prose(section.description)]
        for option in section.options:
            lines += ["", *_option_block(option, file_lines)]
    lines += [
        "",
        "## The default file {#default-file}",
        "",
        "`config/batchd.toml`, installed with the package as `batchd/config/batchd.toml`: "
        "copy it, uncomment and change what you need.",
        "",
        "```toml",
        DEFAULT_FILE.read_text().rstrip(),
        "```",
    ]
    return "\n".join(lines).rstrip() + "\n"


def toml_lines(text: str) -> dict[tuple[str, ...], str]:
    """Option path -> its line in the default file (``# name = ...`` when commented out)."""
    found: dict[tuple[str, ...], str] = {}
    table_: tuple[str, ...] = ()
    for line in text.splitlines():
        stripped = line.strip()
        if match := re.fullmatch(r"\[(\w+)\]", stripped):
            table_ = (match.group(1),)
        elif match := re.match(r"#?\s*(\w+)\s*=", stripped):
            found.setdefault((*table_, match.group(1)), stripped)
    return found


def _option_block(option: Option, file_lines: dict[tuple[str, ...], str]) -> list[str]:
    lines = [f"### {option.name} {{#{option.name}}}", "", prose(option.description), ""]
    kind = option.type + (", " + ", ".join(option.rules) if option.rules else "")
    lines += [f"- Type: {cell(kind)}", f"- Default: {_default_cell(option)}"]
    lines.append(f"- Environment: {code(option.env)}")
    in_file = file_lines.get(option.path)
    if in_file is None:
        raise LookupError(f"{option.name} is not in {DEFAULT_FILE.name}: document it there")
    where = f"{code('[' + option.path[0] + ']')} " if len(option.path) > 1 else ""
    note = " (commented out: unset by default)" if in_file.startswith("#") else ""
    lines.append(f"- In `batchd.toml`: {where}{code(in_file)}{note}")
    return lines


def _default_cell(option: Option) -> str:
    if option.default is None:
        return "unset"
    return code(json.dumps(option.default))


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and (
        issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)
    )


def _options(model: type, prefix: tuple[str, ...]) -> Iterator[Option]:
    for name, (annotation, info) in _fields(model).items():
        yield _option((*prefix, name), annotation, info)


def _fields(model: type) -> dict[str, tuple[Any, FieldInfo | dataclasses.Field[Any]]]:
    """NAME -> (resolved type, field) of a pydantic model or a dataclass, in order."""
    if issubclass(model, BaseModel):
        return {n: (f.annotation, f) for n, f in model.model_fields.items()}
    hints = typing.get_type_hints(model)
    fields = dataclasses.fields(typing.cast(Any, model))
    return {f.name: (hints[f.name], f) for f in fields}


def _option(path: tuple[str, ...], annotation: Any, info: Any) -> Option:
    if isinstance(info, FieldInfo):
        default = info.get_default(call_default_factory=True)
        description = info.description or ""
        rules = tuple(_rules(info.metadata, annotation))
    else:
        default = info.default
        if default is dataclasses.MISSING and info.default_factory is not dataclasses.MISSING:
            default = info.default_factory()
        owner = _dataclass_owning(path)
        description = attribute_docstrings(owner).get(path[-1], "")
        rules = ()
    if default is dataclasses.MISSING:
        default = UNSET
    if isinstance(default, Path):
        default = str(default)
    return Option(path, type_name(annotation), default, rules, description)


def _dataclass_owning(path: tuple[str, ...]) -> type:
    annotation, _ = _fields(Settings)[path[0]]
    return typing.cast(type, annotation)


def attribute_docstrings(cls: type) -> dict[str, str]:
    """NAME -> the docstring under each annotated attribute of ``cls`` (its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = typing.cast(ast.ClassDef, tree.body[0]).body
    found: dict[str, str] = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[node.target.id] = inspect.cleandoc(after.value.value)
    return found


def type_name(annotation: Any) -> str:
    """A type as a reader of the TOML file thinks of it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" (optional)" if type(None) in args else "")
    if origin is typing.Literal:
        return " or ".join(json.dumps(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}s"
    names = {int: "integer", float: "number", str: "string", bool: "boolean", Path: "path"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _rules(metadata: list[Any], annotation: Any) -> Iterator[str]:
    """Bounds of a field (pydantic's metadata: Gt, Ge, Le, MinLen, ...) in words."""
    words = {"gt": "> {}", "ge": "≥ {}", "lt": "< {}", "le": "≤ {}"}
    for item in metadata:
        for attr, template in words.items():
            if getattr(item, attr, None) is not None:
                yield template.format(getattr(item, attr))
        if getattr(item, "min_length", None):
            unit = "character" if annotation is str else "item"
            yield f"at least {item.min_length} {unit}{'' if item.min_length == 1 else 's'}"
    for arg in typing.get_args(annotation):
        for item in getattr(arg, "__metadata__", ()):
            if getattr(item, "pattern", None):
                yield f"each matching {code(item.pattern)}"
