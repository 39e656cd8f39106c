"""explain(): what is alive at the peak, by kind, layer and line, and each tensor with why it is alive."""

import collections
import os

import pytest
import torch
from rich.console import Console
from torch import nn

import memplan.examples as examples
from memplan.analysis.explain_text import torch_line
from memplan.analysis.groups import suggested_budget
from memplan.analyze import analyze


def test_broadcast_matmul_explanation_points_at_the_expanded_weight_copy():
    w = examples.make("broadcast_matmul")
    explanation = analyze(w.model, *w.inputs).explain()
    top = explanation.tensors[0]
    weight = dict(w.model.named_parameters())
    (name, param), = [(n, p) for n, p in weight.items() if p.dim() == 3]
    assert top.provenance is not None and top.provenance.startswith(f"expanded copy of parameter '{name}'")
    assert "saved for backward by" in top.reason
    assert top.nbytes > 10 * param.numel() * param.element_size()
    text = str(explanation)
    assert "expanded copy" in text and "broadcast_matmul.py" in text


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(256, 256)
        self.out = nn.Linear(256, 8)

    def forward(self, x):
        h = self.fc(x)
        return self.out(torch.tanh(h))


def test_reasons_name_the_op_and_line_that_keep_a_tensor():
    explanation = analyze(Net(), torch.randn(512, 256)).explain()
    reasons = {t.reason for t in explanation.tensors}
    # tanh's output is saved twice: by tanh (its derivative reads the result) and by the head's addmm
    saved = [r for r in reasons if r.startswith("saved for backward by")]
    assert saved and all("test_explain.py:" in r and "torch.tanh(h)" in r for r in saved), reasons
    assert explanation.peak_phase == "backward"
    assert sum(t.nbytes for t in explanation.tensors) + explanation.rest_bytes == explanation.peak


def test_inference_explanation_and_rendering():
    explanation = analyze(Net(), torch.randn(512, 256), train=False).explain()
    # at the head's addmm: fc's output (kept by the local h), tanh's output and the small head output
    assert explanation.peak == 2 * 512 * 256 * 4 + 512 * 8 * 4
    reasons = [t.reason for t in explanation.tensors]
    assert reasons[0].startswith("no op reads it any more, but a Python reference")  # fc's output, held by h
    assert "output of the model" in reasons
    console = Console(record=True, width=200)
    console.print(explanation)
    assert "alive because" in console.export_text()


def test_saved_for_backward_lists_forward_tensors():
    a = analyze(Net(), torch.randn(512, 256))
    assert a.saved_for_backward  # tanh's output is saved
    assert all(b > 0 for b in a.saved_for_backward.values())


# ----------------------------------------------------------------------------------------------
# groups: by kind, by layer, by line, and the diagnosis


class SelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.act(self.fc(x))  # the line explain names for fc and act
        return self.proj(h)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, d=64, heads=4, depth=3):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(depth)])
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(self.blocks(x))


B, T, D = 4, 32, 64


@pytest.fixture(scope="module")
def transformer():
    a = analyze(TinyTransformer(D), torch.randn(B, T, D))
    return a, a.explain()


def test_groups_name_the_layers_and_sum_to_the_peak(transformer):
    a, e = transformer
    live = a.simulation.live_at_peak
    assert sum(a.tensors.storages[sid].nbytes for sid in live) == e.peak
    # each grouping counts every storage alive at the peak once
    assert sum(k.nbytes for k in e.kinds if k.share is not None) == e.peak
    assert sum(k.count for k in e.kinds if k.share is not None) == len(live)
    assert sum(line.nbytes for line in e.lines) == e.peak
    assert sum(m.own_bytes for m in e.modules) == e.peak
    model, outside = e.modules[0], [m for m in e.modules if m.path is None]
    assert model.path == "" and model.nbytes + sum(m.nbytes for m in outside) == e.peak
    # a layer's bytes are its own plus its sublayers'
    by_path = {m.path: m for m in e.modules if m.path is not None}
    for path, module in by_path.items():
        children = [m for p, m in by_path.items() if p and p.rpartition(".")[0] == path]
        assert module.nbytes == module.own_bytes + sum(c.nbytes for c in children), path
    for i in range(3):
        assert {f"blocks.{i}", f"blocks.{i}.attn", f"blocks.{i}.mlp.fc", f"blocks.{i}.mlp.act"} <= set(by_path)
        # nn.GELU makes one tensor, its output, which blocks.i.mlp.proj saves for the backward
        act = by_path[f"blocks.{i}.mlp.act"]
        assert (act.count, act.nbytes) == (1, B * T * 4 * D * 4)
    gelu = [t for t in e.tensors if t.op == "gelu"]
    assert gelu and all(t.module.endswith(".mlp.act") and t.kind == "saved activations" for t in gelu)


