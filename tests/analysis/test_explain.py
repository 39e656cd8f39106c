"""explain(): the tensors alive at the peak, with the reason each is alive."""

import torch
from torch import nn

import memplan.examples as examples
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
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(explanation)
    assert "alive because" in console.export_text()


def test_saved_for_backward_lists_forward_tensors():
    a = analyze(Net(), torch.randn(512, 256))
    assert a.saved_for_backward  # tanh's output is saved
    assert all(b > 0 for b in a.saved_for_backward.values())
