"""The HTML report: self-contained, every section present, escaped, and it renders in Chromium."""

import html
import re
import shutil
import struct
import subprocess
import tempfile
import zlib

import pytest
import torch
from torch import nn

import memplan
import memplan.examples as examples
from memplan.measure import format_bytes
from memplan.report.html import _headline, _timeline_svg, render_html
from memplan.steps import step_fn

SECTIONS = ("id='timeline'", "id='passes'", "id='layers'", "id='peak'", "id='graph'")


@pytest.fixture(scope="module")
def seq2seq_report(tmp_path_factory):
    w = examples.make("seq2seq")
    opt = memplan.optimize(w.model)
    step_fn(opt, w.inputs, train=True)()
    path = tmp_path_factory.mktemp("report") / "seq2seq.html"
    opt.report().save_html(str(path))
    return path


def test_every_section_is_present_and_self_contained(seq2seq_report):
    text = seq2seq_report.read_text()
    for section in SECTIONS:
        assert section in text
    assert "as written (eager)" in text and "memplan plan" in text
    # collapsed: the unrolled loops of seq2seq become one box per source line
    assert "collapsed into" in text and "×" in text
    # no network: nothing is fetched; the one script is inline
    for needle in ("http://", "https://", "<script src", "<link", "@import"):
        assert needle not in text
    assert text.count("<script") == 1
    # the graph is collapsed by default
    assert "<details class='graph' id='graph-details'>" in text


class Sneaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return (x @ self.w).clamp(min=0) * (x < 1)  # <b>not markup</b> & "quotes"


def test_user_strings_are_escaped(tmp_path):
    a = memplan.analyze(Sneaky(), torch.randn(4, 8))
    path = tmp_path / "r.html"
    a.report(title="<script>alert(1)</script>").save_html(str(path))
    text = path.read_text()
    assert "<script>" not in text and "&lt;script&gt;" in text
    assert "<b>not markup</b>" not in text and "(x &lt; 1)" in text


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


class Stack(nn.Module):
    def __init__(self, d=32, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(d), "mlp": Mlp(d)}) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = x + block["mlp"](block["norm"](x))
        return x


def test_the_report_groups_the_peak_by_layer(tmp_path):
    a = memplan.analyze(Stack(), torch.randn(64, 32))
    explanation = a.explain()
    path = tmp_path / "r.html"
    a.report().save_html(str(path))
    text = path.read_text()
    layers = text[text.index("id='layers'") : text.index("id='peak'")]
    shown = [m.path for m in explanation.modules if m.path]
    assert "blocks.1.mlp.act" in shown
    for name in shown:
        assert f"<code>{name}</code>" in layers
    # a sublayer sits deeper in the tree than its layer
    assert layers.index("<code>blocks.1</code>") < layers.index("<code>blocks.1.mlp.act</code>")
    assert html.escape(explanation.diagnosis, quote=True) in layers
    assert "torch/nn/modules/linear.py" in layers and "test_html.py" in layers


def _png_has_content(png: bytes) -> bool:
    """Inflate the IDAT chunks: a blank page gives almost a single repeated byte."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, data = 8, b""
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind = png[pos + 4 : pos + 8]
        if kind == b"IDAT":
            data += png[pos + 8 : pos + 8 + length]
        pos += 12 + length
    pixels = zlib.decompress(data)
    return len(set(pixels)) > 20


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
def test_renders_in_headless_chromium_without_console_errors(seq2seq_report, tmp_path):
    shot = tmp_path / "shot.png"
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [
                CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--window-size=1280,2000",
                f"--screenshot={shot}", seq2seq_report.as_uri(),
            ],
            capture_output=True, text=True, timeout=120,
        )
    assert shot.exists(), proc.stderr[-2000:]
    assert _png_has_content(shot.read_bytes())
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console


def _plan_report(model, inputs):
    opt = memplan.optimize(model)
    step_fn(opt, inputs, train=True)()
    return opt.plan, opt.report()


def test_the_headline_and_the_passes_table_say_what_they_count():
    plan, report = _plan_report(Stack(d=32, depth=3), (torch.randn(64, 32),))
    text = render_html(report)
    headline = html.unescape(re.search(r"<p class='headline' id='headline'>(.*?)</p>", text).group(1))
    assert headline.startswith(f"predicted peak {format_bytes(plan.eager_peak)} as written → "
                               f"{format_bytes(plan.planned_peak)} with memplan's plan")
    assert "one training step (forward and backward)" in headline
    assert f"on top of {format_bytes(report.parameter_bytes)} of parameters and buffers" in headline
    counts = html.unescape(re.search(r"<p class='muted' id='passes-counts'>(.*?)</p>", text).group(1))
    first = report.passes[0].peak_before
    assert first <= plan.eager_peak  # graph lifetimes never hold a tensor longer than eager ones
    if first < plan.eager_peak:
        assert f"starts from {format_bytes(first)}, {format_bytes(plan.eager_peak - first)} below" in counts
    else:
        assert f"starts from the peak of the model as written, {format_bytes(plan.eager_peak)}" in counts
    assert report.passes[-1].peak_after == plan.planned_peak
    assert f"ends at the plan's peak, {format_bytes(plan.planned_peak)}" in counts


class HeldTooLong(nn.Module):
    """Keeps the first activation in a local variable to the end: eager holds it, a plan frees it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 64)

    def forward(self, x):
        h = self.a(x)
        y = torch.tanh(h)
        out = self.b(y)
        big = torch.zeros(4096, 64)  # dead at once; `big` keeps it to the end of forward
        return out + h.sum() * 0 + big[:1].sum() * 0


