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
import redis

from batchd.config.secrets import redact
from batchd.config.settings import Settings
from batchd.producers.client import Client
from batchd.producers.commands.subcommand import Handler, add_command
from batchd.producers.errors import BatchdError, JobFailed, JobNotFound, JobTimeout, ValidationError
from batchd.producers.result import ResultBuilder
from batchd.producers.schema import Event, protocol_schema_json


def register(sub: Any) -> None:
    """Add the producer subcommands to the ``batchd`` parser."""
    p = add_command(sub, "submit", submit)
    p.add_argument("prompt", help="prompt text ('-' reads it from stdin)")
    p.add_argument("--max-tokens", type=int, metavar="N")
    p.add_argument("--temperature", type=float, metavar="T")
    p.add_argument("--top-p", type=float, metavar="P")
    p.add_argument("--seed", type=int, metavar="S")
    p.add_argument("--priority", type=int, metavar="P")
    p.add_argument("--ttl", type=float, metavar="SECONDS", help="expire if not started in time")
    p.add_argument("--id", metavar="ID", help="job id (default: a new UUID)")
    p.add_argument("--queue", metavar="Q", help="queue name (default: default)")
    p.add_argument("--presence-penalty", type=float, metavar="P")
    p.add_argument("--frequency-penalty", type=float, metavar="P")
    p.add_argument(
        "--logit-bias", action="append", metavar="ID=BIAS", help="add BIAS to token ID (repeatable)"
    )
    p.add_argument("--min-tokens", type=int, metavar="N", help="no end token before N outputs")
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
    p.add_argument("job_id", metavar="ID")
    _add_output_options(p)

    p = add_command(sub, "status", status)
    p.add_argument("job_id", metavar="ID")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = add_command(sub, "cancel", cancel)
    p.add_argument("job_id", metavar="ID")

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
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            return _fail(f"cannot reach Redis at {redact(settings.redis_url)}: {exc}", 3)
        except BatchdError as exc:
            return _fail(str(exc), 1)

    return run


def _fail(message: str, code: int) -> int:
    print(f"batchd: {message}", file=sys.stderr)
    return code


def _client(settings: Settings, queue: str | None = None) -> Client:
    return Client(
        settings.redis_url,
        prefix=settings.key_prefix,
        queue=queue or "default",
        limits=settings.limits,
    )


@_guarded
def submit(args: argparse.Namespace, settings: Settings) -> int:
    """Enqueue a generation job.

    Prints the job's id, or streams its text (--stream), or waits for it (--wait).
    """
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    options = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
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
        handle = client.submit(prompt, id=args.id, **options)
        if args.stream or args.wait:
            events = handle.stream(timeout=args.timeout)
            return _print_events(events, handle.id, as_json=args.json, live=args.stream)
        if args.json:
            _print_json({"id": handle.id, "queue": handle.queue})
        else:
            print(handle.id)
    return 0


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


def _print_events(events: Iterator[Event], job_id: str, *, as_json: bool, live: bool) -> int:
    """Print tokens as they come (``live``) or only the result; raises JobFailed.

    Of a job with n > 1, only sequence 0 is printed live; the others follow at the
    end, each on its own line after ``[index]``."""
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
    return 0


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
