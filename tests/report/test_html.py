"""The HTML report: self-contained, every section present, escaped, and it renders in Chromium."""

import html
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
    # no network: nothing is fetched
    for needle in ("http://", "https://", "<script", "<link", "@import"):
        assert needle not in text


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
