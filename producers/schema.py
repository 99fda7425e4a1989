"""The wire protocol: the single source of truth for jobs, events and status.

Services in any language produce jobs by following the JSON Schema exported
from these models (``batchd schema``; committed as
``producers/protocol.schema.json``). Key names live in :mod:`batchd.producers.keys`.

A job is ``XADD batchd:queue:<queue> * job <JobRequest JSON>``. Each token is
an entry ``event <Event JSON>`` with id ``0-<seq+1>`` on
``batchd:job:<id>:events`` and the same JSON PUBLISHed on
``batchd:job:<id>:tokens``. The last event carries ``finish_reason``, the full
``text``, ``usage`` and ``timings``. ``batchd:job:<id>`` is the status hash.
A job with ``n`` > 1 generates n sequences: its token events carry ``index``
(0 to n-1, interleaved in one seq order) and its final event ``choices``.

Submitting: the producer creates the status hash (``state`` queued, ``queue``,
``queued_at``) only if it does not exist yet, atomically with the XADD (one
script, as batchd.producers.transact does, or WATCH + MULTI); a job id seen before is
not enqueued again.
Cancelling: ``HSET batchd:job:<id> cancel_requested 1`` (the truth, checked by
the daemon at pickup), then ``XADD batchd:cancel MAXLEN ~ 10000 * id <id>`` to
tell running daemons. A job ends with its final event, written before its
status hash turns terminal.
"""

from __future__ import annotations

import hashlib
import math
import time
import uuid
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any, Literal

import llguidance
import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic import ValidationError as PydanticValidationError

from batchd.config.limits import NAME_PATTERN, LimitSettings
from batchd.producers.errors import TooComplex, ValidationError

if TYPE_CHECKING:  # a TypedDict of the type stubs only
    from llguidance._lib import JsonCompileOptions

JOB_ID_PATTERN = NAME_PATTERN
INT64_MAX = 2**63 - 1
TOKEN_ID_MAX = 2**31 - 1
PRIORITY_BOUND = 1_000_000_000
MAX_METADATA_BYTES = 16_384
MAX_METADATA_DEPTH = 32

TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
StopString = Annotated[str, Field(max_length=1024)]


class JobState(str, Enum):
    """``state`` field of the status hash."""

    queued = "queued"
    running = "running"
    finished = "finished"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"

    @property
    def terminal(self) -> bool:
        return self not in (JobState.queued, JobState.running)


class FinishReason(str, Enum):
    """``finish_reason`` of a final event."""

    stop = "stop"
    length = "length"
    cancelled = "cancelled"
    error = "error"
    expired = "expired"


