"""Per-request sampling options, validated once when the request is made.

The engine never re-checks these: a `SamplingParams` that exists is valid, so
a bad job fails at intake with a message that names the field and the value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchd.engine.constraints.grammar import Constraint
from batchd.engine.exceptions import InvalidRequest

MAX_LOGPROBS = 20
# OpenAI's bounds for the additive controls.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# sampling_order: where top-k, top-p and min-p sit relative to temperature (docs/jobs.md:
# Sampling). The default is vLLM's (and Hugging Face transformers'); mlx-lm's make_sampler
# and llama.cpp filter the temperature-1 distribution instead.
TEMPERATURE_FIRST = "temperature_first"
FILTERS_FIRST = "filters_first"
SAMPLING_ORDERS = (TEMPERATURE_FIRST, FILTERS_FIRST)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)


# field -> (test, what a valid value is); NaN fails every comparison, so it is refused.
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    "temperature": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _is_int(v) and v >= 0, "an int >= 0 (0: off)"),
    "min_p": (lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "seed": (lambda v: v is None or _is_int(v), "an int or None"),
    "stop": (
        lambda v: isinstance(v, (tuple, list)) and all(isinstance(s, str) and s for s in v),
        "a tuple of non-empty strings",
    ),
    "stop_token_ids": (
        lambda v: isinstance(v, (tuple, list)) and all(_is_int(t) and t >= 0 for t in v),
        "a tuple of token ids (ints >= 0)",
    ),
    "ignore_eos": (lambda v: isinstance(v, bool), "a bool"),
    "logprobs": (lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS, f"an int in 0..{MAX_LOGPROBS}"),
    "presence_penalty": (
        lambda v: _is_number(v) and -MAX_PENALTY <= v <= MAX_PENALTY,
        f"a number in [-{MAX_PENALTY}, {MAX_PENALTY}]",
    ),
    "frequency_penalty": (
        lambda v: _is_number(v) and -MAX_PENALTY <= v <= MAX_PENALTY,
        f"a number in [-{MAX_PENALTY}, {MAX_PENALTY}]",
    ),
    "logit_bias": (
        lambda v: (
            isinstance(v, (tuple, list))
            and all(
                isinstance(p, (tuple, list))
                and len(p) == 2
                and _is_int(p[0])
                and p[0] >= 0
                and _is_number(p[1])
                and -MAX_LOGIT_BIAS <= p[1] <= MAX_LOGIT_BIAS
                for p in v
            )
        ),
        f"(token id, bias in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]) pairs",
    ),
    "min_tokens": (lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    "penalty_window": (lambda v: v is None or (_is_int(v) and v >= 1), "None or an int >= 1"),
    "sampling_order": (lambda v: v in SAMPLING_ORDERS, f"one of {SAMPLING_ORDERS}"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "a bool"),
    "spaces_between_special_tokens": (lambda v: isinstance(v, bool), "a bool"),
    "token_texts": (lambda v: isinstance(v, bool), "a bool"),
    "prompt_logprobs": (lambda v: isinstance(v, bool), "a bool"),
    "speculative": (lambda v: v is None or isinstance(v, bool), "a bool or None"),
    "constraint": (lambda v: v is None or isinstance(v, Constraint), "a Constraint or None"),
}


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 means greedy (argmax); top_k 0, top_p 1 and min_p 0 mean "no
    filter". `seed` makes sampling a pure function of (seed, position), so a
    token regenerated after a crash is the same token. `stop` holds strings
    that end the output; `stop_token_ids` are extra token ids that end it.
    `logprobs` is how many top log-probabilities to return per token (0: none).
    `logit_bias` adds a bias to given token ids; `presence_penalty` and
    `frequency_penalty` subtract from the logits of tokens already generated once / per
    occurrence, and `repetition_penalty` scales those of prompt and generated tokens
    (vLLM's scope, OpenAI's for the first two); `penalty_window` N instead applies all
    three to the last N tokens of prompt + output (mlx-lm's processors; docs/jobs.md:
    Penalties). `sampling_order` puts top-k / top-p / min-p after temperature (vLLM's,
    the default) or before it (mlx-lm's). `min_tokens` holds back the end tokens and
    the stop strings until that many outputs exist (vLLM's);
    `constraint` restricts the output to a grammar (JSON schema, regex, ...).
    `skip_special_tokens` leaves special tokens out of the text and
    `spaces_between_special_tokens` separates kept ones from their neighbours with a
    space (vLLM's defaults: both True). `token_texts` makes each output carry the text
    of each token id it names (the token, its top alternatives, the prompt's tokens with
    `prompt_logprobs`), each decoded alone.
    `speculative` opts this request in to speculative decoding (True), out of it
    (False), or leaves it to the engine's option (None); outputs are the same either
    way (docs/engine.md: Speculative decoding).
    `prompt_logprobs` asks for the log-probability of each prompt token given the
    ones before it (the model's raw logits: no processor applies to the prompt); the
    prompt is then computed whole, never taken from the prefix cache.
    Lists given for `stop` / `stop_token_ids` / `logit_bias` are stored as tuples.

    Raises ValueError naming the field and the bad value.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    constraint: Constraint | None = None
    prompt_logprobs: bool = False
    penalty_window: int | None = None
    sampling_order: str = TEMPERATURE_FIRST
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    token_texts: bool = False
    speculative: bool | None = None

    def __post_init__(self) -> None:
        for field, (valid, rule) in _RULES.items():
            value = getattr(self, field)
            if not valid(value):
                raise InvalidRequest(f"SamplingParams.{field} must be {rule}, got {value!r}")
        # Frozen dataclass: normalise through object.__setattr__ so the params
        # stay immutable and hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(
            self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias)
        )

    @property
    def penalises_recent(self) -> bool:
        """True when sampling needs the tokens seen so far (repetition, presence, frequency)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def greedy(self) -> bool:
        """True when sampling is plain argmax (temperature 0)."""
        return self.temperature == 0.0
