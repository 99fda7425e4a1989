"""Structured output: grammars (JSON schema, regex, Lark, GBNF) that mask each row's logits."""

from batchd.engine.constraints.grammar import CONSTRAINT_KINDS, Constraint
from batchd.engine.constraints.matcher import GrammarTokenizer, RowMatcher

__all__ = ["CONSTRAINT_KINDS", "Constraint", "GrammarTokenizer", "RowMatcher"]
