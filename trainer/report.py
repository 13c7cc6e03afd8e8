"""The goodput report: one self-contained HTML page (inline SVG, no scripts, no downloads).

A timeline of the run — step executions, checkpoint saves, injected faults and the
downtime each restart cost — above the numbers from `trainer.goodput`, and beside it the
training loss and throughput by step (each step's execution that lasted, so a redone
step appears once). The train
component publishes it as an `Output[HTML]` so it shows in the Kubeflow UI; the register
step logs it to MLflow.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

_WIDTH = 960
_LANES = ("steps", "checkpoints", "faults", "downtime")


def _x(t: float, t0: float, span: float) -> float:
    return 120 + (t - t0) / span * (_WIDTH - 140)


def timeline_svg(
    events: list[dict[str, Any]], faults: list[dict[str, Any]], restarts: list[dict[str, Any]]
) -> str:
    times = [e.get("at", e["time"]) for e in events] + [f["time"] for f in faults]
    if not times:
        return "<p>No events recorded.</p>"
    t0, t1 = min(times), max(times)
    span = max(t1 - t0, 1e-6)
    lane_y = {name: 20 + i * 34 for i, name in enumerate(_LANES)}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{20 + 34 * len(_LANES) + 30}">'
    ]
    for name, y in lane_y.items():
        parts.append(f'<text x="8" y="{y + 16}" font-size="13">{name}</text>')
        parts.append(f'<line x1="120" y1="{y + 26}" x2="{_WIDTH - 20}" y2="{y + 26}" stroke="#ddd"/>')
    for event in events:
        kind = event["kind"]
        if kind == "step":
            start = event["time"] - float(event.get("duration_s", 0.0))
            x0, x1 = _x(start, t0, span), _x(event["time"], t0, span)
            parts.append(
                f'<rect x="{x0:.1f}" y="{lane_y["steps"]}" width="{max(x1 - x0, 0.8):.1f}" height="22" '
                f'fill="#4c9be8"><title>step {event["step"]}</title></rect>'
            )
        elif kind == "checkpoint_committed":
            x = _x(event["time"], t0, span)
            parts.append(
                f'<rect x="{x - 1:.1f}" y="{lane_y["checkpoints"]}" width="3" height="22" fill="#2ca02c">'
                f"<title>checkpoint step {event.get('step')} committed</title></rect>"
            )
    for fault in faults:
        x = _x(fault["time"], t0, span)
        label = html.escape(f"{fault['kind']} at step {fault['step']} on rank {fault['rank']}")
        parts.append(
            f'<rect x="{x - 1.5:.1f}" y="{lane_y["faults"]}" width="3" height="22" fill="#d62728"><title>{label}</title></rect>'
        )
    for restart in restarts:
        if restart.get("fault_at") and restart.get("resumed_at"):
            x0, x1 = _x(restart["fault_at"], t0, span), _x(restart["resumed_at"], t0, span)
            label = html.escape(f"{restart['mechanism']} restart: {restart['downtime_s']:.1f} s down")
            parts.append(
                f'<rect x="{x0:.1f}" y="{lane_y["downtime"]}" width="{max(x1 - x0, 1):.1f}" height="22" '
                f'fill="#ff7f0e" opacity="0.7"><title>{label}</title></rect>'
            )
    bottom = 20 + 34 * len(_LANES) + 20
    parts.append(f'<text x="120" y="{bottom}" font-size="12">0 s</text>')
    parts.append(f'<text x="{_WIDTH - 80}" y="{bottom}" font-size="12">{span:.1f} s</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def last_executions(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step events, one per step (the execution that lasted), by step."""
    last: dict[int, dict[str, Any]] = {}
    for event in events:
        if event["kind"] == "step":
            last[int(event["step"])] = event
    return [last[step] for step in sorted(last)]


def curve_svg(title: str, points: list[tuple[float, float]], color: str, unit: str = "") -> str:
    """One line chart (x: step) as inline SVG, with its range written on the axes."""
    width, height, left, bottom = 460, 220, 60, 30
    if not points:
        return f"<p>No {html.escape(title)} recorded.</p>"
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    xspan, yspan = max(x1 - x0, 1e-9), max(y1 - y0, 1e-9)

    def at(x: float, y: float) -> str:
        px = left + (x - x0) / xspan * (width - left - 10)
        py = height - bottom - (y - y0) / yspan * (height - bottom - 25)
        return f"{px:.1f},{py:.1f}"

    line = " ".join(at(x, y) for x, y in points)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="curve" width="{width}" height="{height}">'
        f"<title>{html.escape(title)}</title>"
        f'<text x="{left}" y="14" font-size="13">{html.escape(title)}</text>'
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - 10}" y2="{height - bottom}" stroke="#999"/>'
        f'<line x1="{left}" y1="20" x2="{left}" y2="{height - bottom}" stroke="#999"/>'
        f'<text x="4" y="30" font-size="11">{y1:.4g}{unit}</text>'
        f'<text x="4" y="{height - bottom}" font-size="11">{y0:.4g}{unit}</text>'
        f'<text x="{left}" y="{height - 10}" font-size="11">step {x0:.0f}</text>'
        f'<text x="{width - 70}" y="{height - 10}" font-size="11">step {x1:.0f}</text>'
        f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{line}"/>'
        "</svg>"
    )


