"""What a constrained request asks for, compiled once to an llguidance grammar.

A `Constraint` that exists is valid: its grammar is compiled and checked when
it is made (about a millisecond for a nested JSON schema), so a bad schema or
regex fails the request at intake with llguidance's message, never at a step.
JSON is compact (no free whitespace between tokens): a model that is not sure
what to say cannot pad its output with spaces until max_tokens.

``lenient`` (JSON schemas only, opt-in) is llguidance's lenient mode: keywords it cannot
enforce (``uniqueItems``, ``if``/``then``/``else``, ``not``, ``contains``,
``dependentRequired``...) are accepted and ignored, and a ``oneOf`` is held as an
``anyOf``. The output then keeps to the schema without them: an array may repeat an
item, a value may match two ``oneOf`` branches. Without it such a schema is refused,
naming the keywords and the option.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import llguidance

from batchd.engine.exceptions import InvalidRequest

if TYPE_CHECKING:  # a TypedDict of the type stubs only
    from llguidance._lib import JsonCompileOptions

# kind -> what `source` holds
CONSTRAINT_KINDS = {
    "json_schema": "a JSON schema, as JSON text",
    "json_object": "nothing (any JSON object)",
    "regex": "a regular expression (Rust regex syntax)",
    "lark": "a Lark grammar (llguidance's dialect)",
    "gbnf": "a GBNF grammar (llama.cpp's)",
}
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
_LENIENT_OPTIONS: JsonCompileOptions = {**_JSON_OPTIONS, "lenient": True, "coerce_one_of": True}
# A strict refusal that lenient would accept says so.
LENIENT_HINT = "(set lenient to accept it with those keywords unenforced)"


@dataclass(frozen=True)
class Constraint:
    """One request's output grammar. Raises InvalidRequest naming the problem if invalid."""

    kind: str
    source: str = ""
    lenient: bool = False
    grammar: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequest(
                f"constraint kind must be one of {sorted(CONSTRAINT_KINDS)}, got {self.kind!r}"
            )
        if self.lenient and self.kind != "json_schema":
            raise InvalidRequest(f"lenient applies to json_schema constraints, not {self.kind}")
        try:
            grammar = _compile(self.kind, self.source, lenient=self.lenient)
        except ValueError as exc:
            raise InvalidRequest(f"invalid {self.kind} constraint: {exc}") from exc
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            hint = f" {LENIENT_HINT}" if self._lenient_would_accept() else ""
            raise InvalidRequest(f"invalid {self.kind} constraint: {error.strip()}{hint}")
        object.__setattr__(self, "grammar", grammar)

    def _lenient_would_accept(self) -> bool:
        if self.lenient or self.kind != "json_schema":
            return False
        try:
            grammar = _compile(self.kind, self.source, lenient=True)
        except ValueError:
            return False
        return not llguidance.LLMatcher.validate_grammar(grammar)


def _compile(kind: str, source: str, *, lenient: bool) -> str:
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schema is not JSON: {exc}") from exc
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, _LENIENT_OPTIONS if lenient else _JSON_OPTIONS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    return llguidance.grammar_from(kind, source)  # type: ignore[arg-type]
