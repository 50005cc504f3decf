"""A picture of one step's memory: one self-contained HTML file (inline SVG, a few lines of JS).

The step's program points are each block's forward (once it returned), the forward's end (the
loss computed, backward about to start) and each block's backward (once its recompute ran), in
the order they run. At each point the bytes held are stacked by what holds them, from the
audit's numbers (:class:`prime_ac.AuditReport`):

- outside blocks: at a block's forward and backward, what autograd saved outside the blocks
  before that block (``outside_bytes_before``); at the forward's end, everything the step holds
  beyond the blocks (the audit's held bytes less the blocks' kept results and inputs: the
  head's and the loss's saves too);
- block inputs: the inputs of the blocks whose forward ran (each storage once);
- kept: the kept results of those blocks (a budget plan's offloaded ones apart);
- recompute: at a block's backward, what its recompute rebuilds beyond its kept results (what
  autograd saves for it without AC, the audit's no-AC step);
- offloaded: kept results in host memory; a block's own come back to the device for its backward.

The device bytes of a point are the sum of all but the offloaded results not yet back. The
budget line and the measured peak come from a budget plan (or are passed in); hovering a bar
shows its block's decisions. The numbers travel in an embedded JSON blob
(``<script id="prime-ac-data">``) and each bar's ``data-*`` attributes, so tools (and the tests)
read back exactly what is drawn.
"""

from __future__ import annotations

import html
import json
from typing import Any

__all__ = ["KINDS", "step_memory", "to_html", "write"]

# (key, legend, colour), bottom to top
KINDS = (
    ("outside", "outside blocks", "#8c8c8c"),
    ("inputs", "block inputs", "#4e79a7"),
    ("kept", "kept", "#f28e2b"),
    ("recompute", "recompute (backward)", "#59a14f"),
    ("offloaded", "offloaded (host)", "#b07aa1"),
)


def step_memory(report: Any, plan: Any = None, measured_peak: int | None = None) -> dict[str, Any]:
    """The picture's numbers: per program point the bytes of each kind and on the device, per
    block its decisions, and the budget and peaks. ``plan`` (a :class:`prime_ac.planner.Plan`
    over ``report``'s blocks) replaces what the blocks keep and offload by its decisions."""
    blocks = list(report.blocks)
    inputs = [report.block_input_bytes.get(b, 0) for b in blocks]
    audited_kept = [report.block_held_bytes.get(b, 0) for b in blocks]
    if plan is not None:
        chosen = _plan_decisions(plan, blocks)
        offloaded = [_bytes_of(calls, "offload") for calls in chosen]
        kept = [_bytes_of(calls, "keep") for calls in chosen]
        decisions = [[f"{op} {d} {_mib(n)}" for op, d, n in calls] for calls in chosen]
    else:
        offloaded = [report.block_offloaded_bytes.get(b, 0) for b in blocks]
        kept = [k - o for k, o in zip(audited_kept, offloaded, strict=True)]
        decisions = [_audit_decisions(report, b) for b in blocks]
    outside = max(report.held_bytes - sum(audited_kept) - sum(inputs), 0)
    before = [report.outside_bytes_before.get(b, 0) for b in blocks]
    no_ac = [report.block_held_bytes_no_ac.get(b, 0) for b in blocks]
    points = []

    def point(label: str, block: str, i: int, outside_here: int, recompute: int = 0) -> None:
        backward = label.endswith("backward")  # the block's offloaded results are back
        here = {
            "label": label,
            "block": block,
            "outside": outside_here,
            "inputs": sum(inputs[: i + 1]),
            "kept": sum(kept[: i + 1]),
            "recompute": recompute,
            "offloaded": sum(offloaded[: i + 1]),
        }
        here["device"] = (
            outside_here + here["inputs"] + here["kept"] + recompute + backward * offloaded[i]
        )
        points.append(here)

    for i, block in enumerate(blocks):
        point(f"{block} forward", block, i, before[i])
    if blocks:  # the forward's end: what the audit measured held, the saves outside included
        point("forward end", blocks[-1], len(blocks) - 1, outside)
    for i in reversed(range(len(blocks))):
        recompute = max(no_ac[i] - kept[i] - offloaded[i], 0)
        point(f"{blocks[i]} backward", blocks[i], i, before[i], recompute)
    budget = predicted = measured = None
    if plan is not None:
        budget, predicted, measured = plan.budget, plan.simulation.peak, plan.measured
    elif report.peak is not None:
        budget, predicted, measured = report.peak
    if measured_peak is not None:
        measured = measured_peak
    return {
        "mode": report.mode if plan is None else "peak plan",
        "blocks": [
            {
                "block": b,
                "kept": kept[i],
                "offloaded": offloaded[i],
                "inputs": inputs[i],
                "no_ac": no_ac[i],
                "decisions": decisions[i],
            }
            for i, b in enumerate(blocks)
        ],
        "points": points,
        "held_bytes": report.held_bytes,
        "held_bytes_no_ac": report.held_bytes_no_ac,
        "peak": max((p["device"] for p in points), default=0),
        "budget": budget,
        "predicted_peak": predicted,
        "measured_peak": measured,
    }