def curves_html(events: list[dict[str, Any]], tokens_per_step: int) -> str:
    """Loss and throughput by step; tokens/s when `tokens_per_step` is known, else steps/s."""
    steps = last_executions(events)
    loss = [(float(e["step"]), float(e["loss"])) for e in steps if "loss" in e]
    per_step = tokens_per_step or 1
    throughput = [
        (float(e["step"]), per_step / float(e["duration_s"]))
        for e in steps
        if float(e.get("duration_s", 0)) > 0
    ]
    label = "throughput (tokens/s)" if tokens_per_step else "throughput (steps/s)"
    return curve_svg("training loss", loss, "#1f77b4") + "\n" + curve_svg(label, throughput, "#2ca02c")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return html.escape(str(value))


def goodput_html(
    summary: dict[str, Any],
    events: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    tokens_per_step: int = 0,
) -> str:
    restarts = summary.get("restarts", [])
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{_fmt(r.get(key))}</td>"
            for key in (
                "kind",
                "cause_detail",
                "mechanism",
                "fault_step",
                "resumed_step",
                "detection_s",
                "shutdown_s",
                "startup_s",
                "downtime_s",
                "steps_redone",
            )
        )
        + "</tr>"
        for r in restarts
    )
    headline = [
        ("goodput", f"{summary.get('goodput_pct', 0):.1f} %"),
        ("checkpoint efficiency", f"{summary.get('efficiency_pct', 0):.1f} %"),
        ("restarts", str(len(restarts))),
        ("steps redone", str(summary.get("lost_steps", 0))),
        ("steps", f"{summary.get('steps')} / {summary.get('target_steps')}"),
        ("final loss", _fmt(summary.get("final_loss"))),
        ("checkpoint mode", _fmt(summary.get("checkpoint_mode"))),
        ("model sha256", _fmt(summary.get("model_sha256", ""))[:16] + "…"),
    ]
    facts = "".join(f"<tr><th>{name}</th><td>{value}</td></tr>" for name, value in headline)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Training goodput</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}</style></head>
<body><h1>Training goodput</h1>
<table>{facts}</table>
<h2>Timeline</h2>
{timeline_svg(events, faults, restarts)}
<h2>Loss and throughput</h2>
<div>{curves_html(events, tokens_per_step)}</div>
<h2>Restarts</h2>
<table><tr><th>fault</th><th>cause</th><th>mechanism</th><th>fault step</th><th>resumed step</th><th>detection s</th>
<th>shutdown s</th><th>startup s</th><th>downtime s</th><th>steps redone</th></tr>{rows}</table>
<p>Goodput is productive step time (each step counted once, in the execution that lasted)
over the run's wall time. Shutdown runs from the fault to the restarted attempt; startup
from there to its first step (process group, model, checkpoint load, loader).</p>
<h2>Stragglers</h2>
{stragglers_html(summary.get("stragglers") or {})}
</body></html>
"""


def stragglers_html(report: dict[str, Any]) -> str:
    """The newest comparison of the ranks' local work (trainer/stragglers.py), slow ranks first."""
    if not report.get("ranks"):
        return "<p>No comparison of the ranks was made (resilience.straggler_every_steps).</p>"
    first, last = report["steps"]
    slow = set(report["slow"])
    verdict = (
        f"<p><b>{', '.join(f'rank {r}' for r in sorted(slow))}</b> took at least {report['threshold']:g}x "
        f"the other ranks' median local work (the optimizer step) over steps {first}-{last}.</p>"
        if slow
        else f"<p>No rank took {report['threshold']:g}x the other ranks' median local work over steps {first}-{last}.</p>"
    )
    ordered = sorted(report["ranks"], key=lambda r: (r["rank"] not in slow, -r["relative"]))
    rows = "".join(
        f"<tr><td>{r['rank']}</td><td>{html.escape(str(r['host']))}</td><td>{r['local_s'] * 1e3:.1f}</td>"
        f"<td>{r['relative']:.2f}</td></tr>"
        for r in ordered
    )
    return f"{verdict}<table><tr><th>rank</th><th>host</th><th>local work, median ms</th><th>x median</th></tr>{rows}</table>"


def write_goodput_report(
    path: str | Path,
    summary: dict[str, Any],
    events: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    tokens_per_step: int = 0,
) -> Path:
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(goodput_html(summary, events, faults, tokens_per_step))
    tmp.replace(target)
    return target
