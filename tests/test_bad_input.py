"""Bad input, answered: one test per row of the table at the top of docs/troubleshooting.md.

Each row either behaves exactly as eager (outputs, gradients, ``.grad``, buffers, hooks called as often
with the same values) or raises a memplan error (a :class:`~memplan.errors.MemplanError`) whose message
names the user's line (a line of this file) and a fix.
"""

import copy
import inspect
import io
import os
import pickle
import threading
import warnings
from collections import namedtuple

import pytest
import torch
from torch import nn

import memplan
from memplan.errors import (
    CaptureError,
    HigherOrderGradientError,
    InfeasibleBudgetError,
    MemplanError,
    UnsupportedInputError,
)
from memplan.testing import assert_equivalent

HERE = os.path.basename(__file__)


def line_of(function, text: str) -> str:
    """``"test_bad_input.py:123"``: the line of ``function``'s source holding ``text``."""
    lines, first = inspect.getsourcelines(function)
    return f"{HERE}:{first + next(i for i, line in enumerate(lines) if text in line)}"


def raised_here(info: pytest.ExceptionInfo, *, line: str, fix: str) -> str:
    """The message of a memplan error that names ``line`` and says ``Fix:`` with ``fix`` in it."""
    message = str(info.value)
    assert isinstance(info.value, MemplanError)
    assert line in message, message
    assert "Fix:" in message and fix in message.split("Fix:", 1)[1], message
    return message


class MLP(nn.Module):
    def __init__(self, d: int = 6):
        super().__init__()
        self.a, self.b = nn.Linear(d, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h)


def planned_beside_eager(model: nn.Module, **options):
    """The model optimized, and an untouched copy of it to run eagerly."""
    return memplan.optimize(model, **options), copy.deepcopy(model)


# ----------------------------------------------------------------------------------------------
# data-dependent Python control flow; values read out of tensors


