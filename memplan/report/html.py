"""Render a :class:`~memplan.report.data.MemoryReport` as one self-contained HTML file.

No fonts, no network: inline CSS and SVG, and one short inline script (the graph's module filter;
the rest of the page works without it), so the file opens anywhere and can be attached to an issue.
Every string that comes from the user's model (names, source lines, notes) is escaped. Hover a box or
a band for details (SVG ``<title>`` tooltips), and a pass's plain note for its technical one.

The graph's filter also reads the page address: ``report.html#module=encoder.layers.1`` opens the graph
filtered to the modules whose path contains ``encoder.layers.1``.

The renderer reads the report's fields and imports nothing from :mod:`memplan.report.data`, whose
``MemoryReport.save_html`` calls it: a timeline's bands stack in the order of its series (bottom to top).
"""

from __future__ import annotations

import html
import math
import zlib

from memplan.analysis.explain_text import torch_line
from memplan.analysis.groups import largest_modules
from memplan.measure import format_bytes

__all__ = ["render_html"]

COLOURS = {
    "parameters": "#9aa5b1",
    "saved for backward": "#d9534f",
    "temporaries": "#f0ad4e",
    "gradients": "#5bc0de",
    "outputs": "#5cb85c",
}
MAX_POINTS = 1200

CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2rem auto; max-width: 1200px;
       color: #222; padding: 0 1rem; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.25rem; margin-top: 2.2rem; border-bottom: 1px solid #ddd; }
