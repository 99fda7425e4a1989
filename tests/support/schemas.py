"""Grammars the tests (and the measurements under tests/measure) share."""

from __future__ import annotations

import json
from typing import Any

from batchd.engine.constraints import Constraint

# Objects, arrays, enums, bounded numbers, required fields. multipleOf bounds the digits
# of a number, and maxLength every string, so a random-weight model's JSON always ends;
# 0.25 is exact in binary (jsonschema's float check refuses 0.59 as a multiple of 0.01).
NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {
            "type": "array",
            "items": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "scores", "address"],
    "additionalProperties": False,
}


def nested_constraint() -> Constraint:
    return Constraint("json_schema", json.dumps(NESTED_SCHEMA))


# JSON-schema keywords llguidance cannot enforce (refused unless lenient), each in a
# schema it then accepts with the keyword ignored (a oneOf held as an anyOf).
LENIENT_ONLY: dict[str, dict[str, Any]] = {
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "if": {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "if": {"properties": {"a": {"const": 1}}},
        "then": {"required": ["a"]},
    },
    "not": {"type": "integer", "not": {"const": 3}},
    "contains": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 2}},
    "dependentRequired": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "dependentRequired": {"a": ["b"]},
    },
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
}