def _plan_decisions(plan: Any, blocks: list[str]) -> list[list[tuple[str, str, int]]]:
    by_name = {b.name: (b, d) for b, d in zip(plan.blocks, plan.decisions, strict=True)}
    if set(by_name) != set(blocks):
        raise ValueError(
            f"plan: its blocks {sorted(by_name)} are not the report's {blocks}; pass the plan "
            "made from this report (prime_ac.planner.plan(prime_ac.budget.profiles(report), ...))"
        )
    return [
        [
            (f"{c.op}#{c.index}", d, c.bytes)
            for c, d in zip(by_name[b][0].calls, by_name[b][1], strict=True)
        ]
        for b in blocks
    ]


def _bytes_of(calls: list[tuple[str, str, int]], decision: str) -> int:
    return sum(n for _, d, n in calls if d == decision)


def _audit_decisions(report: Any, block: str) -> list[str]:
    rows = sorted(
        (r for r in report.ops if r.block == block),
        key=lambda r: (-r.kept_bytes, -r.replayed_flops, r.op),
    )
    return [
        f"{r.op} {r.decision} x{r.calls}"
        + (f" {_mib(r.kept_bytes)}" if r.kept_bytes else "")
        + (f" replays {r.replays}" if r.replays else "")
        for r in rows
    ]


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB"


# --- drawing ------------------------------------------------------------------------------------

_BAR, _GAP, _LEFT, _TOP, _PLOT_H, _BOTTOM = 28, 8, 72, 20, 300, 120


