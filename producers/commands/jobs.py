"""Job subcommands of ``batchd``: submit, stream, status, cancel, schema.

Exit codes: 0 done; 1 the job failed, was cancelled or expired, or is
unknown; 2 the request is invalid; 3 Redis is unreachable; 4 timed out.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from batchd.config.settings import Settings
from batchd.producers.client import Client
from batchd.producers.commands.redis_failure import REDIS_EXIT, REDIS_FAILURES, explain
from batchd.producers.commands.subcommand import Handler, add_command
from batchd.producers.errors import BatchdError, JobFailed, JobNotFound, JobTimeout, ValidationError
from batchd.producers.result import JobResult, ResultBuilder
from batchd.producers.schema import Event, protocol_schema_json


def register(sub: Any) -> None:
    """Add the producer subcommands to the ``batchd`` parser."""
    p = add_command(sub, "submit", submit)
    p.add_argument("prompt", help="prompt text ('-' reads it from stdin)")
    p.add_argument(
        "--system", metavar="TEXT", help="a system message before the prompt (chat template)"
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as it is, without the model's chat template",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="most tokens to generate (limits.max_tokens_cap)",
    )
    p.add_argument("--temperature", type=float, metavar="T", help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling (default 1)")
    p.add_argument("--top-k", type=int, metavar="K", help="sample from the K likeliest (0: all)")
    p.add_argument("--seed", type=int, metavar="S", help="reproducible sampling")
    p.add_argument(
        "--stop",
        action="append",
        metavar="STR",
        help="end the text before this string (repeatable; not printed)",
    )
    p.add_argument(
        "--priority",
        type=int,
        metavar="P",
        help="higher runs first (default 0; waiting jobs age up)",
    )
    p.add_argument("--ttl", type=float, metavar="SECONDS", help="expire if not started in time")
    p.add_argument("--id", metavar="ID", help="job id (default: a new UUID)")
    p.add_argument("--queue", metavar="Q", help="queue name (default: default)")
    p.add_argument(
        "--presence-penalty", type=float, metavar="P", help="-2..2: penalise tokens already present"
    )
    p.add_argument(
        "--frequency-penalty", type=float, metavar="P", help="-2..2: penalise tokens by their count"
    )
    p.add_argument(
        "--logit-bias", action="append", metavar="ID=BIAS", help="add BIAS to token ID (repeatable)"
    )
    p.add_argument(
        "--min-tokens", type=int, metavar="N", help="no end token or stop string before N outputs"
    )
    p.add_argument("-n", "--n", type=int, metavar="N", help="generate N sequences of the prompt")
    p.add_argument(
        "--prompt-logprobs",
        action="store_true",
        default=None,
        help="return each prompt token's logprob (shown with --json)",
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", metavar="FILE", help="output valid for this JSON schema")
    fmt.add_argument(
        "--response-format", metavar="JSON", help='e.g. \'{"type": "regex", "regex": "[0-9]+"}\''
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stream", action="store_true", help="print the text as it is generated")
    mode.add_argument("--wait", action="store_true", help="wait and print the result")
    _add_output_options(p)

    p = add_command(sub, "stream", stream)
    p.add_argument("job_id", metavar="ID", help="the job's id (as submit printed it)")
    _add_output_options(p)

    p = add_command(sub, "status", status)
    p.add_argument("job_id", metavar="ID", help="the job's id (as submit printed it)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = add_command(sub, "cancel", cancel)
    p.add_argument("job_id", metavar="ID", help="the job's id (as submit printed it)")

    add_command(sub, "schema", schema)


def _add_output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON (one event per line)")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="give up after this long")


def _guarded(handler: Handler) -> Handler:
    """Turn the client's errors into a one-line message and an exit code."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace, settings: Settings) -> int:
        try:
            return handler(args, settings)
        except ValidationError as exc:
            return _fail(f"invalid request: {exc}", 2)
        except (JobFailed, JobNotFound) as exc:
            return _fail(str(exc), 1)
        except JobTimeout as exc:
            return _fail(str(exc), 4)
        except REDIS_FAILURES as exc:
            return _fail(explain(exc, settings.connection_url()), REDIS_EXIT)
        except BatchdError as exc:
            return _fail(str(exc), 1)

    return run


def _fail(message: str, code: int) -> int:
    print(f"batchd: {message}", file=sys.stderr)
    return code


def _client(settings: Settings, queue: str | None = None) -> Client:
    return Client(
        settings.connection_url(),
        prefix=settings.key_prefix,
        queue=queue or "default",
        limits=settings.limits,
    )


@_guarded
def submit(args: argparse.Namespace, settings: Settings) -> int:
    """Enqueue a generation job.

    The prompt goes to the model as a user message through its chat template (--system adds
    a system message before it; --raw sends the text as it is). Prints the job's id, or
    streams its text (--stream), or waits for it (--wait).
    """
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    options = {
        **_prompt(text, system=args.system, raw=args.raw),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
        "priority": args.priority,
        "ttl_s": args.ttl,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "min_tokens": args.min_tokens,
        "n": args.n,
        "prompt_logprobs": args.prompt_logprobs,
        "logit_bias": _logit_bias(args.logit_bias),
        "response_format": _response_format(args.json_schema, args.response_format),
    }
    with _client(settings, args.queue) as client:
        handle = client.submit(id=args.id, **options)
        if args.stream or args.wait:
            events = handle.stream(timeout=args.timeout)
            hint = " (--raw skips the chat template a chat model expects)" if args.raw else ""
            return _print_events(
                events, handle.id, as_json=args.json, live=args.stream, no_text_hint=hint
            )
        if args.json:
            _print_json({"id": handle.id, "queue": handle.queue})
        else:
            print(handle.id)
    return 0