class BranchesOnAValue(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


def test_data_dependent_control_flow_is_a_capture_error_naming_the_branch():
    x = torch.randn(4)
    with pytest.raises(CaptureError) as info:
        memplan.optimize(BranchesOnAValue())(x)
    raised_here(info, line=line_of(BranchesOnAValue.forward, "if x.sum() > 0"), fix="torch.where")
    # the fix it names last: the model runs eagerly, with a warning
    with pytest.warns(UserWarning, match="eagerly"):
        out = memplan.optimize(BranchesOnAValue(), fallback="eager")(x)
    torch.testing.assert_close(out, BranchesOnAValue()(x))


class ReadsValues(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.fc, self.how = nn.Linear(4, 4), how

    def forward(self, x):
        y = self.fc(x)
        if self.how == "item":
            return y * y.max().item()  # a value straight into tensor ops: planned, read at every call
        if self.how == "tolist":
            return y * sum(y.flatten().tolist())
        return y * float(y.detach().numpy().mean())


def test_a_value_read_by_item_into_tensor_ops_is_planned_and_read_at_every_call():
    model = ReadsValues("item")
    opt, reference = planned_beside_eager(model)
    for seed in range(2):  # a new value at each call, from the same plan
        torch.manual_seed(seed)
        assert_equivalent(reference, opt, torch.randn(3, 4, requires_grad=True))
    assert opt.plans_built == 1


@pytest.mark.parametrize("how,text,fix", [("tolist", "sum(y.flatten().tolist())", "sum(y.tolist())"),
                                          ("numpy", "numpy().mean()", "t.numpy().mean()")])
def test_python_arithmetic_on_values_and_numpy_are_capture_errors(how, text, fix):
    with pytest.raises(CaptureError) as info:
        memplan.optimize(ReadsValues(how))(torch.randn(3, 4))
    raised_here(info, line=line_of(ReadsValues.forward, text), fix=fix)


# ----------------------------------------------------------------------------------------------
# tensor kinds


def _sparse_csr(x):
    return x.to_sparse_csr()


TENSOR_KINDS = {
    "sparse_coo": (lambda x: x.to_sparse(), "x.to_dense()"),
    "sparse_csr": (_sparse_csr, "x.to_dense()"),
    "nested": (lambda x: torch.nested.nested_tensor([x[:2], x[2:]]), "to_padded_tensor"),
    "nested_jagged": (lambda x: torch.nested.nested_tensor([x[:2], x[2:]], layout=torch.jagged), "to_padded_tensor"),
    "quantized": (lambda x: torch.quantize_per_tensor(x, 0.1, 0, torch.qint8), "x.dequantize()"),
}


@pytest.mark.filterwarnings("ignore:.*(Sparse CSR|nested tensors|quantized tensor).*:UserWarning")  # torch's own
@pytest.mark.parametrize("kind", list(TENSOR_KINDS))
def test_tensors_that_are_not_dense_are_refused_naming_the_call(kind):
    make, fix = TENSOR_KINDS[kind]
    opt = memplan.optimize(MLP(4))
    x = make(torch.randn(5, 4))
    with pytest.raises(UnsupportedInputError) as info:
        opt(x)
    raised_here(info, line=line_of(test_tensors_that_are_not_dense_are_refused_naming_the_call, "opt(x)"), fix=fix)
    assert "args[0]" in str(info.value)
    torch.testing.assert_close(opt(torch.ones(5, 4)), opt.original(torch.ones(5, 4)))  # still usable


class ComplexFilter(nn.Module):
    def __init__(self):
        super().__init__()
        self.response = nn.Parameter(torch.randn(4, dtype=torch.cfloat))

    def forward(self, x):
        return (x * self.response).abs()


def test_complex_tensors_behave_as_eager():
    opt, reference = planned_beside_eager(ComplexFilter())
    assert_equivalent(reference, opt, torch.randn(3, 4, dtype=torch.cfloat, requires_grad=True))


def test_meta_tensors_behave_as_eager():
    # a model and inputs on the meta device: shapes and devices only, planned like any other device
    model = MLP(4).to("meta")
    opt = memplan.optimize(model)
    x = torch.randn(5, 4, device="meta", requires_grad=True)
    out = opt(x)
    expected = model(torch.randn(5, 4, device="meta"))
    assert (out.shape, out.device, out.dtype) == (expected.shape, expected.device, expected.dtype)
    out.sum().backward()
    assert x.grad.shape == x.shape and x.grad.device.type == "meta"
    assert model.a.weight.grad.shape == model.a.weight.shape


def test_meta_inputs_to_a_model_elsewhere_are_eagers_error_with_the_line():
    opt = memplan.optimize(MLP(4))
    with pytest.raises(RuntimeError, match="device"):
        opt.original(torch.randn(5, 4, device="meta"))  # eager refuses too
    with pytest.raises(CaptureError) as info:
        opt(torch.randn(5, 4, device="meta"))
    raised_here(info, line=line_of(MLP.forward, "self.a(x)"), fix="x.to(device)")


# ----------------------------------------------------------------------------------------------
# mutation of inputs, parameters and buffers


class CountsCalls(nn.Module):
    """Updates an input that does not require grad, and buffers (whole and through a view), in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("total", torch.zeros(4))
        self.register_buffer("calls", torch.zeros(2))

    def forward(self, x, seen):
        seen.add_(1)
        self.total.add_(x.detach().sum(0))
        self.calls[0].add_(1)  # in place on a view of a buffer
        return self.fc(x) * seen + self.total


def test_inputs_and_buffers_updated_in_place_behave_as_eager():
    model = CountsCalls()
    opt, reference = planned_beside_eager(model)
    x = torch.randn(3, 4, requires_grad=True)
    seen_planned, seen_eager = torch.zeros(3, 4), torch.zeros(3, 4)
    for _ in range(3):
        planned = opt(x, seen_planned)
        eager = reference(x, seen_eager)
        torch.testing.assert_close(planned, eager)
    torch.testing.assert_close(seen_planned, seen_eager)
    torch.testing.assert_close(model.total, reference.total)
    torch.testing.assert_close(model.calls, reference.calls)
    assert model.calls[0].item() == 3


class UpdatesItsWeight(nn.Module):
    def __init__(self, view: bool):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4, 3))
        self.view = view

    def forward(self, x):
        with torch.no_grad():
            if self.view:
                self.w[0].mul_(0.5)  # in place on a view of a parameter
            else:
                self.w.mul_(0.5)
        return x @ self.w


@pytest.mark.parametrize("view", [False, True], ids=["parameter", "view_of_parameter"])
def test_a_parameter_updated_in_place_is_refused_in_training_and_eager_in_inference(view):
    text = "self.w[0].mul_(0.5)" if view else "self.w.mul_(0.5)"
    with pytest.raises(CaptureError) as info:
        memplan.optimize(UpdatesItsWeight(view))(torch.randn(2, 4))
    message = raised_here(info, line=line_of(UpdatesItsWeight.forward, text), fix="outside the forward")
    assert "parameter 'w'" in message
    # under no_grad (inference) the plan writes where eager does
    model = UpdatesItsWeight(view)
    opt, reference = planned_beside_eager(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(opt(x), reference(x))
    torch.testing.assert_close(model.w, reference.w)


class WritesIntoItsInput(nn.Module):
    def forward(self, x):
        x.mul_(2)
        return x.sum()


def test_an_input_that_requires_grad_written_in_place_is_refused():
    with pytest.raises(RuntimeError, match="in-place"):
        WritesIntoItsInput()(torch.randn(3, requires_grad=True))  # eager refuses a leaf too
    with pytest.raises(CaptureError) as info:
        memplan.optimize(WritesIntoItsInput())(torch.randn(3, requires_grad=True))
    raised_here(info, line=line_of(WritesIntoItsInput.forward, "x.mul_(2)"), fix="out-of-place")


class ReassignsABuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count = self.count + 1
        return x * self.count


def test_a_buffer_given_a_new_tensor_is_refused():
    with pytest.raises(CaptureError) as info:
        memplan.optimize(ReassignsABuffer())(torch.randn(3))
    raised_here(info, line=line_of(ReassignsABuffer.forward, "self.count = self.count + 1"), fix="self.count.add_(1)")


# ----------------------------------------------------------------------------------------------
# what a model returns

Pair = namedtuple("Pair", "left right")


class ReturnsEverything(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return {"pair": Pair(y * 2, [y.sum(1), (None, y.shape[0], "label", 0.5)]),
                "value": y.sum().item(), "nothing": None}


def test_non_tensor_outputs_and_nested_containers_behave_as_eager():
    model = ReturnsEverything()
    opt, reference = planned_beside_eager(model)
    for seed in range(2):
        torch.manual_seed(seed)
        x = torch.randn(3, 4)
        planned, eager = opt(x), reference(x)
        assert type(planned) is dict and type(planned["pair"]) is Pair
        assert planned["pair"].right[1] == eager["pair"].right[1]  # None, an int, a string, a float
        assert planned["value"] == pytest.approx(eager["value"])  # read at every call
        assert planned["nothing"] is None
        torch.testing.assert_close(planned["pair"].left, eager["pair"].left)
    assert_equivalent(reference, opt, torch.randn(3, 4, requires_grad=True))


def test_a_model_that_returns_none_behaves_as_eager():
    opt = memplan.optimize(lambda x: None)
    assert opt(torch.randn(3)) is None


class Result:
    def __init__(self, logits):
        self.logits = logits


class ReturnsAnObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return Result(self.fc(x))


def test_an_output_memplan_cannot_see_inside_is_refused_naming_the_forward():
    # it returned the object the trace saw, holding fake tensors, at every call
    with pytest.raises(CaptureError) as info:
        memplan.optimize(ReturnsAnObject())(torch.randn(3, 4))
    message = raised_here(info, line=line_of(ReturnsAnObject.forward, "def forward"), fix="register_dataclass")
    assert "Result" in message


def test_a_padded_batch_made_nested_is_refused_with_the_fix_that_applies():
    # nn.TransformerEncoder in evaluation, under no_grad, with a padding mask, makes a nested tensor of the
    # batch: the message carried torch's "Internal error ... Please file an issue" and the generic fix
    def encoder(nested: bool) -> nn.Module:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()

    x, mask = torch.randn(3, 7, 16), torch.zeros(3, 7, dtype=torch.bool)
    mask[1, 5:], mask[2, 3:] = True, True
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own prototype warning about nested tensors
        with pytest.raises(CaptureError) as info:
            memplan.optimize(encoder(True))(x, src_key_padding_mask=mask)
        message = raised_here(info, line=line_of(test_a_padded_batch_made_nested_is_refused_with_the_fix_that_applies,
                                                 "memplan.optimize(encoder(True))"), fix="enable_nested_tensor=False")
        assert "file an issue" not in message
        model = encoder(False)  # the fix the message gives
        opt = memplan.optimize(model)
        assert_equivalent(lambda x, m: model(x, src_key_padding_mask=m), lambda x, m: opt(x, src_key_padding_mask=m),
                          x, mask, grad=False)


def test_a_mask_torch_reads_to_find_it_causal_is_refused_with_the_fix_that_applies():
    # nn.TransformerDecoder compares tgt_mask with a causal mask in Python unless told: the generic
    # "depends on tensor values" message named no way out
    torch.manual_seed(0)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, batch_first=True), 1)
    tgt, memory = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    with pytest.raises(CaptureError) as info:
        memplan.optimize(decoder)(tgt, memory, tgt_mask=causal)
    raised_here(info, line=line_of(test_a_mask_torch_reads_to_find_it_causal_is_refused_with_the_fix_that_applies,
                                   "memplan.optimize(decoder)(tgt, memory, tgt_mask=causal)"), fix="tgt_is_causal=")
    opt = memplan.optimize(decoder)  # the fix the message gives
    assert_equivalent(lambda t, m: decoder(t, m, tgt_mask=causal, tgt_is_causal=True),
                      lambda t, m: opt(t, m, tgt_mask=causal, tgt_is_causal=True), tgt, memory)


# ----------------------------------------------------------------------------------------------
# shapes that change from call to call; the plan cache's bound


def test_a_new_shape_at_every_call_plans_each_and_matches_eager():
    opt, reference = planned_beside_eager(MLP())
    for batch in (2, 3, 5, 3):
        assert_equivalent(reference, opt, torch.randn(batch, 6, requires_grad=True))
    assert opt.plans_built == 3


def test_the_plan_cache_is_bounded_and_says_so_once_when_it_drops_a_plan():
    opt, reference = planned_beside_eager(MLP(), passes="", max_plans=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (1, 2, 3, 4, 5, 1):  # the fourth signature drops the first; the first comes back
            x = torch.randn(batch, 6)
            torch.testing.assert_close(opt(x), reference(x))
    dropped = [w for w in caught if "max_plans" in str(w.message)]
    assert len(dropped) == 1, [str(w.message) for w in caught]
    message = str(dropped[0].message)
    assert "MLP" in message and "bucket the shapes" in message and "Fix:" in message
    assert dropped[0].filename == __file__  # points at the call
    assert len(opt._plans) == 3 and opt.plans_built == 6
    with pytest.raises(ValueError, match="max_plans"):
        memplan.optimize(MLP(), max_plans=0)


# ----------------------------------------------------------------------------------------------
# requires_grad toggled between calls


def test_requires_grad_toggled_between_calls_behaves_as_eager():
    model = MLP()
    opt, reference = planned_beside_eager(model)
    x = torch.randn(4, 6)
    assert_equivalent(reference, opt, x)
    for module in (model, reference):
        module.a.requires_grad_(False)  # a frozen layer
    assert_equivalent(reference, opt, x)
    assert_equivalent(reference, opt, x.clone().requires_grad_())  # and the input's gradient asked for
    for module in (model, reference):
        module.requires_grad_(False)  # nothing requires grad: the inference plan, in grad mode
    out = opt(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, reference(x))
    for module in (model, reference):
        module.requires_grad_(True)
    assert_equivalent(reference, opt, x)
    assert opt.plans_built == 4


# ----------------------------------------------------------------------------------------------
# hooks


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.tanh(h))


CHANGING_HOOKS = {
    "forward": lambda m: m.a.register_forward_hook(lambda module, args, out: out * 1.5),
    "forward_pre": lambda m: m.a.register_forward_pre_hook(lambda module, args: (args[0] * 2,)),
    "full_backward": lambda m: m.b.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0.5,)),
    "full_backward_pre": lambda m: m.b.register_full_backward_pre_hook(lambda module, grad_out: (grad_out[0] * 3,)),
}


@pytest.mark.parametrize("kind", list(CHANGING_HOOKS))
def test_module_hooks_that_change_values_are_planned(kind):
    model = Hooked()
    reference = copy.deepcopy(model)
    for m in (model, reference):
        CHANGING_HOOKS[kind](m)
    assert_equivalent(reference, memplan.optimize(model), torch.randn(5, 4, requires_grad=True))


RECORDING_HOOKS = {
    "forward": lambda m, log: m.a.register_forward_hook(lambda module, args, out: log.append(out)),
    "forward_pre": lambda m, log: m.a.register_forward_pre_hook(lambda module, args: log.append(args)),
    "full_backward": lambda m, log: m.b.register_full_backward_hook(lambda module, gi, go: log.append(go)),
    "full_backward_pre": lambda m, log: m.b.register_full_backward_pre_hook(lambda module, go: log.append(go)),
}


@pytest.mark.parametrize("kind", list(RECORDING_HOOKS))
def test_module_hooks_called_for_what_they_record_are_refused_naming_the_hook(kind):
    # they ran once, while planning, over fake tensors, and never again
    model, log = Hooked(), []
    RECORDING_HOOKS[kind](model, log)
    with pytest.raises(CaptureError) as info:
        memplan.optimize(model)(torch.randn(5, 4)).sum().backward()
    lines, _ = inspect.findsource(Hooked)  # the hook's own line, in RECORDING_HOOKS above
    marker = f'"{kind}": lambda m, log'
    hook_line = f"{HERE}:{next(i + 1 for i, line in enumerate(lines) if marker in line)}"
    message = raised_here(info, line=hook_line, fix="opt.register_")
    assert "returned None" in message


def test_hooks_on_the_optimized_module_run_at_every_call_as_eager():
    # the fix the refusal names: hooks around the whole plan see every call's real values
    model = Hooked()
    opt, reference = planned_beside_eager(model)
    logs = {id(opt): [], id(reference): []}
    for m in (opt, reference):
        log = logs[id(m)]
        m.register_forward_pre_hook(lambda module, args, log=log: log.append(("pre", args[0].clone())))
        m.register_forward_hook(lambda module, args, out, log=log: log.append(("forward", out.detach().clone())))
        m.register_full_backward_pre_hook(lambda module, go, log=log: log.append(("backward_pre", go[0].clone())))
        m.register_full_backward_hook(lambda module, gi, go, log=log: log.append(("backward", gi[0].clone())))
    for seed in range(2):
        torch.manual_seed(seed)
        x = torch.randn(5, 4, requires_grad=True)
        for m in (opt, reference):
            m(x).pow(2).sum().backward()
    planned, eager = logs[id(opt)], logs[id(reference)]
    assert [kind for kind, _ in planned] == [kind for kind, _ in eager] and len(eager) == 8
    for (_, a), (_, b) in zip(planned, eager):
        torch.testing.assert_close(a, b)


def test_tensor_hooks_on_parameters_and_inputs_fire_as_in_eager():
    model = Hooked()
    opt, reference = planned_beside_eager(model)
    seen = {id(opt): [], id(reference): []}
    for m, owner in ((opt, model), (reference, reference)):
        log = seen[id(m)]
        owner.a.weight.register_hook(lambda g, log=log: log.append(("weight", g.clone())))
        owner.b.bias.register_hook(lambda g, log=log: g * 2)  # changes the gradient
        owner.a.bias.register_post_accumulate_grad_hook(lambda p, log=log: log.append(("accumulated", p.grad.clone())))
    x = torch.randn(5, 4)
    for _ in range(2):
        for m in (opt, reference):
            xi = x.clone().requires_grad_()
            xi.register_hook(lambda g, log=seen[id(m)]: log.append(("input", g.clone())))
            m(xi).sum().backward()
    planned, eager = seen[id(opt)], seen[id(reference)]
    assert sorted(k for k, _ in planned) == sorted(k for k, _ in eager) and len(eager) == 6
    for kind in ("weight", "accumulated", "input"):
        for a, b in zip([v for k, v in planned if k == kind], [v for k, v in eager if k == kind]):
            torch.testing.assert_close(a, b)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_multi_grad_hooks_on_parameters_fire_as_in_eager():
    model = Hooked()
    opt, reference = planned_beside_eager(model)
    seen = {id(opt): [], id(reference): []}
    for m, owner in ((opt, model), (reference, reference)):
        log = seen[id(m)]
        torch.autograd.graph.register_multi_grad_hook(
            list(owner.parameters()), lambda grads, log=log: log.append([g.clone() for g in grads]))
    x = torch.randn(5, 4)
    for m in (opt, reference):
        m(x).sum().backward()
    assert len(seen[id(opt)]) == len(seen[id(reference)]) == 1
    for a, b in zip(seen[id(opt)][0], seen[id(reference)][0]):
        torch.testing.assert_close(a, b)


class HooksInside(nn.Module):
    def __init__(self, how: str, log=None):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)
        self.how, self.log = how, log

    def forward(self, x):
        h = self.a(x)
        if self.how == "changes":
            h.register_hook(lambda g: g * 3)
        elif self.how == "records":
            h.register_hook(lambda g: self.log.append(g))
        else:
            torch.autograd.graph.register_multi_grad_hook([h], lambda grads: self.log.append(grads))
        return self.b(torch.tanh(h))


def test_a_tensor_hook_the_forward_registers_to_change_a_gradient_is_planned():
    model = HooksInside("changes")
    assert_equivalent(copy.deepcopy(model), memplan.optimize(model), torch.randn(5, 4))


@pytest.mark.parametrize("how,text", [("records", "h.register_hook(lambda g: self.log.append(g))"),
                                      ("multi", "register_multi_grad_hook([h]")])
def test_a_tensor_hook_the_forward_registers_to_record_is_refused_naming_it(how, text):
    with pytest.raises(CaptureError) as info:
        memplan.optimize(HooksInside(how, log=[]))(torch.randn(5, 4))
    raised_here(info, line=line_of(HooksInside.forward, text), fix="register the hook on that output")


# ----------------------------------------------------------------------------------------------
# grad mode switched inside forward


class SwitchesGradMode(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.mode = mode

    def forward(self, x):
        h = self.a(x)
        if self.mode == "no_grad":
            with torch.no_grad():
                g = self.b(h)
        elif self.mode == "inference_mode":
            with torch.inference_mode():
                g = self.b(h)
            g = g.clone()  # an inference tensor, made a normal one before autograd sees it
        elif self.mode == "enable_grad":
            with torch.enable_grad():
                g = self.b(h)
        else:
            with torch.set_grad_enabled(False):
                g = self.b(h)
        return h * g


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "enable_grad", "set_grad_enabled"])
def test_grad_mode_switched_inside_forward_behaves_as_eager(mode):
    model = SwitchesGradMode(mode)
    opt, reference = planned_beside_eager(model)
    x = torch.randn(3, 4)
    assert_equivalent(reference, opt, x)  # training
    assert_equivalent(reference, opt, x, grad=False)  # inference, under no_grad
    with torch.no_grad():  # enable_grad inside a no_grad call records a graph in eager
        planned, eager = opt(x), reference(x)
    assert planned.requires_grad == eager.requires_grad


# ----------------------------------------------------------------------------------------------
# double backward, retain_graph


def test_double_backward_is_refused_naming_the_line():
    model = MLP()
    opt = memplan.optimize(model)
    x = torch.randn(4, 6, requires_grad=True)
    (eager,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    (planned,) = torch.autograd.grad(opt(x).sum(), x, create_graph=True)
    torch.testing.assert_close(planned, eager)  # first order: exact
    with pytest.raises(HigherOrderGradientError) as info:
        planned.pow(2).sum().backward()  # a gradient penalty
    raised_here(info, line=line_of(test_double_backward_is_refused_naming_the_line, "planned.pow(2).sum().backward()"),
                fix="opt.original")


def test_retain_graph_behaves_as_eager():
    model = MLP()
    opt, reference = planned_beside_eager(model)
    x = torch.randn(4, 6)
    for m, owner in ((opt, model), (reference, reference)):
        loss = m(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()  # without retain_graph, the graph is gone, as in eager
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


# ----------------------------------------------------------------------------------------------
# a budget below what any plan reaches


def test_a_budget_no_plan_reaches_names_what_holds_the_peak_and_the_fix():
    opt = memplan.optimize(MLP(64), budget=100)
    with pytest.raises(InfeasibleBudgetError) as info:
        opt(torch.randn(32, 64))
    raised_here(info, line=line_of(MLP.forward, "torch.tanh(self.a(x))"), fix="raise the budget")
    assert info.value.smallest > 100 and info.value.holders


# ----------------------------------------------------------------------------------------------
# NaN and Inf


def test_nan_and_inf_come_out_as_in_eager():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Softmax(-1), nn.Linear(8, 2))
    opt, reference = planned_beside_eager(model)
    x = torch.randn(6, 4)
    x[0, 0], x[1, 1], x[2, 2] = float("nan"), float("inf"), -float("inf")
    results = []
    for m, owner in ((opt, model), (reference, reference)):
        xi = x.clone().requires_grad_()
        out = m(xi)
        out.sum().backward()
        results.append((out, xi.grad, [p.grad for p in owner.parameters()]))
    (out_a, grad_a, params_a), (out_b, grad_b, params_b) = results
    assert out_b.isnan().any() and grad_b.isnan().any()  # the case is one with NaNs to hide
    torch.testing.assert_close(out_a, out_b, equal_nan=True)
    torch.testing.assert_close(grad_a, grad_b, equal_nan=True)
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, equal_nan=True)


# ----------------------------------------------------------------------------------------------
# a model moved to another device or dtype after the first call


@pytest.mark.parametrize("move", ["float64", "bfloat16", "meta"])
def test_a_model_moved_after_the_first_call_is_planned_again(move):
    model = MLP()
    opt = memplan.optimize(model)
    x = torch.randn(4, 6)
    opt(x).sum().backward()
    target = getattr(torch, move) if move != "meta" else torch.device("meta")
    opt.to(target)
    moved = x.to(target)
    out = opt(moved)
    expected = model(moved)
    assert (out.dtype, out.device) == (expected.dtype, expected.device) and opt.plans_built == 2
    if move != "meta":
        torch.testing.assert_close(out, expected)
        assert_equivalent(copy.deepcopy(model), opt, moved)


def test_inputs_left_behind_after_a_move_get_eagers_error_naming_the_op():
    model = MLP()
    opt = memplan.optimize(model)
    x = torch.randn(4, 6)
    opt(x)
    opt.double()
    with pytest.raises(RuntimeError, match="dtype") as eager:
        model(x)
    with pytest.raises(RuntimeError) as planned:
        opt(x)
    assert str(planned.value) == str(eager.value)  # eager's error, as eager raises it
    assert any("memplan: raised by" in note and HERE in note for note in planned.value.__notes__)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_model_moved_to_cuda_after_the_first_call_is_planned_again():
    model = MLP()
    opt = memplan.optimize(model)
    x = torch.randn(4, 6)
    opt(x).sum().backward()
    opt.cuda()
    assert_equivalent(copy.deepcopy(model), opt, x.cuda())
    assert opt(x.cuda()).device.type == "cuda"


# ----------------------------------------------------------------------------------------------
# pickling and state_dict round trips


def test_pickling_and_state_dict_round_trips():
    model = MLP()
    opt = memplan.optimize(model, max_plans=5)
    x = torch.randn(4, 6)
    opt(x).sum().backward()
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    for restored in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt), torch.load(buffer, weights_only=False)):
        assert restored.plan is None and restored.max_plans == 5  # plans are not copied: made again
        assert_equivalent(copy.deepcopy(model), restored, x)
        assert restored.plans_built == opt.plans_built + 1
    state = opt.state_dict()
    assert list(state) == list(model.state_dict())
    fresh = memplan.optimize(MLP())
    fresh(x)  # planned before the load: the plan reads the loaded parameters
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(x), model(x))


# ----------------------------------------------------------------------------------------------
# two threads calling one optimized module


def test_two_threads_calling_one_module_plan_each_signature_once_and_match_eager():
    torch.manual_seed(0)
    model = MLP()
    opt, reference = planned_beside_eager(model, passes="")
    batches = [3, 3, 5, 7]  # two threads on one signature, two on others
    inputs = [torch.randn(n, 6) for n in batches]
    start = threading.Barrier(len(batches))
    results, errors = {}, []

    def call(i):
        try:
            start.wait()
            for _ in range(3):
                out = opt(inputs[i])
                out.sum().backward()
            results[i] = out.detach()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(batches))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert opt.plans_built == len(set(batches))
    for i, x in enumerate(inputs):
        torch.testing.assert_close(results[i], reference(x))
    # the model was never left holding the trace's fake tensors
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert_equivalent(reference, opt, inputs[0])


def test_import_memplan_alone_gives_the_modules_the_docs_use():
    # README uses memplan.steps.step_fn after a bare `import memplan`, which raised AttributeError
    import subprocess
    import sys

    code = "import memplan; memplan.steps.step_fn; memplan.testing.assert_equivalent; memplan.errors.CaptureError"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
