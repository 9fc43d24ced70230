"""A usage chart drawn on the server as SVG: no script in the admin, nothing fetched."""

from html import escape

COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"]
WIDTH, HEIGHT, MARGIN = 760, 220, 40


def stacked_bars(days, series, title):
    """days: ["2026-11-30", ...]; series: {model: [value per day]} -> an SVG document (str)."""
    totals = [sum(values[i] for values in series.values()) for i in range(len(days))]
    top = max(totals, default=0) or 1
    slot = (WIDTH - 2 * MARGIN) / max(len(days), 1)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT + 60}" role="img" aria-label="{escape(title)}">']
    parts.append(f'<text x="{MARGIN}" y="16" font-size="13">{escape(title)} (max {top:g})</text>')
    for i, day in enumerate(days):
        x, base = MARGIN + i * slot, HEIGHT
        for n, (model, values) in enumerate(sorted(series.items())):
            height = values[i] / top * (HEIGHT - 30)
            base -= height
            tip = f"<title>{escape(model)} {escape(day)}: {values[i]:g}</title>"
            parts.append(f'<rect x="{x:.1f}" y="{base:.1f}" width="{slot * 0.8:.1f}" height="{height:.1f}" fill="{COLOURS[n % len(COLOURS)]}">{tip}</rect>')
        parts.append(f'<text x="{x:.1f}" y="{HEIGHT + 14}" font-size="10">{escape(day[5:])}</text>')
    for n, model in enumerate(sorted(series)):
        parts.append(f'<text x="{MARGIN + n * 150}" y="{HEIGHT + 40}" font-size="11" fill="{COLOURS[n % len(COLOURS)]}">■ {escape(model)}</text>')
    return "".join(parts) + "</svg>"
