"""docs/reference/protocol.md: the wire protocol, rendered from its JSON Schema.

``producers/protocol.schema.json`` (what ``batchd schema`` prints, checked against the
models by the producers' tests) is the one source: its key names become a table, and
each model (JobRequest, Event, JobStatus, DaemonHeartbeat and the models they hold) a
table of fields with type, default, bounds and meaning. The schema file itself is
published next to the page, for services in other languages to validate against.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import batchd.producers
from batchd.daemon.docs.markdown import cell, code, generated_note, prose, table

SCHEMA_FILE = Path(batchd.producers.__file__).with_name("protocol.schema.json")
SOURCE = "`producers/protocol.schema.json` (`batchd schema`)"
_BOUNDS = {
    "minimum": "≥ {}",
    "exclusiveMinimum": "> {}",
    "maximum": "≤ {}",
    "exclusiveMaximum": "< {}",
    "minLength": "at least {} characters",
    "maxLength": "at most {} characters",
    "minItems": "at least {} items",
    "maxItems": "at most {} items",
    "maxProperties": "at most {} entries",
    "pattern": "matches `{}`",
}


def load() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(SCHEMA_FILE.read_text())
    return schema


def models(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """NAME -> definition of every model the protocol names, top-level ones first."""
    found: dict[str, dict[str, Any]] = {}
    nested: dict[str, dict[str, Any]] = {}
    for name, definition in schema["$defs"].items():
        found[name] = definition
        nested.update(definition.get("$defs", {}))
    return found | {n: d for n, d in nested.items() if n not in found}


def render() -> str:
    """The whole page."""
    schema = load()
    lines = [
        generated_note(SOURCE),
        "",
        "# Wire protocol reference",
        "",
        "Every key, field and bound of the protocol that producers and daemons speak, from "
        "its JSON Schema: [`protocol.schema.json`](protocol.schema.json) (what `batchd "
        "schema` prints). How to use it, with examples, is in [Producers and the wire "
        "protocol](../producers.md).",
        "",
        prose(schema.get("description", "")),
        "",
        "## Keys {#keys}",
        "",
        "With the default key prefix `batchd` (the `key_prefix` setting).",
        "",
    ]
    rows = [(code(name), code(value)) for name, value in schema.get("keys", {}).items()]
    lines += table(["Name", "Key or value"], rows)
    for name, definition in models(schema).items():
        lines += ["", *_model_section(name, definition)]
    return "\n".join(lines).rstrip() + "\n"


def _model_section(name: str, definition: dict[str, Any]) -> list[str]:
    lines = [f"## {name} {{#{name}}}", ""]
    if definition.get("description"):
        lines += [prose(definition["description"]), ""]
    if "enum" in definition:
        return lines + ["One of " + ", ".join(code(v) for v in definition["enum"]) + "."]
    closed = definition.get("additionalProperties") is False
    lines += [
        "A JSON object" + ("; unknown fields are refused." if closed else "."),
        "",
    ]
    required = set(definition.get("required", ()))
    rows = []
    for field, spec in definition.get("properties", {}).items():
        default = "required" if field in required else _default(spec)
        rows.append(
            (
                code(field),
                cell(type_of(spec)),
                default,
                cell(", ".join(bounds(spec))),
                cell(spec.get("description", "")),
            )
        )
    return lines + table(["Field", "Type", "Default", "Bounds", "Meaning"], rows)


def type_of(spec: dict[str, Any]) -> str:
    """A property's type in words, models linked to their section."""
    if "$ref" in spec:
        target = spec["$ref"].rsplit("/", 1)[-1]
        return f"[{target}](#{target})"
    if "anyOf" in spec:
        kinds = [type_of(s) for s in spec["anyOf"] if s.get("type") != "null"]
        nullable = any(s.get("type") == "null" for s in spec["anyOf"])
        return " or ".join(kinds) + (" or null" if nullable else "")
    if "enum" in spec:
        return " or ".join(code(json.dumps(v)) for v in spec["enum"])
    kind = spec.get("type", "any")
    if kind == "array":
        if "prefixItems" in spec:
            return "[" + ", ".join(type_of(s) for s in spec["prefixItems"]) + "]"
        return f"array of {type_of(spec.get('items', {}))}"
    if kind == "object" and isinstance(spec.get("additionalProperties"), dict):
        return f"object of {type_of(spec['additionalProperties'])}"
    return str(kind)


def bounds(spec: dict[str, Any]) -> Iterator[str]:
    """A property's bounds in words (those of its items and alternatives too)."""
    for key, template in _BOUNDS.items():
        if key in spec:
            text = template.format(spec[key])
            yield text[:-1] if spec[key] == 1 and text.endswith("s") else text
    for alternative in spec.get("anyOf", ()):
        yield from bounds(alternative)
    if isinstance(spec.get("items"), dict):
        yield from (f"each {b}" for b in bounds(spec["items"]))


def _default(spec: dict[str, Any]) -> str:
    if "default" not in spec:
        return ""
    return code(json.dumps(spec["default"]))