.headline { font-size: 1.15rem; background: #f4f6f8; padding: .8rem 1rem; border-radius: 6px; }
table { border-collapse: collapse; margin: .6rem 0; font-size: .9rem; }
th, td { border: 1px solid #ddd; padding: .3rem .55rem; text-align: left; vertical-align: top; }
th { background: #f4f6f8; } td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.legend span { display: inline-block; margin-right: 1rem; font-size: .85rem; }
.legend i { display: inline-block; width: .9rem; height: .9rem; margin-right: .3rem; vertical-align: -2px; }
svg { background: #fff; } .muted { color: #666; font-size: .85rem; }
code { font-size: .85rem; }
.diagnosis { font-weight: 600; background: #fff7e6; padding: .5rem .8rem; border-left: 4px solid #f0ad4e; }
.bar { display: inline-block; height: .7rem; background: #90caf9; vertical-align: middle; }
td.layer { white-space: nowrap; }
.meta { color: #555; font-size: .85rem; margin-top: -.6rem; }
.counts { color: #444; font-size: .9rem; margin: .4rem 0 0; }
td.note span[title] { text-decoration: underline dotted #999; cursor: help; }
details.graph > summary { cursor: pointer; font-size: 1.05rem; margin: .6rem 0; }
.filter { margin: .4rem 0 .6rem; } .filter input { font: inherit; padding: .2rem .4rem; width: 22rem; }
"""

# What each of memplan's passes does, in plain words (a pass registered elsewhere is named).
PLAIN_PASSES = {
    "rewrite": "rewrites ops that would copy a broadcast tensor, or keep a whole product, into ops that do not",
    "chunk": "computes a huge intermediate that is reduced right away in slices, one slice at a time",
    "remat": "recomputes cheap activations during the backward instead of keeping them from the forward",
    "inplace": "writes results into inputs that nothing reads any more",
    "timesteps": "keeps only some steps of an unrolled loop for the backward and recomputes the others",
    "concat": "fills concatenations part by part, so each part is freed as soon as it is copied",
    "schedule": "reorders independent ops so that fewer tensors are alive at once",
    "arena": "lays every tensor out at a fixed offset of one buffer (a plan only; the graph is unchanged)",
}

# The graph's module filter: hides the boxes whose module path does not contain the text, moves the rest
# up, hides the edges while a filter is set. Reads #module=... from the address on load.
FILTER_JS = """
(function () {
  var svg = document.getElementById('graph-svg');
  var input = document.getElementById('graph-filter');
  if (!svg || !input) return;
  var rowH = +svg.getAttribute('data-row-height');
  var boxes = svg.querySelectorAll('g.box');
  var edges = svg.querySelectorAll('path.edge');
  var status = document.getElementById('graph-filter-status');
  function apply() {
    var q = input.value.trim().toLowerCase();
    var shown = 0;
    for (var i = 0; i < boxes.length; i++) {
      var g = boxes[i];
      var hit = !q || g.getAttribute('data-module').toLowerCase().indexOf(q) >= 0;
      g.style.display = hit ? '' : 'none';
      g.setAttribute('transform', 'translate(0,' + (shown - i) * rowH + ')');
      if (hit) shown++;
    }
    for (var j = 0; j < edges.length; j++) edges[j].style.display = q ? 'none' : '';
    svg.setAttribute('height', shown * rowH + 20);
    status.textContent = q ? shown + ' of ' + boxes.length + ' boxes made in modules matching \u201c' + q + '\u201d'
                           : boxes.length + ' boxes';
  }
  input.addEventListener('input', apply);
  var m = /[#&]module=([^&]*)/.exec(location.hash);
  if (m) {
    input.value = decodeURIComponent(m[1]);
    document.getElementById('graph-details').open = true;
    document.getElementById('graph').scrollIntoView();
  }
  apply();
})();
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _downsample(values: list[int], buckets: int) -> list[int]:
    """Max per bucket: a timeline drawn smaller than its steps keeps its peaks."""
    if len(values) <= buckets:
        return values
    size = len(values) / buckets
    return [max(values[int(i * size) : max(int((i + 1) * size), int(i * size) + 1)]) for i in range(buckets)]


def _timeline_svg(timeline, scale_max: int, width: int = 1100, height: int = 260) -> str:
    n = len(timeline.steps)
    if n == 0:
        return "<p class='muted'>empty graph</p>"
    buckets = min(n, MAX_POINTS)
    stacked: list[list[int]] = []
    base = [0] * buckets
    layers = []
    for cat in timeline.series:
        values = _downsample(list(timeline.series[cat]), buckets)
        top = [b + v for b, v in zip(base, values)]
        layers.append((cat, list(base), top))
        stacked.append(top)
        base = top
    pad_left, pad_top, pad_bottom = 70, 24, 22
    plot_w, plot_h = width - pad_left - 10, height - pad_bottom - pad_top
    ymax = max(scale_max, 1)

    def x(i: int) -> float:
        return pad_left + (i / max(buckets - 1, 1)) * plot_w

    def y(v: int) -> float:
        return pad_top + plot_h - v / ymax * plot_h

    parts = [f"<svg width='{width}' height='{height}' role='img' aria-label='{_e(timeline.label)} memory timeline'>"]
    # backward region shading, named under the axis (the strip above the plot is the peak label's)
    phases = timeline.phases
    first_backward = next((i for i, p in enumerate(phases) if p == "backward"), None)
    if first_backward is not None:
        xb = pad_left + first_backward / max(n - 1, 1) * plot_w
        parts.append(f"<rect x='{xb:.1f}' y='{pad_top}' width='{pad_left + plot_w - xb:.1f}' height='{plot_h}' fill='#f2f7fb'/>")
        parts.append(f"<text x='{xb + 4:.1f}' y='{height - 6}' font-size='11' fill='#4a7fa5'>backward →</text>")
    for cat, lower, upper in layers:
        if not any(u - lo for u, lo in zip(upper, lower)):
            continue
        points = [f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(upper)]
        points += [f"{x(i):.1f},{y(v):.1f}" for i, v in reversed(list(enumerate(lower)))]
        parts.append(
            f"<polygon points='{' '.join(points)}' fill='{COLOURS[cat]}' fill-opacity='0.85'>"
            f"<title>{_e(cat)}</title></polygon>"
        )
    # axes and peak marker
    parts.append(f"<line x1='{pad_left}' y1='{pad_top + plot_h}' x2='{pad_left + plot_w}' y2='{pad_top + plot_h}' stroke='#888'/>")
    for frac in (0, 0.5, 1):
        value = int(ymax * frac)
        parts.append(f"<text x='{pad_left - 6}' y='{y(value) + 4:.1f}' font-size='11' text-anchor='end'>{_e(format_bytes(value))}</text>")
    if timeline.peak_index >= 0:
        px = pad_left + timeline.peak_index / max(n - 1, 1) * plot_w
        peak_total = timeline.peak + timeline.series["parameters"][0]
        parts.append(f"<line x1='{px:.1f}' y1='{pad_top - 4}' x2='{px:.1f}' y2='{pad_top + plot_h}' stroke='#222' stroke-dasharray='4 3'/>")
        label = f"peak {format_bytes(timeline.peak)} at {timeline.steps[timeline.peak_index]}"
        # about 7 px a character at 12 px: a label that would cross the right edge ends at the line instead
        anchor, lx = ("end", px - 4) if px + 4 + 7 * len(label) > width - 4 else ("start", px + 4)
        parts.append(
            f"<text x='{lx:.1f}' y='{max(y(peak_total) - 5, 14):.1f}' font-size='12' text-anchor='{anchor}' "
            f"class='peak-label'>{_e(label)}</text>"
        )
    parts.append(f"<text x='{pad_left}' y='{height - 6}' font-size='11' fill='#666'>forward</text>")
    parts.append(
        f"<text x='{pad_left + plot_w}' y='{height - 6}' font-size='11' fill='#666' text-anchor='end'>"
        f"{n} ops, in execution order</text>"
    )
    parts.append("</svg>")
    return "".join(parts)


def _storage_colour(storage: int | None) -> str:
    if storage is None:
        return "#cfd8dc"
    hue = (zlib.crc32(str(storage).encode()) % 360)
    return f"hsl({hue},60%,62%)"


def _graph_svg(view, width: int = 1100) -> str:
    groups = view.groups
    if not groups:
        return "<p class='muted'>no ops</p>"
    row_h, box_x, arc_x = 18, 360, 350
    height = len(groups) * row_h + 20
    biggest = max((g.nbytes for g in groups), default=1) or 1
    parts = [f"<svg id='graph-svg' width='{width}' height='{height}' role='img' aria-label='graph' "
             f"data-row-height='{row_h}'>"]
    for a, b in view.edges:
        ya, yb = 10 + a * row_h + row_h / 2, 10 + b * row_h + row_h / 2
        bend = min(arc_x - 10, 8 + abs(b - a) * 3)
        parts.append(
            f"<path d='M{arc_x},{ya:.1f} C{arc_x - bend},{ya:.1f} {arc_x - bend},{yb:.1f} {arc_x},{yb:.1f}' "
            "fill='none' stroke='#b0bec5' stroke-width='1' class='edge'/>"
        )
    for i, g in enumerate(groups):
        y = 10 + i * row_h
        w = 8 + (math.log2(1 + g.nbytes) / math.log2(1 + biggest)) * 420 if g.nbytes else 4
        colour = _storage_colour(g.storage) if not view.collapsed else ("#ef9a9a" if g.phase == "backward" else "#90caf9")
        count = f" ×{g.count}" if g.count > 1 else ""
        tip = f"{g.op}{count} — {format_bytes(g.nbytes)} allocated — {g.phase}"
        if g.source:
            tip += f" — {g.source}"
        if g.module is not None:
            tip += f" — in {g.module or '(model)'}"
        if g.shares_with:
            tip += f" — shares its storage with {g.shares_with} other node(s)"
        module = "" if g.module is None else (g.module or "(model)")
        in_module = f" <tspan fill='#7a8a99'>{_e(module)}</tspan>" if module else ""
        parts.append(
            f"<g class='box' data-module='{_e(module)}'><title>{_e(tip)}</title>"
            f"<rect x='{box_x}' y='{y + 2}' width='{w:.1f}' height='{row_h - 4}' rx='3' fill='{colour}'/>"
            f"<text x='{box_x + w + 6:.1f}' y='{y + row_h - 5}' font-size='11'>{_e(g.label)}{_e(count)} "
            f"<tspan fill='#666'>{_e(format_bytes(g.nbytes))}</tspan>"
            f"{in_module}</text>"
            f"<text x='{arc_x - 4 - 0}' y='{y + row_h - 5}' font-size='10' text-anchor='end' fill='#555'>"
            f"{_e((g.source or '')[:52])}</text></g>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _explain_table(explanation) -> str:
    if explanation is None or not explanation.tensors:
        return "<p class='muted'>no memory is allocated</p>"
    rows = []
    for t in explanation.tensors:
        share = t.nbytes / explanation.peak if explanation.peak else 0
        made = t.op + (f" in {t.module or '(model)'}" if t.module is not None else "")
        made += f": {t.provenance}" if t.provenance else ""
        rows.append(
            f"<tr><td class='num'>{_e(format_bytes(t.nbytes))}</td><td class='num'>{share:.1%}</td>"
            f"<td><code>{_e(list(t.shape))}</code> {_e(str(t.dtype).replace('torch.', ''))}</td>"
            f"<td>{_e(made)}</td><td><code>{_e(t.source or '-')}</code></td><td>{_e(t.reason)}</td></tr>"
        )
    return (
        f"<p>{_e(explanation._headline())}</p><table><tr><th>bytes</th><th>share</th><th>tensor</th><th>made by</th>"
        f"<th>source line</th><th>alive because</th></tr>{''.join(rows)}</table>"
    )


def _share_cell(nbytes: int, peak: int) -> str:
    share = nbytes / peak if peak else 0.0
    return (f"<td class='num'>{share:.1%}</td>"
            f"<td><span class='bar' style='width:{max(share * 160, 1):.0f}px'></span></td>")


def _groups_html(explanation, rows: int = 30) -> str:
    """What holds the peak in groups: the diagnosis, the kinds, the layers (as a tree, the ``rows`` largest)
    and the lines of code."""
    if explanation is None or not explanation.kinds:
        return "<p class='muted'>no memory is allocated</p>"
    peak = explanation.peak
    parts = []
    if explanation.diagnosis:
        parts.append(f"<p class='diagnosis'>{_e(explanation.diagnosis)}</p>")
    in_peak = [k for k in explanation.kinds if k.share is not None]
    kinds = "".join(
        f"<tr><td>{_e(k.kind)}</td><td class='num'>{k.count}</td><td class='num'>{_e(format_bytes(k.nbytes))}</td>"
        f"{_share_cell(k.nbytes, peak)}</tr>" for k in in_peak
    )
    parts.append(f"<table><tr><th>kind</th><th>tensors</th><th>bytes</th><th colspan='2'>share</th></tr>{kinds}</table>")
    beside = [k for k in explanation.kinds if k.share is None]
    if beside:
        held = ", ".join(f"{k.kind} {format_bytes(k.nbytes)} ({k.count})" for k in beside)
        parts.append(f"<p class='muted'>held besides the peak (they exist before the call): {_e(held)}</p>")
    shown = largest_modules(explanation.modules, rows)
    if shown:
        layer_rows = [
            f"<tr><td class='layer' style='padding-left:{0.55 + 1.2 * m.depth:.2f}rem'><code>{_e(m.path or '(model)')}</code>"
            f"</td><td class='num'>{m.count}</td><td class='num'>{_e(format_bytes(m.nbytes))}</td>"
            f"{_share_cell(m.nbytes, peak)}</tr>"
            for m in shown
        ]
        layer_rows += [
            f"<tr><td class='layer'>(outside the model's modules)</td><td class='num'>{m.count}</td>"
            f"<td class='num'>{_e(format_bytes(m.nbytes))}</td>{_share_cell(m.nbytes, peak)}</tr>"
            for m in explanation.modules if m.path is None
        ]
        named = sum(1 for m in explanation.modules if m.path is not None)
        more = f"<p class='muted'>{named - len(shown)} smaller layers not shown</p>" if named > len(shown) else ""
        parts.append(
            "<h4>by layer (a layer's bytes include its sublayers')</h4>"
            f"<table><tr><th>layer</th><th>tensors</th><th>bytes</th><th colspan='2'>share</th></tr>{''.join(layer_rows)}"
            f"</table>{more}"
        )
    if explanation.lines:
        line_rows = "".join(
            f"<tr><td><code>{_e(line.source or '(no line of yours)')}</code></td>"
            f"<td><code>{_e(torch_line(line.library_source) if line.library_source else '')}</code></td>"
            f"<td class='num'>{line.count}</td><td class='num'>{_e(format_bytes(line.nbytes))}</td>"
            f"{_share_cell(line.nbytes, peak)}</tr>"
            for line in explanation.lines[:rows]
        )
        parts.append(
            "<h4>by line</h4><table><tr><th>your line</th><th>torch's line beneath</th><th>tensors</th><th>bytes</th>"
            f"<th colspan='2'>share</th></tr>{line_rows}</table>"
        )
    return "".join(parts)


def _step(report) -> str:
    return "one training step (forward and backward)" if report.training else "one inference call"


def _headline(report) -> str:
    """The peak(s), saying what they count: bytes allocated during the step, parameters and inputs beside."""
    params = report.parameter_bytes
    if report.after is None:
        text = f"predicted peak {format_bytes(report.before.peak)}"
    else:
        ratio = report.after.peak / report.before.peak if report.before.peak else 1.0
        text = (
            f"predicted peak {format_bytes(report.before.peak)} as written → {format_bytes(report.after.peak)} "
            f"with memplan's plan ({ratio:.1%})"
        )
    text += f": the most bytes allocated at once during {_step(report)}"
    held = f"{format_bytes(params)} of parameters and buffers (the grey band of the charts) and the inputs" if params else "the inputs"
    return text + f", on top of {held}, which exist before it."


def _meta_line(report) -> str:
    parts = [f"torch {report.torch_version}", f"memplan {report.memplan_version}", f"device {report.device}"]
    if report.created:
        parts.append(report.created)
    return " · ".join(parts)


def _pass_note(p) -> tuple[str, str]:
    """A pass's row note: a plain sentence, and the pass's own notes (shown as its tooltip)."""
    what = PLAIN_PASSES.get(p.name, f"the pass {p.name}")
    what = what[0].upper() + what[1:]
    if p.rolled_back is not None:
        plain = f"{what}. Left out: it broke a check memplan runs after every pass, so the plan is made without it."
    elif not p.changed:
        plain = f"{what}. Nothing to do here: the graph is unchanged."
    elif p.bytes_saved > 0:
        plain = f"{what}. The peak falls by {format_bytes(p.bytes_saved)}."
    elif p.bytes_saved < 0:
        plain = f"{what}. The peak rises by {format_bytes(-p.bytes_saved)}; a later pass builds on it."
    else:
        plain = f"{what}. The peak stays where it was."
    if p.changed and p.recompute_added > 0:
        plain = plain[:-1] + f", for {p.recompute_added:.1%} more compute."
    return plain, "; ".join(p.notes)


def _passes_html(report) -> str:
    if not report.passes:
        return "<p class='muted'>no passes ran (analysis only, or the empty pipeline)</p>"
    rows = []
    for p in report.passes:
        plain, technical = _pass_note(p)
        note = f"<span title='{_e(technical)}'>{_e(plain)}</span>" if technical else _e(plain)
        rows.append(
            f"<tr><td>{_e(p.name)}</td><td>{'rolled back' if p.rolled_back is not None else 'yes' if p.changed else 'no'}</td>"
            f"<td class='num'>{_e(format_bytes(p.peak_before))}</td><td class='num'>{_e(format_bytes(p.peak_after))}</td>"
            f"<td class='num'>{_e(format_bytes(p.bytes_saved))}</td><td class='num'>+{p.recompute_added:.1%}</td>"
            f"<td class='num'>{p.nodes_rewritten}</td><td class='num'>{p.seconds:.3f}</td><td class='note'>{note}</td></tr>"
        )
    first, last = report.passes[0].peak_before, report.passes[-1].peak_after
    eager = report.before.peak
    caption = (
        "Peaks in this table count each tensor as freed right after its last use, the way memplan's plan runs. "
    )
    if first < eager:
        caption += (
            f"So the first pass starts from {format_bytes(first)}, {format_bytes(eager - first)} below the "
            f"{format_bytes(eager)} of the model as written: run eagerly, your code's Python references (local "
            "variables, lists) keep some tensors alive after their last use. "
        )
    else:
        caption += f"The first pass starts from the peak of the model as written, {format_bytes(eager)}. "
    if report.after is not None and last == report.after.peak:
        caption += f"The last pass ends at the plan's peak, {format_bytes(last)}."
    elif report.after is not None:
        caption += f"The plan's predicted peak is {format_bytes(report.after.peak)}."
    return (
        f"<p class='muted' id='passes-counts'>{_e(caption)}</p>"
        "<table><tr><th>pass</th><th>changed</th><th>peak before</th><th>peak after</th><th>bytes saved</th>"
        f"<th>recompute added</th><th>nodes rewritten</th><th>seconds</th><th>what it did</th></tr>{''.join(rows)}</table>"
    )


def render_html(report) -> str:
    """The report as one HTML document (a string)."""
    params = report.parameter_bytes
    before_total = report.before.peak + params
    scale = max(before_total, (report.after.peak + params) if report.after is not None else 0)
    legend = "".join(f"<span><i style='background:{COLOURS[c]}'></i>{_e(c)}</span>" for c in report.before.series)
    sections = [
        f"<h1>{_e(report.title)}</h1>",
        f"<p class='meta' id='environment'>{_e(_meta_line(report))}</p>",
        f"<p class='headline' id='headline'>{_e(_headline(report))}</p>",
        "<h2 id='timeline'>Memory timeline</h2>",
        f"<div class='legend'>{legend}</div>",
        f"<p class='counts'>The charts stack the parameters and buffers ({_e(format_bytes(params))}) under what "
        f"{_e(_step(report))} allocates; a chart's peak label counts only the latter.</p>",
        f"<h3>{_e(report.before.label)}</h3>",
        _timeline_svg(report.before, scale),
    ]
    if report.after is not None:
        sections += [f"<h3>{_e(report.after.label)}</h3>", _timeline_svg(report.after, scale)]
    sections += ["<h2 id='passes'>Passes</h2>", _passes_html(report)]
    sections += ["<h2 id='layers'>What holds the peak, by kind, layer and line</h2>", "<h3>as written</h3>",
                 _groups_html(report.explain_before)]
    if report.explain_after is not None:
        sections += ["<h3>with memplan's plan</h3>", _groups_html(report.explain_after)]
    sections += ["<h2 id='peak'>Tensors alive at the peak</h2>", "<h3>as written</h3>", _explain_table(report.explain_before)]
    if report.explain_after is not None:
        sections += ["<h3>with memplan's plan</h3>", _explain_table(report.explain_after)]
    view = report.graph
    note = (
        f"{view.nodes} ops collapsed into {len(view.groups)} boxes by module, source line and op (repeated timesteps of a loop "
        "share one box, ×count); blue forward, red backward."
        if view.collapsed
        else f"{view.nodes} ops; one colour per storage: boxes of one colour share memory."
    )
    which = "memplan's plan" if report.after is not None else "the model as written"
    sections += [
        "<h2 id='graph'>Graph</h2>",
        f"<details class='graph' id='graph-details'><summary>Show the graph of {_e(which)} ({len(view.groups)} boxes)</summary>",
        f"<p class='muted'>{_e(note)} Box length grows with the bytes an op allocates; hover for details.</p>",
        "<div class='filter'><label>Filter by module path: <input id='graph-filter' type='search' "
        "placeholder='e.g. encoder.layers.1' autocomplete='off'></label> <span class='muted' id='graph-filter-status'>"
        f"{len(view.groups)} boxes</span></div>",
        _graph_svg(view),
        "</details>",
    ]
    body = "\n".join(sections)
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{_e(report.title)}</title><style>{CSS}</style></head><body>\n{body}\n"
        f"<p class='muted'>made by memplan {_e(report.memplan_version)}</p><script id='graph-filter-script'>{FILTER_JS}</script></body></html>\n"
    )