def to_html(data: dict[str, Any]) -> str:
    """The HTML page for :func:`step_memory`'s numbers."""
    points = data["points"]
    top = max(
        [p["device"] + p["offloaded"] for p in points]
        + [data[k] or 0 for k in ("budget", "predicted_peak", "measured_peak")]
        + [1]
    )
    width = _LEFT + len(points) * (_BAR + _GAP) + 200
    height = _TOP + _PLOT_H + _BOTTOM

    def y(nbytes: float) -> float:
        return _TOP + _PLOT_H - nbytes / top * _PLOT_H

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" data-top="{top}" data-plot-height="{_PLOT_H}" '
        f'data-plot-top="{_TOP}" font-family="sans-serif" font-size="11">',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    for k in range(5):  # the axis: five ticks in MiB
        value = top * k / 4
        parts.append(
            f'<line x1="{_LEFT - 4}" x2="{width - 200}" y1="{y(value):.2f}" y2="{y(value):.2f}" '
            f'stroke="#e0e0e0"/><text x="{_LEFT - 6}" y="{y(value) + 4:.2f}" '
            f'text-anchor="end">{value / 2**20:.2f} MiB</text>'
        )
    blocks = {b["block"]: b for b in data["blocks"]}
    for i, p in enumerate(points):
        x = _LEFT + i * (_BAR + _GAP)
        tip = html.escape(
            f"{p['label']}: {_mib(p['device'])} on the device\n"
            + "\n".join(f"{legend}: {_mib(p[key])}" for key, legend, _ in KINDS)
            + "\n"
            + "\n".join(blocks[p["block"]]["decisions"])
        )
        parts.append(
            f'<g class="point" data-index="{i}" data-label="{html.escape(p["label"])}" '
            f'data-block="{html.escape(p["block"])}" data-device="{p["device"]}">'
            f"<title>{tip}</title>"
        )
        base = 0
        for key, _, colour in KINDS:
            nbytes = p[key]
            if nbytes:
                y0, y1 = y(base + nbytes), y(base)
                opacity = ' fill-opacity="0.55"' if key == "offloaded" else ""
                parts.append(
                    f'<rect class="bar" data-kind="{key}" data-bytes="{nbytes}" x="{x}" '
                    f'y="{y0:.2f}" width="{_BAR}" height="{y1 - y0:.2f}" fill="{colour}"{opacity}/>'
                )
            base += nbytes
        parts.append(
            f'<text transform="translate({x + _BAR / 2 + 4},{_TOP + _PLOT_H + 8}) rotate(60)" '
            f'font-size="10">{html.escape(p["label"])}</text></g>'
        )
    right = width - 200
    levels = [
        (key, legend, colour, dash)
        for key, legend, colour, dash in (
            ("budget", "budget", "#e15759", ' stroke-dasharray="6,4"'),
            ("predicted_peak", "predicted peak", "#17becf", ' stroke-dasharray="2,3"'),
            ("measured_peak", "measured peak", "#000000", ""),
        )
        if data[key] is not None
    ]
    label_y = -1e9
    for key, legend, colour, dash in sorted(levels, key=lambda level: y(data[level[0]])):
        value = data[key]
        label_y = max(y(value) + 4, label_y + 13)  # labels of close levels one under another
        parts.append(
            f'<line class="level" data-kind="{key}" data-bytes="{value}" x1="{_LEFT}" '
            f'x2="{right}" y1="{y(value):.2f}" y2="{y(value):.2f}" stroke="{colour}" '
            f'stroke-width="2"{dash}/><text x="{right + 4}" y="{label_y:.2f}" '
            f'fill="{colour}">{legend} {_mib(value)}</text>'
        )
    for k, (_, legend, colour) in enumerate(reversed(KINDS)):
        ly = _TOP + _PLOT_H - (len(KINDS) - k) * 18  # bottom right, clear of the level labels
        parts.append(
            f'<rect x="{right + 4}" y="{ly}" width="12" height="12" fill="{colour}"/>'
            f'<text x="{right + 20}" y="{ly + 10}">{legend}</text>'
        )
    parts.append("</svg>")
    blob = json.dumps(data, indent=1).replace("</", "<\\/")
    title = (
        f"prime_ac: held bytes over the step ({data['mode']}): drawn peak "
        f"{_mib(data['peak'])} on the device"
        + (f", budget {_mib(data['budget'])}" if data["budget"] is not None else "")
        + (
            f", measured peak {_mib(data['measured_peak'])}"
            if data["measured_peak"] is not None
            else ""
        )
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>prime_ac step memory</title>
<style>body{{font-family:sans-serif;margin:16px;background:#fff}}
#detail{{font-size:12px;background:#f6f6f6;padding:8px;min-height:3em;white-space:pre-wrap}}
.point:hover rect.bar{{stroke:#000;stroke-width:1}}</style></head>
<body><h3>{html.escape(title)}</h3>
{"".join(parts)}
<pre id="detail">Hover a bar for its block's decisions (JavaScript is off).</pre>
<script type="application/json" id="prime-ac-data">{blob}</script>
<script>
const data = JSON.parse(document.getElementById("prime-ac-data").textContent);
const blocks = Object.fromEntries(data.blocks.map(b => [b.block, b]));
const mib = n => (n / 1048576).toFixed(3) + " MiB";
const show = i => {{
  const p = data.points[i], b = blocks[p.block];
  document.getElementById("detail").textContent = p.label + ": " + mib(p.device) +
    " on the device\\n" + b.decisions.join("\\n");
}};
for (const g of document.querySelectorAll("g.point")) {{
  g.addEventListener("mouseenter", () => show(+g.dataset.index));
}}
if (data.points.length) {{  // the peak's decisions until a bar is hovered
  show(data.points.reduce((m, p, i, all) => (p.device > all[m].device ? i : m), 0));
}}
</script></body></html>
"""


def write(
    report: Any, path: str, plan: Any = None, measured_peak: int | None = None
) -> dict[str, Any]:
    """Write ``report``'s step (with ``plan``'s decisions, see :func:`step_memory`) to ``path``
    as one self-contained HTML file; returns the numbers drawn.

    Example::

        report = prime_ac.audit(model, loss_fn)
        prime_ac.report_html.write(report, "step.html")  # or report.to_html("step.html")
    """
    data = step_memory(report, plan, measured_peak)
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_html(data))
    return data