def _prompt(text: str, *, system: str | None, raw: bool) -> dict[str, Any]:
    """The job's prompt field: chat messages (the daemon applies the model's template), or
    the text as it is with ``raw``.

    A chat model given a bare prompt often ends at once (SmolLM2 answers "What is the
    capital of France?" with its end token), so the template is the default."""
    if not text.strip():
        raise ValidationError("prompt", "is empty: give the text to answer (or - to read stdin)")
    if raw:
        if system is not None:
            raise ValidationError("system", "--system needs the chat template: drop --raw")
        return {"prompt": text}
    messages = [] if system is None else [{"role": "system", "content": system}]
    return {"messages": [*messages, {"role": "user", "content": text}]}


def _logit_bias(pairs: list[str] | None) -> dict[str, float] | None:
    """``ID=BIAS`` arguments as the wire's {"ID": BIAS}."""
    if not pairs:
        return None
    bias = {}
    for pair in pairs:
        token, _, value = pair.partition("=")
        try:
            bias[token.strip()] = float(value)
        except ValueError:
            raise ValidationError("logit_bias", f"{pair!r} is not ID=BIAS") from None
    return bias


def _response_format(schema_file: str | None, raw: str | None) -> dict[str, Any] | None:
    """--json-schema FILE or --response-format JSON as the wire's response_format."""
    field, text = ("json_schema", schema_file) if schema_file else ("response_format", raw)
    if text is None:
        return None
    try:
        data = orjson.loads(Path(text).read_bytes() if schema_file else text)
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValidationError(field, f"cannot read {text!r} as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValidationError(field, f"must be a JSON object, got {text!r}")
    return {"type": "json_schema", "json_schema": data} if schema_file else data


@_guarded
def stream(args: argparse.Namespace, settings: Settings) -> int:
    """Print a job's tokens, replayed then live."""
    with _client(settings) as client:
        client.status(args.job_id)  # unknown ids fail here instead of waiting
        events = client.stream(args.job_id, timeout=args.timeout)
        return _print_events(events, args.job_id, as_json=args.json, live=True)


def _print_events(
    events: Iterator[Event], job_id: str, *, as_json: bool, live: bool, no_text_hint: str = ""
) -> int:
    """Print tokens as they come (``live``) or only the result; raises JobFailed.

    Of a job with n > 1, only sequence 0 is printed live; the others follow at the
    end, each on its own line after ``[index]``. A job that ended without any text says so
    on stderr (with ``no_text_hint``), so that an empty answer is not mistaken for none."""
    builder = ResultBuilder(job_id)
    for event in events:
        if as_json and live:
            sys.stdout.write(event.encode().decode() + "\n")
        elif live and not event.final and not event.index:
            sys.stdout.write(event.text)
        sys.stdout.flush()
        try:
            result = builder.add(event)
        except JobFailed:
            if live and not as_json:
                sys.stdout.write("\n")
            raise
        if result is None:
            continue
        if as_json and not live:
            _print_json(result.to_dict())
        elif not as_json:
            sys.stdout.write("\n" if live else result.text + "\n")
            for choice in result.choices[1:]:
                sys.stdout.write(f"[{choice.index}] {choice.text}\n")
            if not result.text and not any(choice.text for choice in result.choices):
                sys.stdout.flush()
                print(f"batchd: {_no_text(result)}{no_text_hint}", file=sys.stderr)
    return 0


def _no_text(result: JobResult) -> str:
    """Why a finished job printed nothing: how it ended, after how many tokens."""
    tokens = result.usage.completion_tokens if result.usage else len(result.token_ids)
    return (
        f"job {result.id} produced no text: it finished ({result.finish_reason.value}) "
        f"after {tokens} token{'s' if tokens != 1 else ''}"
    )


@_guarded
def status(args: argparse.Namespace, settings: Settings) -> int:
    """Show a job's status hash."""
    with _client(settings) as client:
        state = client.status(args.job_id)
    fields = state.model_dump(mode="json", exclude_none=True)
    if args.json:
        _print_json({"id": args.job_id, **fields})
    else:
        for key, value in fields.items():
            print(f"{key}: {value}")
    return 0


@_guarded
def cancel(args: argparse.Namespace, settings: Settings) -> int:
    """Cancel a queued or running job."""
    with _client(settings) as client:
        if client.cancel(args.job_id):
            print(f"cancel requested for {args.job_id}")
        else:
            print(f"{args.job_id} already ended ({client.status(args.job_id).state.value})")
    return 0


def schema(args: argparse.Namespace, settings: Settings) -> int:
    """Print the wire protocol as JSON Schema."""
    sys.stdout.write(protocol_schema_json())
    return 0


def _print_json(data: Any) -> None:
    print(orjson.dumps(data).decode())
