"""Inline SVG sparklines: a few polylines scaled into a small box, no script, no library.

The SVG holds numbers and fixed class names only (no text from Redis), so it is safe to
mark as markup; colours come from the stylesheet (``.s0``, ``.s1``: first and second
series). A ``None`` breaks a line, so a gap in the data is not drawn as a drop to zero.
"""

from __future__ import annotations

from collections.abc import Sequence

from markupsafe import Markup

WIDTH, HEIGHT, PAD = 300, 60, 3


def sparkline(
    series: Sequence[Sequence[float | None]], *, width: int = WIDTH, height: int = HEIGHT
) -> Markup:
    """An ``<svg>`` drawing each series (same length, oldest first) against one y scale
    from 0 to the largest value; empty when there is no value at all."""
    values = [v for line in series for v in line if v is not None]
    top = max(values, default=0.0) or 1.0
    count = max((len(line) for line in series), default=0)
    step = (width - 2 * PAD) / max(count - 1, 1)
    paths = []
    for index, line in enumerate(series):
        for run in _runs(line):
            points = " ".join(
                f"{PAD + i * step:.1f},{height - PAD - (v / top) * (height - 2 * PAD):.1f}"
                for i, v in run
            )
            if len(run) == 1:  # a lone point: a dot, or it would not show
                x, y = points.split(",")
                paths.append(f'<circle class="s{index}" cx="{x}" cy="{y}" r="1.5"/>')
            else:
                paths.append(f'<polyline class="s{index}" points="{points}"/>')
    body = "".join(paths)
    return Markup(
        f'<svg class="spark" viewBox="0 0 {width} {height}" preserveAspectRatio="none" '
        f'role="img" aria-hidden="true">{body}</svg>'
    )


def _runs(line: Sequence[float | None]) -> list[list[tuple[int, float]]]:
    """The line's stretches without a gap, each as (index, value) pairs."""
    runs: list[list[tuple[int, float]]] = []
    current: list[tuple[int, float]] = []
    for i, value in enumerate(line):
        if value is None:
            if current:
                runs.append(current)
            current = []
        else:
            current.append((i, float(value)))
    if current:
        runs.append(current)
    return runs
