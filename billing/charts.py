"""A usage chart drawn on the server as SVG: no script in the admin, nothing fetched."""

import math
from html import escape

COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"]
WIDTH, HEIGHT, LEFT, RIGHT, TOP = 760, 220, 70, 10, 30
MOST_DATE_LABELS = 10  # more overlap at this width
TICKS = 4


def stacked_bars(days, series, title):
    """days: ["2026-11-30", ...]; series: {model: [value per day]} -> an SVG document (str):
    one bar a day, a segment per model, a labelled y-axis, and dates thinned to stay apart."""
    totals = [sum(values[i] for values in series.values()) for i in range(len(days))]
    top = nice_top(max(totals, default=0))
    slot = (WIDTH - LEFT - RIGHT) / max(len(days), 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT + 60}" role="img" aria-label="{escape(title)}">']
    parts.append(f'<text x="{LEFT}" y="16" font-size="13">{escape(title)}</text>')
    parts += y_axis(top)
    for i, day in enumerate(days):
        parts += bar(LEFT + i * slot, slot, day, i, series, top)
        if (len(days) - 1 - i) % math.ceil(len(days) / MOST_DATE_LABELS) == 0:  # the last day (today) always
            parts.append(f'<text x="{LEFT + i * slot:.1f}" y="{HEIGHT + 14}" font-size="10">{escape(day[5:])}</text>')
    for n, model in enumerate(sorted(series)):
        parts.append(f'<text x="{LEFT + n * 150}" y="{HEIGHT + 40}" font-size="11" fill="{COLOURS[n % len(COLOURS)]}">■ {escape(model)}</text>')
    return "".join(parts) + "</svg>"


def bar(x, slot, day, i, series, top):
    parts, base = [], HEIGHT
    for n, (model, values) in enumerate(sorted(series.items())):
        height = values[i] / top * (HEIGHT - TOP)
        base -= height
        tip = f"<title>{escape(model)} {escape(day)}: {values[i]:g}</title>"
        parts.append(f'<rect x="{x:.1f}" y="{base:.1f}" width="{slot * 0.8:.1f}" height="{height:.1f}" fill="{COLOURS[n % len(COLOURS)]}">{tip}</rect>')
    return parts


def y_axis(top):
    """The axis line and TICKS + 1 labelled gridlines from 0 to `top`."""
    parts = [f'<line x1="{LEFT - 4}" y1="{TOP}" x2="{LEFT - 4}" y2="{HEIGHT}" stroke="#888"/>']
    for k in range(TICKS + 1):
        value = top * k / TICKS
        y = HEIGHT - value / top * (HEIGHT - TOP)
        parts.append(f'<line x1="{LEFT - 8}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{LEFT - 10}" y="{y + 4:.1f}" font-size="10" text-anchor="end" class="tick">{value:g}</text>')
    return parts


def nice_top(value):
    """The axis' top: 1, 2, 2.5 or 5 times a power of ten, at least `value` (1 for nothing)."""
    if value <= 0:
        return 1
    power = 10 ** math.floor(math.log10(value))
    return next(step * power for step in (1, 2, 2.5, 5, 10) if step * power >= value)