FINAL_STATE = {
    FinishReason.stop: JobState.finished,
    FinishReason.length: JobState.finished,
    FinishReason.cancelled: JobState.cancelled,
    FinishReason.error: JobState.failed,
    FinishReason.expired: JobState.expired,
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _StrictTypes(BaseModel):
    # Producers in other languages must send the right JSON types: no "10" for 10,
    # no true for 1; and no NaN or Infinity, which no later step could encode or compare.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Message(_StrictTypes):
    """One chat message."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str


MAX_TOOLS = 128
MAX_TOOLS_BYTES = 262_144


class ToolFunction(_StrictTypes):
    """A function the model may call (OpenAI's ``tools[].function``)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="The JSON schema of its arguments (an object)."
    )

    @model_validator(mode="before")
    @classmethod
    def _bounded_parameters(cls, data: Any) -> Any:
        return _bounded_schema_in(data, "parameters", where="tools.function.parameters")


class Tool(_StrictTypes):
    """A tool shown to the model: the chat template renders it where it reads ``tools``,
    else it is described in the system message (docs/jobs.md: Tools)."""

    type: Literal["function"]
    function: ToolFunction


MAX_SEQUENCES = 16
MAX_GRAMMAR_CHARS = 65536
# A json_schema is walked (without recursion) against these before anything else reads it:
# orjson, llguidance and pydantic each have a recursion limit of their own, and hitting
# one is a TypeError or a crash, not a refusal naming the field.
MAX_SCHEMA_DEPTH = 64
MAX_SCHEMA_NODES = 20_000
MAX_LOGIT_BIAS_ENTRIES = 300
# response_format type -> the field that holds its source
_GRAMMAR_FIELD = {
    "json_schema": "json_schema",
    "regex": "regex",
    "lark": "grammar",
    "gbnf": "grammar",
}


# llguidance's lenient JSON-schema mode (ResponseFormat.lenient): unenforceable keywords
# accepted and ignored, oneOf held as anyOf; the engine compiles with the same options.
_LENIENT: JsonCompileOptions = {"lenient": True, "coerce_one_of": True}


def _is_token_id(text: str) -> bool:
    """A token id as a decimal string, as OpenAI's logit_bias keys are."""
    return text.isascii() and text.isdigit() and len(text) <= 10 and int(text) <= TOKEN_ID_MAX


class ResponseFormat(_StrictTypes):
    """Structured output: the job's text is held to a grammar (docs/jobs.md: Structured output).

    ``json_object`` (any JSON object, no other field), ``json_schema`` (the schema in
    ``json_schema``), ``regex`` (Rust regex syntax, in ``regex``), ``lark`` or ``gbnf``
    (the grammar in ``grammar``). Checked here, so a bad one is refused at submit.
    ``lenient`` (json_schema only) accepts keywords the grammar cannot enforce
    (``uniqueItems``, ``if``/``then``, ``not``, ``contains``, ``dependentRequired``...)
    and ignores them, and holds a ``oneOf`` as an ``anyOf``.
    """

    type: Literal["json_object", "json_schema", "regex", "lark", "gbnf"]
    json_schema: dict[str, Any] | None = Field(
        None, description="The JSON schema (type json_schema)."
    )
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS, description="Type regex.")
    grammar: str | None = Field(
        None, max_length=MAX_GRAMMAR_CHARS, description="A Lark or GBNF grammar (types lark, gbnf)."
    )
    lenient: bool = Field(
        False,
        description="Type json_schema: accept keywords the grammar cannot enforce (uniqueItems, "
        "if/then/else, not, contains, dependentRequired...) and ignore them; oneOf is held as "
        "anyOf. Without it such a schema is refused.",
    )

    @model_validator(mode="before")
    @classmethod
    def _bounded_schema(cls, data: Any) -> Any:
        return _bounded_schema_in(data, "json_schema", where="response_format.json_schema")

    @model_validator(mode="after")
    def _one_valid_grammar(self) -> ResponseFormat:
        needed = _GRAMMAR_FIELD.get(self.type)
        given = [f for f in ("json_schema", "regex", "grammar") if getattr(self, f) is not None]
        if given != ([needed] if needed else []):
            takes = needed or "no other field"
            raise ValueError(f"type {self.type} takes {takes}, got {', '.join(given) or 'none'}")
        if self.lenient and self.type != "json_schema":
            raise ValueError(f"lenient applies to type json_schema, not {self.type}")
        source = self.source()
        if len(source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{len(source)} characters exceed the limit {MAX_GRAMMAR_CHARS}")
        problem = self._grammar_problem(source, lenient=self.lenient)
        if problem:
            if not self.lenient and self.type == "json_schema":
                if not self._grammar_problem(source, lenient=True):
                    problem += " (lenient: true accepts it with those keywords unenforced)"
            raise ValueError(f"invalid {self.type}: {problem}")
        return self

    def _grammar_problem(self, source: str, *, lenient: bool) -> str | None:
        try:
            if lenient and self.json_schema is not None:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(self.json_schema, _LENIENT)
            else:
                kind = "json_schema" if self.type == "json_object" else self.type
                grammar = llguidance.grammar_from(kind, source)
            return llguidance.LLMatcher.validate_grammar(grammar).strip() or None
        except ValueError as exc:
            return str(exc).strip()

    def source(self) -> str:
        """The grammar's text: the schema as JSON, the regex or the grammar."""
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.json_schema is not None:
            return orjson.dumps(self.json_schema).decode()
        return self.regex if self.regex is not None else self.grammar or ""


class JobRequest(_StrictTypes):
    """A generation job as it travels on the queue stream.

    Exactly one of ``prompt``, ``messages``, ``prompt_token_ids``. Limits
    (prompt size, max_tokens cap, message count) come from the daemon's
    Settings and are checked by :func:`parse_job`.
    """

    id: str | None = Field(
        None, pattern=JOB_ID_PATTERN, description="Job id; the client makes a UUID if absent."
    )
    prompt: str | None = Field(None, description="Prompt text (no chat template applied).")
    messages: list[Message] | None = Field(
        None, min_length=1, description="Chat messages; the model's chat template is applied."
    )
    prompt_token_ids: list[TokenId] | None = Field(
        None, min_length=1, description="Prompt as token ids of the model's tokenizer."
    )
    tools: list[Tool] | None = Field(
        None,
        min_length=1,
        max_length=MAX_TOOLS,
        description="Functions the model may call (with messages only): given to the chat "
        "template where it renders tools, else described in the system message (Hermes "
        "format). The calls come back as text; the gateway reads them.",
    )
    max_tokens: int = Field(256, ge=1, le=1_000_000, description="Most tokens to generate.")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=TOKEN_ID_MAX, description="0 disables top-k.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    seed: int | None = Field(
        None,
        ge=0,
        le=INT64_MAX,
        description="Makes sampling reproducible, also across daemon restarts; when absent, "
        "job_seed(id) is used (every job samples as if seeded).",
    )
    stop: list[StopString] = Field(
        default_factory=list, max_length=16, description="Stop strings (not emitted)."
    )
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    logprobs: int = Field(0, ge=0, le=20, description="Top-N logprobs per token (0: only none).")
    prompt_logprobs: bool = Field(
        False,
        description="Return each prompt token's logprob given the ones before it (in the "
        "first token event); the prompt is then computed whole, not taken from the prefix cache.",
    )
    n: int = Field(
        1,
        ge=1,
        le=MAX_SEQUENCES,
        description="Sequences generated from the prompt (its KV computed once); sequence i "
        "samples with sequence_seed(seed, i); n x max_tokens is held to the max_tokens cap.",
    )
    adapter: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="A LoRA adapter the daemon serves (its engine.adapters setting) to run "
        "the job with; absent: the base model. One the daemon does not serve fails the job.",
    )
    # Structured output and the controls around it (docs/jobs.md: Sampling, Structured
    # output); bounds as OpenAI's.
    presence_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Subtracted once from the logit of each token generated so far (OpenAI's; "
        "the prompt is not counted), or of the last penalty_window tokens.",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Subtracted from a token's logit per time it was generated so far "
        "(OpenAI's), or per occurrence in the last penalty_window tokens.",
    )
    penalty_window: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Absent: the penalties count the whole output (presence, frequency: "
        "generated tokens only, as OpenAI and vLLM; repetition: prompt and output, as vLLM). "
        "N: mlx-lm's form, all three over the last N tokens of prompt + output (mlx-lm's "
        "default N is 20).",
    )
    sampling_order: Literal["temperature_first", "filters_first"] = Field(
        "temperature_first",
        description="temperature_first (vLLM's): top_k, top_p, min_p filter the "
        "distribution after temperature; filters_first (mlx-lm's, llama.cpp's): they "
        "filter the temperature-1 distribution and temperature applies to what is left.",
    )
    logit_bias: dict[str, float] = Field(
        default_factory=dict,
        max_length=MAX_LOGIT_BIAS_ENTRIES,
        description="Token id (decimal string) -> bias in [-100, 100] added to its logit.",
    )
    min_tokens: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="No end token and no stop string ends the job before this many outputs "
        "(vLLM's); a stop string met earlier stays in the text.",
    )
    skip_special_tokens: bool = Field(
        True, description="Leave special tokens (chat markers, end tokens) out of the text."
    )
    spaces_between_special_tokens: bool = Field(
        True,
        description="Special tokens kept in the text are set apart from their neighbours by a "
        "space (vLLM's default); false: as the tokenizer decodes them.",
    )
    token_texts: bool = Field(
        False,
        description="Token events carry token_texts: the text of each token id they name (the "
        "token, its top_logprobs, the prompt's with prompt_logprobs), decoded alone.",
    )
    speculative: bool | None = Field(
        None,
        description="Speculative decoding (n-gram prompt lookup) for this job: true opts in, "
        "false out, null follows the daemon's engine option. The output is the same either "
        "way; it comes faster where it copies the prompt (extraction, editing).",
    )
    response_format: ResponseFormat | None = Field(
        None, description="Hold the output to a JSON schema, any JSON object, a regex or a grammar."
    )
    priority: int = Field(
        0,
        ge=-PRIORITY_BOUND,
        le=PRIORITY_BOUND,
        description="Higher runs first; waiting jobs age upwards.",
    )
    ttl_s: float | None = Field(
        None,
        gt=0,
        le=1e9,
        description="Expire the job if not started this many seconds after enqueue.",
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description=f"Free-form JSON echoed back in the final event: at most "
        f"{MAX_METADATA_BYTES} bytes encoded, {MAX_METADATA_DEPTH} levels deep, integers "
        "within 64 bits, finite numbers.",
    )

    @field_validator("metadata")
    @classmethod
    def _encodable_metadata(cls, value: dict[str, Any]) -> dict[str, Any]:
        _check_json_value(value, depth=1)
        try:
            size = len(orjson.dumps(value))
        except orjson.JSONEncodeError as exc:
            raise ValueError(f"cannot be encoded: {exc}") from None
        if size > MAX_METADATA_BYTES:
            raise ValueError(f"{size} bytes encoded exceed the limit {MAX_METADATA_BYTES}")
        return value

    @model_validator(mode="after")
    def _one_prompt_within_limits(self, info: ValidationInfo) -> JobRequest:
        given = [
            name
            for name in ("prompt", "messages", "prompt_token_ids")
            if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "exactly one of prompt, messages, prompt_token_ids is required"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if any(not s for s in self.stop):
            raise _FieldError("stop", "stop strings must not be empty")
        if self.tools is not None:
            if self.messages is None:
                raise _FieldError("tools", "tools apply to messages only")
            size = len(orjson.dumps([t.model_dump(exclude_none=True) for t in self.tools]))
            if size > MAX_TOOLS_BYTES:
                raise _FieldError(
                    "tools", f"{size} bytes encoded exceed the limit {MAX_TOOLS_BYTES}"
                )
        for token, bias in self.logit_bias.items():
            if not _is_token_id(token) or not -100.0 <= bias <= 100.0:
                raise _FieldError(
                    "logit_bias", f"{token!r}: {bias} is not a token id -> bias in [-100, 100]"
                )
        limits = (info.context or {}).get("limits")
        if isinstance(limits, LimitSettings):
            _check_limits(self, limits)
        return self

    @property
    def prompt_kind(self) -> str:
        if self.prompt is not None:
            return "prompt"
        return "messages" if self.messages is not None else "prompt_token_ids"

    def sampling(self) -> dict[str, Any]:
        """The SamplingParams fields of this job, as keyword arguments (the constraint is
        built from ``response_format`` by the daemon)."""
        return self.model_dump(
            include={
                "max_tokens",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "repetition_penalty",
                "seed",
                "stop",
                "stop_token_ids",
                "ignore_eos",
                "logprobs",
                "presence_penalty",
                "frequency_penalty",
                "min_tokens",
                "prompt_logprobs",
                "penalty_window",
                "sampling_order",
                "skip_special_tokens",
                "spaces_between_special_tokens",
                "token_texts",
                "speculative",
            }
        ) | {"logit_bias": tuple((int(t), b) for t, b in self.logit_bias.items())}


def _check_json_value(value: Any, *, depth: int) -> None:
    """Refuse what the final event could not carry: NaN/Infinity, integers beyond 64
    bits (orjson and most JSON readers cannot), nesting deeper than the limit."""
    if depth > MAX_METADATA_DEPTH:
        raise ValueError(f"nested deeper than {MAX_METADATA_DEPTH} levels")
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, int):
        if not -(2**63) <= value <= 2**64 - 1:
            raise ValueError(f"integer {value} is outside the 64-bit range")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"number {value} is not finite")
    elif isinstance(value, dict):
        for item in value.values():
            _check_json_value(item, depth=depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_json_value(item, depth=depth + 1)
    else:
        raise ValueError(f"{type(value).__name__} is not a JSON value")


class _FieldError(ValueError):
    """A model-level check that blames one field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class _TooComplex(_FieldError):
    """A value nested too deep or too large to validate safely."""


def _bounded_schema_in(data: Any, key: str, *, where: str) -> Any:
    """``data`` (a model's raw input), once the JSON schema at ``key`` is walked within
    MAX_SCHEMA_DEPTH and MAX_SCHEMA_NODES (before anything recursive reads it); raises
    _TooComplex naming ``where``."""
    if isinstance(data, dict) and key in data:
        problem = json_bounds_problem(
            data[key], max_depth=MAX_SCHEMA_DEPTH, max_nodes=MAX_SCHEMA_NODES
        )
        if problem:
            raise _TooComplex(where, problem)
    return data


def json_bounds_problem(value: Any, *, max_depth: int, max_nodes: int) -> str | None:
    """Why ``value`` (decoded JSON) is too deep or too large, or None; iterative, so no
    depth of input can exhaust the stack."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    nodes = 0
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            return f"more than {max_nodes} values"
        if depth > max_depth:
            return f"nested deeper than {max_depth} levels"
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
    return None


def _check_limits(job: JobRequest, limits: LimitSettings) -> None:
    if job.max_tokens > limits.max_tokens_cap:
        raise _FieldError("max_tokens", f"{job.max_tokens} exceeds the cap {limits.max_tokens_cap}")
    if job.n * job.max_tokens > limits.max_tokens_cap:
        raise _FieldError(
            "n",
            f"n={job.n} sequences of max_tokens={job.max_tokens} exceed the cap "
            f"{limits.max_tokens_cap}",
        )
    if job.prompt is not None and len(job.prompt) > limits.max_prompt_chars:
        raise _FieldError(
            "prompt", f"{len(job.prompt)} characters exceed the limit {limits.max_prompt_chars}"
        )
    if job.messages is not None:
        if len(job.messages) > limits.max_messages:
            raise _FieldError(
                "messages", f"{len(job.messages)} messages exceed the limit {limits.max_messages}"
            )
        chars = sum(len(m.content) for m in job.messages)
        if chars > limits.max_prompt_chars:
            raise _FieldError(
                "messages", f"{chars} characters exceed the limit {limits.max_prompt_chars}"
            )
    if job.prompt_token_ids is not None and len(job.prompt_token_ids) > limits.max_prompt_tokens:
        raise _FieldError(
            "prompt_token_ids",
            f"{len(job.prompt_token_ids)} tokens exceed the limit {limits.max_prompt_tokens}",
        )


def parse_job(payload: bytes | str, limits: LimitSettings | None = None) -> JobRequest:
    """Decode and validate a job payload; raises ValidationError naming the field.

    Handles what arrives from untrusted producers: oversized payloads,
    non-UTF-8 bytes, invalid JSON, wrong types, unknown fields.
    """
    raw = payload.encode() if isinstance(payload, str) else payload
    if limits is not None and len(raw) > limits.max_message_bytes:
        raise ValidationError(
            "job", f"payload of {len(raw)} bytes exceeds the limit {limits.max_message_bytes}"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationError("job", f"payload is not UTF-8 (byte {exc.start})") from None
    try:
        return JobRequest.model_validate_json(text, context={"limits": limits})
    except PydanticValidationError as exc:
        raise _to_validation_error(exc) from None


def validate_job(data: dict[str, Any], limits: LimitSettings | None = None) -> JobRequest:
    """Validate a job given as a dict (client side); raises ValidationError."""
    try:
        return JobRequest.model_validate(data, context={"limits": limits})
    except PydanticValidationError as exc:
        raise _to_validation_error(exc) from None


def _to_validation_error(exc: PydanticValidationError) -> ValidationError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    original = (err.get("ctx") or {}).get("error")
    if isinstance(original, _TooComplex):
        return TooComplex(original.field, str(original))
    if isinstance(original, _FieldError):
        return ValidationError(original.field, str(original))
    if err["type"] == "json_invalid":
        return ValidationError("job", f"invalid JSON: {(err.get('ctx') or {}).get('error')}")
    if err["type"] == "extra_forbidden":
        return ValidationError(loc, "unknown field", value=err.get("input"))
    message = err["msg"].removeprefix("Value error, ")
    more = len(exc.errors()) - 1
    if more:
        message += f" (and {more} more error{'s' if more > 1 else ''})"
    return ValidationError(loc or "job", message, value=err.get("input"))


def job_seed(job_id: str) -> int:
    """The seed of a job submitted without one: the first 8 bytes of
    ``blake2b(f"seed:{job_id}", digest_size=8)`` read little-endian, shifted right by one
    bit (a non-negative int64). A pure function of the id, so every run of the job (a
    resume after a crash, a re-run after Redis lost its tail) draws the same tokens;
    a producer that wants fresh randomness submits a new id."""
    digest = hashlib.blake2b(f"seed:{job_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sequence_seed(seed: int, index: int) -> int:
    """The seed sequence ``index`` of a job with ``n`` > 1 samples with: the job's own seed
    for sequence 0 (so it equals the same job with n=1), and for i > 0 the first 8 bytes
    of ``blake2b(f"{seed}:{i}", digest_size=8)`` read little-endian, shifted right by one
    bit (a non-negative int64)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def new_job_id() -> str:
    return uuid.uuid4().hex


def encode_job(job: JobRequest) -> bytes:
    """The queue payload: compact JSON without unset optional fields."""
    return orjson.dumps(job.model_dump(mode="json", exclude_none=True, exclude_defaults=False))


class Usage(_Strict):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = Field(
        None,
        ge=0,
        description="Prompt tokens whose KV the daemon took from its prefix cache (full "
        "blocks shared with earlier jobs); unset by daemons that do not report it.",
    )


class Timings(_Strict):
    """Wall-clock timestamps (Unix seconds) of a job's life."""

    queued: float | None = None
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None


class Choice(_Strict):
    """One sequence of a job with ``n`` > 1, as its final event lists it."""

    index: int = Field(ge=0, description="The sequence, 0 to n-1.")
    text: str = Field(description="Its full text.")
    finish_reason: FinishReason
    completion_tokens: int = Field(ge=0)


class Event(_Strict):
    """One entry of a job's events stream (and the same JSON on its channel).

    Token events carry ``token_id`` and the new ``text``. The final event has
    ``finish_reason``, the full ``text``, ``usage``, ``timings``, ``metadata``
    and, on failure, ``error``; it has no ``token_id``. For a job with ``n`` > 1
    each token event names its sequence in ``index``, and the final event lists
    every sequence in ``choices`` (its ``text`` is sequence 0's, its ``usage``
    counts the prompt once and the tokens of all sequences). With n=1 neither
    field is present. No number in it is NaN or infinite (JSON has neither: an event
    that would hold one is refused when it is made, never published unreadable).
    A daemon writes no field outside this schema; a reader should leave out the fields
    it does not know (a newer daemon's), as batchd's own readers do.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    seq: int = Field(ge=0, description="0, 1, 2, ... with no gap or duplicate.")
    index: int | None = Field(
        None, ge=0, description="The token's sequence (jobs with n > 1 only)."
    )
    token_id: int | None = None
    text: str = ""
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = Field(
        None,
        description="[token id, logprob] best first (jobs with logprobs > 0); only tokens the "
        "job could produce: fewer when its grammar forbids the rest.",
    )
    token_texts: dict[int, str] | None = Field(
        None,
        description="Token id -> its text decoded alone, for each id this event names (jobs "
        "with token_texts).",
    )
    token_bytes: dict[int, list[int]] | None = Field(
        None,
        description="Token id -> its bytes, for each id of token_texts that is only part of a "
        "multi-byte character (its text decoded alone shows U+FFFD); every other id's bytes "
        "are its text's UTF-8.",
    )
    stop_token: bool | None = Field(
        None,
        description="True (else absent) on the token event of a stop token (eos, stop_token_ids, a "
        "grammar's end): it ends its sequence and none of its own text is in the output "
        "(its text is only what it released). It counts in usage.completion_tokens.",
    )
    prompt_logprobs: list[tuple[int, float | None]] | None = Field(
        None,
        description="[token id, logprob] of each prompt token, the first's logprob null "
        "(on the first token event of a job that asked, sequence 0's for n > 1).",
    )
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None
    metadata: dict[str, Any] | None = None
    choices: list[Choice] | None = Field(
        None, description="Every sequence's end (final event of a job with n > 1 only)."
    )

    @property
    def final(self) -> bool:
        return self.finish_reason is not None

    def encode(self) -> bytes:
        if (
            self.finish_reason is None
            and self.prompt_logprobs is None
            and self.usage is None
            and self.timings is None
            and self.error is None
            and self.metadata is None
            and self.choices is None
        ):
            # A token event (a daemon encodes one per job and step): the fields by hand,
            # in the model's order, as model_dump would give them.
            fields: dict[str, Any] = {"seq": self.seq}
            if self.index is not None:
                fields["index"] = self.index
            if self.token_id is not None:
                fields["token_id"] = self.token_id
            fields["text"] = self.text
            if self.logprob is not None:
                fields["logprob"] = self.logprob
            if self.top_logprobs is not None:
                fields["top_logprobs"] = self.top_logprobs
            if self.token_texts is not None:
                fields["token_texts"] = {str(t): text for t, text in self.token_texts.items()}
            if self.token_bytes is not None:
                fields["token_bytes"] = {str(t): raw for t, raw in self.token_bytes.items()}
            if self.stop_token is not None:
                fields["stop_token"] = self.stop_token
            return orjson.dumps(fields)
        return orjson.dumps(self.model_dump(mode="json", exclude_none=True))

    @classmethod
    def decode(cls, data: bytes | str) -> Event:
        """An event as a reader takes it: fields this version does not know (a newer
        daemon's) are left out, so readers need not be upgraded before daemons; an
        event made here still refuses them (a typo in the code that builds it)."""
        raw = orjson.loads(data)
        if isinstance(raw, dict):
            raw = {name: value for name, value in raw.items() if name in cls.model_fields}
        return cls.model_validate(raw)


class JobStatus(BaseModel):
    """The status hash ``batchd:job:<id>``; every value is stored as a string."""

    model_config = ConfigDict(extra="allow")

    state: JobState
    queue: str | None = None
    entry: str | None = Field(
        None,
        description="Stream id of the job's entry on its queue: stored with the entry at "
        "submit by batchd's clients, at pickup by the daemon (a raw XADD's), and again when "
        "an entry Redis lost is added back.",
    )
    error: str | None = None
    daemon: str | None = Field(None, description="Consumer name of the daemon holding the job.")
    queued_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: FinishReason | None = None
    completion_tokens: int | None = None
    cancel_requested: bool = False
    submit_token: str | None = Field(
        None, description="Random tag of the submit that created the job (a retry knows it)."
    )
    epoch: int | None = Field(
        None, description="Pickup count fencing the job's writes: only the latest pickup writes."
    )
    owner: str | None = Field(None, description="Consumer name of the pickup holding ``epoch``.")
    key_id: str | None = Field(
        None,
        description="Id (a digest, never the key) of the gateway API key that created the job; "
        "the gateway reads, streams and cancels only its key's jobs. Unset: a raw producer's.",
    )

    @classmethod
    def from_hash(cls, data: dict[bytes, bytes] | dict[str, str]) -> JobStatus:
        decoded = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in data.items()
        }
        return cls.model_validate({k: v for k, v in decoded.items() if v != ""})

    def to_hash(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for key, value in self.model_dump(mode="json", exclude_none=True).items():
            out[key] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return out


class DaemonHeartbeat(BaseModel):
    """The heartbeat JSON at ``batchd:daemon:<consumer>``, set with a TTL by a live daemon.

    Read by other daemons (the claim rule: a daemon is dead when the key is gone,
    or when it is ``busy`` and ``last_step_at`` is older than the stall timeout),
    by ``batchd top`` and by gateways. Unknown fields are kept (newer daemons).
    """

    model_config = ConfigDict(extra="allow")

    consumer: str
    model: str | None = None
    queues: list[str] = Field(default_factory=list)
    instance: str = Field(description="host:pid:tag of the process owning the key.")
    pid: int
    host: str
    started_at: float
    at: float = Field(description="Unix time of this beat.")
    busy: bool = Field(False, description="The engine has work.")
    last_step_at: float | None = Field(
        None, description="Unix time of the last completed engine step (or of the last idle check)."
    )
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    jobs_held: int = 0
    tokens_per_s: float = 0.0
    jobs_done: dict[str, int] = Field(default_factory=dict)
    redis_down: bool = False
    stopping: bool = False
    version: str | None = Field(None, description="The daemon's batchd version.")
    kv_blocks_used: int | None = Field(None, description="KV pool blocks in use.")
    adapters: list[str] = Field(
        default_factory=list, description="LoRA adapters the daemon serves (a job's adapter)."
    )
    kv_blocks_total: int | None = Field(None, description="KV pool blocks in all.")
    max_model_len: int | None = Field(
        None, description="The model's context bound: prompt plus output tokens of one job."
    )
    controls: list[str] = Field(
        default_factory=list,
        description="Requests of <prefix>:control:<consumer> the daemon obeys "
        "(pause, resume, drain).",
    )
    paused: bool = Field(False, description="Intake paused by a control request.")
    draining: bool = Field(
        False, description="Finishing its held jobs, taking none, then exiting (a drain)."
    )


def now() -> float:
    return time.time()


def protocol_schema_json() -> str:
    """:func:`protocol_schema` as printed by ``batchd schema`` and committed as
    ``producers/protocol.schema.json``."""
    return orjson.dumps(protocol_schema(), option=orjson.OPT_INDENT_2).decode() + "\n"


def protocol_schema() -> dict[str, Any]:
    """The protocol as one JSON Schema document (what ``batchd schema`` prints)."""
    from batchd.producers import keys

    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "batchd wire protocol",
        "description": (__doc__ or "").strip(),
        "keys": {
            "queue": _shown(keys.Keys().queue("QUEUE")),
            "consumer_group": keys.CONSUMER_GROUP,
            "job_field": keys.JOB_FIELD,
            "status": _shown(keys.Keys().job("ID")),
            "events": _shown(keys.Keys().events("ID")),
            "event_field": keys.EVENT_FIELD,
            "event_id": "0-<seq+1>",
            "tokens_channel": _shown(keys.Keys().tokens("ID")),
            "cancel": keys.Keys().cancel,
            "cancel_field": keys.CANCEL_FIELD,
            "cancel_maxlen": keys.CANCEL_MAXLEN,
            "heartbeat": keys.Keys().daemon("<consumer>"),
            "dead_letters": keys.Keys().dead,
            "name_pattern": NAME_PATTERN,
        },
        "$defs": {
            "JobRequest": JobRequest.model_json_schema(),
            "Event": Event.model_json_schema(),
            "JobStatus": JobStatus.model_json_schema(),
            "DaemonHeartbeat": DaemonHeartbeat.model_json_schema(),
        },
    }


def _shown(key: str) -> str:
    """A key name as the schema documents it, placeholders in angle brackets."""
    return key.replace("QUEUE", "<queue>").replace("ID", "<id>")