def test_repeated_blocks_holding_saved_activations_get_that_diagnosis(transformer):
    _, e = transformer
    saved = next(k for k in e.kinds if k.kind == "saved activations")
    assert saved is e.kinds[0]
    assert e.diagnosis == (
        f"{saved.share:.0%} is activations saved by 3 repeated blocks (blocks.*): "
        f"try memplan.optimize(model) or budget={suggested_budget(saved.share)}"
    )


def test_a_peak_of_parameter_gradients_gets_the_gradients_diagnosis():
    layer = nn.Linear(2048, 2048)
    e = analyze(layer, torch.randn(1, 2048)).explain()
    grads = e.kinds[0]
    assert grads.kind == "parameter gradients"
    assert (grads.count, grads.nbytes) == (2, sum(p.numel() * p.element_size() for p in layer.parameters()))
    assert e.diagnosis == (
        f"{grads.nbytes / e.peak:.0%} is parameter gradients: memplan cannot lower these (they are what the step returns)"
    )
    parameters = next(k for k in e.kinds if k.kind == "parameters")
    assert parameters.share is None and parameters.nbytes == grads.nbytes  # held beside the peak, not in it


def test_lines_are_the_users_with_torchs_beneath(transformer):
    _, e = transformer
    here = os.path.abspath(__file__)
    mine = [line for line in e.lines if line.source is not None and os.path.abspath(line.source.filename) == here]
    assert mine and sum(line.nbytes for line in mine) > e.peak / 2
    # MLP's line calls nn.Linear and nn.GELU: one row for each, torch's line beneath
    beneath = {torch_line(line.library_source).split(":")[0] for line in mine
               if "self.act(self.fc(x))" in line.source.code and line.library_source is not None}
    assert beneath == {"torch/nn/modules/linear.py", "torch/nn/modules/activation.py"}
    text = e.render(width=80).splitlines()
    at = next(i for i, row in enumerate(text) if "test_explain.py:" in row and "self.act(self.fc" in row)
    assert text[at + 1].lstrip().startswith("torch/nn/modules/")


def test_console_shows_the_groups_first_within_80_columns(transformer):
    _, e = transformer
    console = Console(width=80, record=True)
    console.print(e)
    text = console.export_text()
    assert max(len(row) for row in text.splitlines()) <= 80
    assert max(len(row) for row in str(e).splitlines()) <= 80
    order = [text.index(h) for h in ("by kind", "by layer", "by line", "diagnosis:", "largest tensors")]
    assert order == sorted(order)
    assert "smaller layers not shown" in text  # ten layers by default; rows= shows more
    assert "      blocks.1.mlp.act " in e.render(width=80, rows=40)


class Nested(nn.Module):
    """One layer four modules deep, under long names: its path is longer than the console's column."""

    def __init__(self):
        super().__init__()
        layer = nn.Linear(16, 16)
        for name in ("output_projection", "feed_forward_network", "layer_number_eleven", "stack_of_layers"):
            layer = nn.Sequential(collections.OrderedDict([(name, layer)]))
        self.a_long_descriptive_encoder_name = layer

    def forward(self, x):
        return self.a_long_descriptive_encoder_name(x)


def test_long_module_paths_lose_their_start():
    e = analyze(Nested(), torch.randn(64, 16)).explain()
    deepest = max(e.modules, key=lambda m: m.depth)
    assert deepest.path.endswith(".output_projection") and len(deepest.path) > 80
    rows = e.render(width=80).splitlines()
    assert max(len(row) for row in rows) <= 80
    assert any("…" in row and "output_projection " in row for row in rows)
