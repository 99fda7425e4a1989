"""Templates: one Jinja2 environment, autoescaping everything, with the page's formats.

Every value from Redis (job text, prompts, errors, consumer names, metadata) reaches
HTML through autoescaping; nothing is marked safe except the sparklines
(:mod:`.charts`), which hold numbers only. Formats are filters so that the templates
and the live fragments show a value the same way.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import jinja2
import orjson

from batchd.producers.dashboard.charts import sparkline
from batchd.producers.gateway.fleet import public_name

HERE = Path(__file__).parent


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        num=num,
        pct=pct,
        ms=ms,
        age=age,
        clock=clock,
        duration=duration,
        pretty_json=pretty_json,
        model_name=model_name,
    )
    env.globals.update(sparkline=sparkline, now=time.time)
    return env


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def num(value: Any, digits: int = 0) -> str:
    """A count or rate with thousands separators; a dash when unknown."""
    if _missing(value) or not isinstance(value, (int, float)):
        return "–"
    return f"{value:,.{digits}f}"


def pct(value: Any) -> str:
    return "–" if _missing(value) or not isinstance(value, (int, float)) else f"{value:.0%}"


def ms(seconds: Any) -> str:
    """Seconds shown in the unit that reads best: ms below 10 s, else seconds."""
    if _missing(seconds) or not isinstance(seconds, (int, float)):
        return "–"
    return f"{seconds * 1000:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def duration(seconds: Any) -> str:
    """A span as ``850 ms``, ``12.3 s``, ``4 min 05 s``, ``3 h 12 min``."""
    if _missing(seconds) or not isinstance(seconds, (int, float)):
        return "–"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def age(at: Any, now: float | None = None) -> str:
    """How long ago a Unix time was ("3.2 s ago")."""
    if _missing(at) or not isinstance(at, (int, float)):
        return "–"
    return f"{duration(max(0.0, (now or time.time()) - at))} ago"


def clock(at: Any) -> str:
    """A Unix time as local date and time to the millisecond."""
    if _missing(at) or not isinstance(at, (int, float)):
        return "–"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + f".{int(at % 1 * 1000):03d}"


def model_name(model: Any) -> str:
    """A model as the gateway names it: a local path by its last part, a hub id whole."""
    return public_name(str(model)) if model else "–"


def pretty_json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