def test_a_difference_between_the_headline_and_the_first_pass_is_named():
    plan, report = _plan_report(HeldTooLong(), (torch.randn(32, 64),))
    counts = html.unescape(re.search(r"id='passes-counts'>(.*?)</p>", render_html(report)).group(1))
    first = report.passes[0].peak_before
    assert first < plan.eager_peak
    assert f"{format_bytes(plan.eager_peak - first)} below the {format_bytes(plan.eager_peak)}" in counts
    assert "Python references" in counts


def test_every_pass_note_is_plain_with_its_technical_note_as_tooltip():
    _, report = _plan_report(Stack(d=32, depth=3), (torch.randn(64, 32),))
    text = render_html(report)
    notes = re.findall(r"<td class='note'>(.*?)</td>", text)
    assert len(notes) == len(report.passes)
    for p, note in zip(report.passes, notes):
        technical = html.escape("; ".join(p.notes), quote=True)
        if p.notes:
            assert note.startswith(f"<span title='{technical}'>")
        shown = html.unescape(re.sub(r"<[^>]+>", "", note))
        assert shown.endswith(".") and shown[0].isupper()
        if p.notes:
            assert "; ".join(p.notes) not in shown  # the jargon stays in the tooltip
    changed = [p for p in report.passes if p.changed and p.bytes_saved > 0]
    assert changed, "the plan should lower the peak of this model"
    assert f"The peak falls by {format_bytes(changed[0].bytes_saved)}" in text


def test_the_meta_line_names_torch_memplan_the_device_and_the_date():
    _, report = _plan_report(Stack(), (torch.randn(16, 32),))
    text = render_html(report)
    meta = html.unescape(re.search(r"<p class='meta' id='environment'>(.*?)</p>", text).group(1))
    assert meta.startswith(f"torch {torch.__version__} · memplan {memplan.__version__} · device cpu · ")
    assert re.search(r"· \d{4}-\d\d-\d\d \d\d:\d\d", meta)


def test_the_peak_label_stays_inside_the_chart():
    # a peak at the very end of the timeline (the last op is the largest) puts the marker at the right edge
    class LastIsLargest(nn.Module):
        def forward(self, x):
            return (x * 2).repeat(64, 1)

    report = memplan.analyze(LastIsLargest(), torch.randn(8, 8), train=False).report()
    svg = _timeline_svg(report.before, report.before.peak)
    label = re.search(r"<text x='([\d.]+)' y='[\d.]+' font-size='12' text-anchor='(\w+)' class='peak-label'>(.*?)</text>", svg)
    x, anchor, text = float(label.group(1)), label.group(2), label.group(3)
    width = int(re.search(r"<svg width='(\d+)'", svg).group(1))
    assert anchor == "end" and x < width  # ends at the marker, inside
    assert x - 7 * len(text) > 0


CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync")


def _dump_dom(url: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run([CHROMIUM, *CHROME_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
def test_chromium_shows_the_report_and_the_module_filter_works(tmp_path):
    _, report = _plan_report(Stack(d=32, depth=2), (torch.randn(64, 32),))
    path = tmp_path / "stack.html"
    report.save_html(str(path))
    dom = _dump_dom(path.as_uri())
    assert f"torch {torch.__version__} · memplan {memplan.__version__} · device cpu" in dom
    assert html.escape(_headline(report), quote=False) in dom
    assert "blocks.1.mlp.act" in dom
    assert "<details class=\"graph\" id=\"graph-details\">" in dom  # closed
    boxes = re.findall(r'<g class="box" data-module="([^"]*)"[^>]*>', dom)
    assert boxes and not re.search(r'<g class="box"[^>]*style="display: none;"', dom)
    # the filter, driven by the address: only boxes made in blocks.1.mlp are shown, moved up
    filtered = _dump_dom(path.as_uri() + "#module=blocks.1.mlp")
    assert "<details class=\"graph\" id=\"graph-details\" open=\"\">" in filtered
    tags = re.findall(r'<g class="box" data-module="([^"]*)"([^>]*)>', filtered)
    assert len(tags) == len(boxes)
    shown = [module for module, attrs in tags if "display: none" not in attrs]
    hidden = [module for module, attrs in tags if "display: none" in attrs]
    assert shown and hidden
    assert all("blocks.1.mlp" in m for m in shown) and not any("blocks.1.mlp" in m for m in hidden)
    assert f"{len(shown)} of {len(tags)} boxes made in modules matching" in filtered
