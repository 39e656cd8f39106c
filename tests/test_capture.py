"""Capture: phases, sources, inputs, outputs and errors."""

import functools

import pytest
import torch
from torch import nn

from memplan.capture import Phase, capture
from memplan.errors import CaptureError, UnsupportedInputError


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h)


def branchy(x):
    if x.sum() > 0:  # data-dependent: cannot be captured
        return x * 2
    return x


def test_training_capture_has_forward_then_backward():
    cg = capture(TwoLayer(), torch.randn(5, 8))
    phases = [cg.phases[n.name] for n in cg.gm.graph.nodes if n.op == "call_function"]
    first_backward = phases.index(Phase.BACKWARD)
    assert all(p is Phase.FORWARD for p in phases[:first_backward])
    assert all(p is Phase.BACKWARD for p in phases[first_backward:])
    # the loss reduction is forward; the first backward op seeds its gradient
    assert cg.gm.graph.find_nodes(op="call_function", target=torch.ops.aten.ones_like.default)[0].name in {
        n for n, p in cg.phases.items() if p is Phase.BACKWARD
    }


def test_parameters_are_graph_inputs_and_gradients_are_outputs():
    cg = capture(TwoLayer(), torch.randn(5, 8))
    assert [(s.kind, s.path) for s in cg.inputs] == [
        ("parameter", "fc1.weight"), ("parameter", "fc1.bias"),
        ("parameter", "fc2.weight"), ("parameter", "fc2.bias"), ("input", "args[0]"),
    ]
    assert [s.node for s in cg.inputs] == ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias", "args_0"]
    assert [(o.kind, o.path) for o in cg.outputs] == [
        ("output", "out[0]"), ("grad", "fc1.weight"), ("grad", "fc1.bias"), ("grad", "fc2.weight"), ("grad", "fc2.bias"),
    ]


def test_source_lines_point_at_user_code_in_forward_and_backward():
    cg = capture(TwoLayer(), torch.randn(5, 8))
    mm_nodes = [n for n in cg.gm.graph.nodes if n.target == torch.ops.aten.addmm.default]
    assert str(cg.sources[mm_nodes[0].name]).endswith("(h = torch.relu(self.fc1(x)))")
    # backward nodes inherit the forward op's line through autograd's sequence number
    tb = next(n for n in cg.gm.graph.nodes if n.target == torch.ops.aten.threshold_backward.default)
    assert cg.sources[tb.name].code == "h = torch.relu(self.fc1(x))"
    assert cg.sources[tb.name].filename == __file__


def test_inference_capture_has_no_backward():
    cg = capture(TwoLayer(), torch.randn(5, 8), train=False)
    assert set(cg.phases.values()) == {Phase.FORWARD}
    assert [o.kind for o in cg.outputs] == ["output"]


def test_no_grad_context_captures_inference_by_default():
    with torch.no_grad():
        cg = capture(TwoLayer(), torch.randn(5, 8))
    assert not cg.training


def test_tangent_seed_adds_one_placeholder_per_differentiable_output():
    cg = capture(TwoLayer(), torch.randn(5, 8), seed="tangents")
    tangents = [s for s in cg.inputs if s.kind == "tangent"]
    assert len(tangents) == 1
    assert tuple(cg.node(tangents[0].node).meta["val"].shape) == (5, 4)


def test_python_loops_are_unrolled():
    cell = nn.RNNCell(4, 6)

    def unrolled(seq):
        h = torch.zeros(seq.shape[1], 6)
        for t in range(seq.shape[0]):
            h = cell(seq[t], h)
        return h

    cg = capture(unrolled, torch.randn(7, 3, 4), train=False)
    tanh = [n for n in cg.gm.graph.nodes if n.target == torch.ops.aten.tanh.default]
    assert len(tanh) == 7


def test_closed_over_parameters_in_training_are_an_error_and_leave_the_model_untouched():
    cell = nn.RNNCell(4, 6)

    def uses_closure(x):
        return cell(x, torch.zeros(3, 6))

    with pytest.raises(CaptureError, match="nn.Module that owns it"):
        capture(uses_closure, torch.randn(3, 4, requires_grad=True))
    assert cell.weight_ih.grad is None


def test_data_dependent_control_flow_names_the_line_and_suggests_eager_fallback():
    with pytest.raises(CaptureError) as info:
        capture(branchy, torch.randn(3, requires_grad=True))
    message = str(info.value)
    assert "test_capture.py" in message and "if x.sum() > 0:" in message
    assert 'fallback="eager"' in message


def test_non_tensor_leaf_is_rejected_with_a_fix():
    with pytest.raises(UnsupportedInputError, match=r"args\[1\] is a int.*functools.partial"):
        capture(lambda x, k: x * k, torch.randn(3), 3)


def test_partial_binds_non_tensor_arguments():
    cg = capture(functools.partial(lambda x, k: x * k, k=3), torch.randn(3), train=False)
    assert any(n.target == torch.ops.aten.mul.Tensor for n in cg.gm.graph.nodes)


def test_sparse_input_is_rejected():
    sparse = torch.randn(4, 4).to_sparse()
    with pytest.raises(UnsupportedInputError, match="sparse|dense"):
        capture(lambda x: x * 2, sparse)


def test_nested_inputs_and_kwargs():
    def f(pair, scale=None):
        a, b = pair
        return {"s": a @ b * scale["k"]}

    cg = capture(f, (torch.randn(2, 3), torch.randn(3, 4)), scale={"k": torch.tensor(2.0)}, train=False)
    assert [s.path for s in cg.inputs] == ["args[0][0]", "args[0][1]", "kwargs['scale']['k']"]


def test_capture_allocates_nothing_big():
    from memplan.measure import measure

    big = nn.Linear(4096, 4096)
    x = torch.randn(4096, 4096)
    m = measure(capture, big, x)
    # a real forward+backward would allocate >= 3 * 64 MiB; fake tracing allocates only tiny tensors
    assert m.peak < 8 * 2**20


def _returned_gradient(cg):
    return cg.node(next(o.node for o in cg.outputs if o.kind == "grad"))


def test_gradient_a_broadcast_tangent_would_relay_is_copied_into_the_leafs_layout():
    def column_major_sigmoid(x):
        return torch.sigmoid(x.t().contiguous().t())

    x = torch.randn(4, 3, requires_grad=True)
    cg = capture(column_major_sigmoid, x, seed="tangents")
    # the trace's dense tangent gives x's gradient x's strides; out.sum()'s broadcast tangent would make
    # sigmoid_backward follow the column-major output, and autograd would copy outside the plan
    grad = _returned_gradient(cg)
    assert grad.target is torch.ops.aten.copy_.default
    assert grad.meta["val"].stride() == x.stride()
    assert cg.phases[grad.name] is Phase.BACKWARD


def test_gradient_whose_layout_no_tangent_changes_is_returned_as_is():
    cg = capture(torch.sigmoid, torch.randn(4, 3, requires_grad=True), seed="tangents")
    assert _returned_gradient(cg).target is not torch.ops.aten.copy_.default
