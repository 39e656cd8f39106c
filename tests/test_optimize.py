"""optimize() end to end with the empty pipeline: transparent, cached, and faithful to eager."""

import copy
import warnings

import pytest
import torch
from torch import nn

import memplan
import memplan.examples as examples
from memplan.api import optimize
from memplan.errors import CaptureError
from memplan.measure import measure
from memplan.steps import step_fn
from memplan.testing import assert_equivalent, random_model, zoo

EXAMPLES = [examples.make(name) for name in examples.WORKLOADS]
ZOO = list(zoo())
MODELS = [(w.name, w.model, w.inputs) for w in EXAMPLES] + [(z.name, z.model, z.inputs) for z in ZOO]


@pytest.mark.parametrize("name,model,inputs", MODELS, ids=[m[0] for m in MODELS])
def test_empty_pipeline_is_exact_and_never_uses_more_memory(name, model, inputs):
    opt = optimize(model, passes="")
    # identical: the same aten ops run in the same order
    assert_equivalent(model, opt, *inputs, exact=True)
    for train in (True, False):
        eager_step, opt_step = step_fn(model, inputs, train=train), step_fn(opt, inputs, train=train)
        opt_step()
        assert measure(opt_step).peak <= measure(eager_step).peak


# The default pipeline gets the same checks on the zoo and other models in tests/test_models.py, and on
# the examples in tests/test_peak_regression.py, which plans them once.


@pytest.mark.parametrize("seed", range(6))
def test_random_programs_are_exact(seed):
    model, inputs = random_model(seed, requires_grad_input=True)
    assert_equivalent(model, optimize(model, passes=""), *inputs, exact=True)


def test_gradient_layout_copies_are_planned_not_left_to_autograd():
    # a gradient with other strides than its leaf (here transposed) is copied into the leaf's layout;
    # the copy must be in the plan, or the ruler measures more than the plan predicts. Here the trace's
    # dense tangent gives the gradient the leaf's strides, but the step's broadcast tangent (from
    # .sum()) makes sigmoid_backward follow its other, transposed input: predicted 4096 B, measured
    # 6152 B, until capture looked at broadcast tangents too
    model, inputs = random_model(306, steps=4, requires_grad_input=True)
    opt = optimize(model, passes="")
    step = step_fn(opt, inputs, train=True)
    step()
    assert measure(step).peak <= opt.plan.planned_peak + 8


def test_plan_is_cached_per_signature():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    opt = optimize(model, passes="")
    x = torch.randn(4, 8)
    for _ in range(3):
        opt(x).sum().backward()
    assert opt.plans_built == 1
    opt(torch.randn(5, 8))  # new shape
    assert opt.plans_built == 2
    with torch.no_grad():
        opt(x)  # grad mode is part of the signature
    assert opt.plans_built == 3
    opt.eval()
    opt(x)  # train/eval too
    assert opt.plans_built == 4
    opt(x.double().float())  # same signature again
    assert opt.plans_built == 4


def test_the_walk_behind_a_plans_key_sees_what_torchs_iterators_see():
    from memplan.api import _Walk

    shared = nn.Linear(4, 4, bias=False)
    tied = nn.Sequential(shared, nn.BatchNorm1d(4), nn.Sequential(shared, nn.Linear(4, 4)), nn.Identity())
    tied[2][1].weight = tied[0].weight  # a parameter shared by two modules
    tied[2].register_buffer("scale", torch.ones(4))
    tied[2].register_buffer("unset", None)
    class Reversed(nn.Sequential):
        def named_parameters(self, *args, **kwargs):  # lists its parameters its own way
            return reversed(list(super().named_parameters(*args, **kwargs)))

    own_order = Reversed(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    for model in (tied, own_order, *(entry.model for entry in zoo())):
        walk = _Walk.of(model)
        assert [id(m) for m in walk.modules] == [id(m) for m in model.modules()]
        assert [id(p) for p in walk.parameters] == [id(p) for p in model.parameters()]
        assert [id(b) for b in walk.buffers] == [id(b) for b in model.buffers()]
    # and what capture reads through the model's own listing is what a call hands the plan (its
    # parameters bound in the other order would not even have the right shapes)
    x, reference = torch.randn(5, 3), copy.deepcopy(own_order)
    optimize(own_order)(x).sum().backward()
    reference(x).sum().backward()
    for mine, theirs in zip(nn.Module.parameters(nn.Sequential(*own_order)), nn.Module.parameters(nn.Sequential(*reference))):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_parameters_are_the_models_own_and_optimizers_work():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    reference = copy.deepcopy(model)
    opt = optimize(model, passes="")
    assert [id(p) for p in opt.parameters()] == [id(p) for p in model.parameters()]
    assert list(opt.state_dict()) == list(model.state_dict())
    x = torch.randn(10, 6)
    sgd_a = torch.optim.SGD(opt.parameters(), lr=0.1)
    sgd_b = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        for module, sgd in ((opt, sgd_a), (reference, sgd_b)):
            sgd.zero_grad()
            module(x).pow(2).mean().backward()
            sgd.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    state = opt.state_dict()
    fresh = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    optimize(fresh).load_state_dict(state)
    torch.testing.assert_close(fresh(x), model(x))


def test_dtype_change_replans_and_runs():
    model = nn.Linear(4, 3)
    opt = optimize(model, passes="")
    x = torch.randn(2, 4)
    opt(x)
    opt.to(torch.float64)
    out = opt(x.double())
    assert out.dtype == torch.float64 and opt.plans_built == 2
    torch.testing.assert_close(out, model(x.double()))


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, pair, scale):
        a, b = pair
        h = self.fc(a) * scale
        return {"sum": h + b, "parts": [h, b.abs()], "count": 3}


def test_structured_inputs_and_outputs():
    model = Structured()
    opt = optimize(model, passes="")
    pair = (torch.randn(3, 4, requires_grad=True), torch.randn(3, 4))
    scale = torch.tensor(2.0)
    out, expected = opt(pair, scale), model(pair, scale)
    assert out["count"] == 3 and isinstance(out["parts"], list)
    torch.testing.assert_close(out["sum"], expected["sum"])
    out["sum"].sum().backward()
    assert pair[0].grad is not None


class Options(nn.Module):
    """Plain (non-tensor) arguments, as real models take them: an optional mask, a scale, a flag."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask=None, scale=1.0, activation="tanh", return_hidden=False):
        hidden = self.fc(x) * scale
        if mask is not None:
            hidden = hidden.masked_fill(mask, 0.0)
        out = hidden.tanh() if activation == "tanh" else hidden.relu()
        return (out, hidden) if return_hidden else out


@pytest.mark.parametrize("passes", ["", None])
def test_plain_arguments_are_planned_as_constants_one_plan_per_value(passes):
    model = Options()
    opt = optimize(copy.deepcopy(model), passes=passes)  # None: the default pipeline
    x, mask = torch.randn(4, 8), torch.rand(4, 8) > 0.5
    calls = [((x,), {}), ((x, None, 0.5), {}), ((x, mask), {"activation": "relu"}),
             ((x,), {"mask": mask, "scale": 2.0, "return_hidden": True}), ((x, None, 0.5), {})]
    for args, kwargs in calls:
        assert_equivalent(model, opt, *args, kwargs=kwargs)
    assert opt.plans_built == 4  # the last call finds the plan of the second
    with torch.no_grad():
        torch.testing.assert_close(opt(x, None, -0.5), model(x, None, -0.5))


def test_a_plain_argument_that_changes_every_call_warns_once():
    model = Options()
    opt = optimize(model, passes="")
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match=r"8 times .* of args\[2\]: .*torch.tensor\(value\)") as caught:
        for step in range(10):
            torch.testing.assert_close(opt(x, None, 0.1 * step), model(x, None, 0.1 * step))
    (replanned,) = [w for w in caught if "planned this model" in str(w.message)]
    assert replanned.filename == __file__  # it points at the caller's line
    assert opt.plans_built == 10


class _Scheduled(nn.Module):
    """Two losses weighted by an attribute the training loop sets every step (a schedule)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        self.alpha = 0.0

    def forward(self, x):
        y = self.head(x)
        return y.square().mean() + self.alpha * y.abs().mean()


def test_a_module_attribute_that_changes_every_call_warns_once_naming_it():
    # Each value is a new plan (the plan runs the graph, where the value is a constant), and the warning
    # counted only the call's plain arguments: a schedule replanned every step, silently.
    model = _Scheduled()
    opt = optimize(model, passes="")
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match=r"8 times .* of alpha, head\.1\.scale: .*register_buffer") as caught:
        for step in range(10):
            model.alpha = 0.1 * step
            torch.testing.assert_close(opt(x), _Scheduled.forward(model, x))
            model.head[1].scale = step  # a plain attribute of a submodule that varies too
    (replanned,) = [w for w in caught if "planned this model" in str(w.message)]
    assert replanned.filename == __file__
    assert opt.plans_built == 10


class Dropper(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        noise = torch.randn_like(x)
        return self.drop(self.fc(x + noise)).tanh()


def test_random_ops_match_eager_under_the_same_seed():
    model = Dropper()
    assert_equivalent(model, optimize(model, passes=""), torch.randn(8, 16), exact=True)


def test_batchnorm_running_statistics_update_like_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5))
    reference = copy.deepcopy(model)
    opt = optimize(model, passes="")
    x = torch.randn(7, 5)
    for _ in range(2):
        opt(x).sum().backward()
        reference(x).sum().backward()
    bn, ref = model[1], reference[1]
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=0, atol=0)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=0, atol=0)
    assert bn.num_batches_tracked.item() == ref.num_batches_tracked.item() == 2


class CheckpointedSegment(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 12), nn.Linear(12, 6)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self._segment, x, use_reentrant=False).tanh()

    def _segment(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_checkpointed_segment_recomputes_with_the_models_current_parameters():
    # torch.utils.checkpoint runs the segment again inside the backward: that run must read the traced
    # parameters (inputs of the plan), not the module's own as constants frozen at the first call
    torch.manual_seed(0)
    model = CheckpointedSegment()
    reference = copy.deepcopy(model)
    opt = optimize(model)
    x = torch.randn(5, 6, requires_grad=True)
    assert_equivalent(reference, opt, x)
    with torch.no_grad():
        for module in (model, reference):
            for p in module.parameters():
                p.mul_(-0.5)
    assert_equivalent(reference, opt, x)


def test_fused_lstm_trains_like_eager():
    # on CPU nn.LSTM runs oneDNN's layer, which returns the workspace its backward reads only in grad
    # mode; the plan runs its forward with grad mode off
    torch.manual_seed(0)
    model = nn.LSTM(8, 16, num_layers=2)
    inputs = (torch.randn(30, 3, 8),)
    opt = optimize(model)
    assert_equivalent(model, opt, *inputs)
    for train in (True, False):  # and inference does not make the workspace that eager does not make
        eager_step, opt_step = step_fn(model, inputs, train=train), step_fn(opt, inputs, train=train)
        opt_step()
        assert measure(opt_step).peak <= measure(eager_step).peak


_CLOSED_OVER = torch.randn(3, requires_grad=True)


class _ScaledGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * _CLOSED_OVER


class ScalesItsGradient(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return _ScaledGradient.apply(self.lin(x))


def test_a_backward_that_reads_a_closed_over_tensor_is_a_clear_error():
    # a plan would keep the tensor's value of the first call, and never give it a gradient
    opt = optimize(ScalesItsGradient(), passes="")
    with pytest.raises(CaptureError, match=r"neither an argument nor a parameter.*_tensor_constant"):
        opt(torch.randn(2, 3)).sum().backward()


class MutatesInput(nn.Module):
    def forward(self, x, counter):
        counter.add_(1)
        return x * 2


def test_model_that_mutates_an_input_behaves_like_eager():
    opt = optimize(MutatesInput(), passes="")
    counter = torch.zeros(())
    x = torch.randn(3, requires_grad=True)
    opt(x, counter).sum().backward()
    opt(x, counter)
    assert counter.item() == 2


class UpdatesParameterInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        with torch.no_grad():
            self.w.mul_(0.5)  # a weight update inside forward: autograd allows it under no_grad
        return x * self.w


def test_inplace_update_of_a_parameter_is_a_clear_error():
    opt = optimize(UpdatesParameterInPlace(), passes="")
    with pytest.raises(CaptureError, match=r"writes in place into parameter 'w'.*test_optimize.py"):
        opt(torch.randn(3, requires_grad=True))


def test_inference_renormalises_embedding_rows_in_place_as_eager_does():
    # nn.Embedding(max_norm=...) rescales the rows it reads in its own weight. Under no_grad eager
    # does so, and so does a plan for inference (it runs outside autograd); training still refuses.
    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.out = nn.Embedding(50, 8, max_norm=1.0), nn.Linear(8, 3)

        def forward(self, ids):
            return self.out(self.embed(ids)).sum(1)

    torch.manual_seed(0)
    model, ids = Lookup(), torch.randint(0, 50, (4, 6))
    reference, before = copy.deepcopy(model), model.embed.weight.detach().clone()
    with torch.no_grad():
        torch.testing.assert_close(optimize(model)(ids), reference(ids))
    torch.testing.assert_close(model.embed.weight, reference.embed.weight)
    assert not torch.equal(model.embed.weight, before)  # the rows read were rescaled...
    assert (model.embed.weight[ids.unique()].norm(dim=1) <= 1.0 + 1e-4).all()  # ...to norm 1 at most
    # In training the refusal names max_norm and the fix that gives the same results (the renorm out of
    # the model, as F.embedding does it, and the embedding without max_norm); it told users to write an
    # out-of-place op, which they cannot: the write is F.embedding's.
    with pytest.raises(CaptureError, match=r"nn\.Embedding\(max_norm=\.\.\.\).*'embed\.weight'.*embedding_renorm_"):
        optimize(Lookup())(ids).sum().backward()
    torch.manual_seed(0)
    model, fixed = Lookup(), Lookup()
    fixed.load_state_dict(model.state_dict())
    fixed.embed.max_norm = None
    with torch.no_grad():
        torch.embedding_renorm_(fixed.embed.weight, ids, 1.0, 2.0)
    assert_equivalent(model, optimize(fixed), ids)
    torch.testing.assert_close(model.embed.weight, fixed.embed.weight)  # renormalised by the reference run


class MutatesDifferentiable(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        y = x * 2
        y.mul_(self.w)
        x.add_(1)
        return y


class _ClobbersASavedValue(nn.Module):
    def __init__(self, assign: bool):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.assign = assign

    def forward(self, x):
        h = torch.sigmoid(self.fc(x))  # saves its result for the backward
        if self.assign:
            h[:, :2] = 0
        else:
            h.mul_(2)
        return (h * x).sum()


@pytest.mark.parametrize("assign", [False, True])
def test_a_saved_value_written_in_place_names_both_lines_and_the_fix(assign):
    import inspect

    lines, first = inspect.getsourcelines(_ClobbersASavedValue.forward)
    saver = first + next(i for i, line in enumerate(lines) if "torch.sigmoid" in line)
    writer = first + next(i for i, line in enumerate(lines) if ("h[:, :2] = 0" if assign else "h.mul_(2)") in line)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _ClobbersASavedValue(assign)(torch.randn(4, 8)).backward()  # eager fails too
    with pytest.raises(CaptureError) as info:
        optimize(_ClobbersASavedValue(assign))(torch.randn(4, 8))
    message = str(info.value)
    assert f"`sigmoid` at test_optimize.py:{saver}" in message
    assert f"test_optimize.py:{writer}" in message and "then writes into it in place" in message
    assert ("assign into a clone" in message) if assign else ("out-of-place `mul` there instead of `mul_`" in message)


class _ClobbersASavedInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        g = torch.nn.functional.gelu(h)  # saves its input for the backward
        h += 1
        return (g * h).sum()


def test_an_input_saved_by_an_op_and_written_in_place_after_names_both_lines_and_the_fix():
    # autograd then names the in-place op itself (the written tensor's history ends in it), not the saver
    import inspect

    lines, first = inspect.getsourcelines(_ClobbersASavedInput.forward)
    reader = first + next(i for i, line in enumerate(lines) if "gelu" in line)
    writer = first + next(i for i, line in enumerate(lines) if "h += 1" in line)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _ClobbersASavedInput()(torch.randn(4, 8)).backward()  # eager fails too
    with pytest.raises(CaptureError) as info:
        optimize(_ClobbersASavedInput())(torch.randn(4, 8))
    message = str(info.value)
    assert f"`add_` at test_optimize.py:{writer}" in message
    assert f"`gelu` at test_optimize.py:{reader}" in message
    assert "out-of-place `add` there instead of `add_`" in message


def test_inplace_update_of_a_differentiable_input_is_a_clear_error():
    opt = optimize(MutatesDifferentiable(), passes="")
    x = torch.randn(3, requires_grad=True).clone()  # a non-leaf: eager allows the in-place add
    with pytest.raises(CaptureError, match=r"writes in place into an input that requires grad at .*test_optimize.py"):
        opt(x)


def test_wrong_arity_says_what_is_wrong():
    opt = optimize(nn.Linear(3, 3), passes="")
    with pytest.raises(CaptureError, match="TypeError"):
        opt(torch.randn(2, 3), torch.randn(2, 3))


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


def test_uncapturable_model_raises_or_falls_back_to_eager():
    x = torch.randn(4)
    with pytest.raises(CaptureError, match='fallback="eager"'):
        optimize(DataDependent())(x)
    opt = optimize(DataDependent(), fallback="eager")
    with pytest.warns(UserWarning, match="eagerly"):
        out = opt(x)
    torch.testing.assert_close(out, DataDependent()(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt(x)  # the decision is cached: no second warning


class SamplesNormal(nn.Module):
    def __init__(self, validate_args):
        super().__init__()
        self.mu, self.log_sigma = nn.Linear(8, 4), nn.Linear(8, 4)
        self.validate_args = validate_args

    def forward(self, x):
        normal = torch.distributions.Normal(self.mu(x), self.log_sigma(x).exp(), validate_args=self.validate_args)
        z = normal.rsample()
        return normal.log_prob(z).sum()


def test_distribution_argument_checks_are_a_clear_error_with_their_fix():
    with pytest.raises(CaptureError, match=r"torch.distributions checks the values.*test_optimize.py.*validate_args=False"):
        # explicit: torch's default is off once torch.compile has run in the process
        optimize(SamplesNormal(validate_args=True))(torch.randn(5, 8))
    model = SamplesNormal(validate_args=False)  # the fix the message gives
    assert_equivalent(model, optimize(model), torch.randn(5, 8))


class PacksSequences(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 8)

    def forward(self, x, lengths):
        return self.rnn(nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False))[1]


class SparseEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(50, 8, sparse=True)

    def forward(self, index):
        return self.embedding(index).sum()


def test_value_dependent_shapes_and_sparse_tensors_are_clear_errors():
    # a packed sequence's shapes follow the lengths' values; a sparse embedding's gradient is sparse
    # the packing has its own message, with the fix the troubleshooting guide gives
    with pytest.raises(CaptureError, match=r"pack_padded_sequence makes its batch sizes from the values of the "
                                           r"lengths at .*test_optimize.py.*mask the padded steps"):
        optimize(PacksSequences())(torch.randn(6, 3, 4), torch.tensor([6, 4, 2]))
    with pytest.raises(CaptureError, match=r"sparse_coo tensor; it plans dense.*sparse=False"):
        optimize(SparseEmbedding())(torch.randint(0, 50, (4, 6))).backward()


class _InverseSTFT(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("window", torch.hann_window(64))
        self.mix = nn.Linear(33, 33)

    def forward(self, spectrum):
        real = self.mix(spectrum.real.transpose(1, 2)).transpose(1, 2)
        return torch.istft(torch.complex(real, spectrum.imag), 64, 16, window=self.window, length=1000)


def test_a_value_check_inside_a_torch_function_is_named_as_one():
    # torch.istft checks its window's overlap-add on values: the refusal spoke of branches the user's
    # line does not have
    spectrum = torch.stft(torch.randn(2, 1000), 64, 16, window=torch.hann_window(64), return_complex=True)
    with pytest.raises(CaptureError, match=r"test_optimize.py.*torch.istft.*a torch function there that reads values"):
        optimize(_InverseSTFT())(spectrum)


class CTCHead(nn.Module):
    def __init__(self, reduction):
        super().__init__()
        self.proj = nn.Linear(12, 6)
        self.ctc = nn.CTCLoss(reduction=reduction)

    def forward(self, x, targets, input_lengths, target_lengths):
        return self.ctc(self.proj(x).log_softmax(-1), targets, input_lengths, target_lengths)


def test_ctc_loss_with_lengths_as_ints_is_planned_and_its_value_dependent_forms_are_clear_errors():
    x, targets = torch.randn(20, 3, 12), torch.randint(1, 6, (3, 5))
    for reduction in ("sum", "none"):
        model = CTCHead(reduction)
        opt = optimize(copy.deepcopy(model))
        assert_equivalent(model, opt, x, targets, (20, 20, 20), (5, 4, 3))
        assert_equivalent(model, opt, x, targets, (20, 17, 20), (5, 4, 2))
        assert opt.plans_built == 2
    for lengths in [((20, 20, 20), (5, 4, 3)), (torch.full((3,), 20), torch.tensor([5, 4, 3]))]:
        with pytest.raises(CaptureError, match=r"CTC loss sizes its work from the values of the lengths.*Fix"):
            optimize(CTCHead("mean"))(x, targets, *lengths)


def test_plan_and_code_are_readable():
    opt = optimize(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), passes="")
    with pytest.raises(RuntimeError, match="call the module once"):
        opt.code
    opt(torch.randn(2, 4)).sum().backward()
    assert "training plan: peak" in str(opt.plan) and "->" in str(opt.plan)
    code = opt.code
    assert "# forward" in code and "# backward" in code and "relu" in code and "threshold_backward" in code
    assert opt.plan.saved_bytes > 0


def test_retain_graph_allows_a_second_backward():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    opt = optimize(model, passes="")
    x = torch.randn(3, 4)
    loss = opt(x).sum()
    loss.backward(retain_graph=True)
    first = model[0].weight.grad.clone()
    loss.backward()
    torch.testing.assert_close(model[0].weight.grad, 2 * first)


def test_public_api():
    assert memplan.optimize is optimize
    with pytest.raises(ValueError, match="fallback"):
        optimize(nn.Linear(2, 2), fallback="sometimes")
    with pytest.raises(ValueError, match="unknown pass"):
        optimize(nn.Linear(2, 2), passes="nonexistent")


def test_gradients_of_gradients_are_refused_not_wrong():
    # A plan's backward runs outside autograd: the gradients it hands back are exact, but a graph
    # recorded through it would miss every term through its saved values. With create_graph=True the
    # first-order gradients are still eager's, and differentiating them again raises.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(5, 6, requires_grad=True)
    opt = optimize(model)
    (eager,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    (planned,) = torch.autograd.grad(opt(x).sum(), x, create_graph=True)
    torch.testing.assert_close(planned, eager)
    with pytest.raises(memplan.HigherOrderGradientError, match="create_graph=True"):
        planned.pow(2).sum().backward()  # a gradient penalty
    x.grad = None
    opt(x).sum().backward(create_graph=True)  # asked for, never used: the gradients are still right
    torch.testing.assert_close(x.grad, eager.detach())


def test_a_compiled_module_is_refused_with_the_fix():
    compiled = torch.compile(nn.Linear(4, 2))
    with pytest.raises(CaptureError, match=r"torch.compile.*_orig_mod"):
        optimize(compiled)
    opt = optimize(compiled._orig_mod)
    x = torch.randn(3, 4)
    torch.testing.assert_close(opt(x), compiled._orig_mod(x))


# ----------------------------------------------------------------------------------------------
# what the traced code read besides tensors, changed after planning


class _Configurable(nn.Module):
    """Reads a plain attribute and a flag that a user may change between calls."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.scale = 1.0
        self.residual = True

    def forward(self, x):
        y = self.a(x) * self.scale
        return y + x if self.residual else y


def _planned_beside_a_copy(cls, x):
    """A model, an untouched copy of it, and the model optimized, checked equal to the copy once."""
    torch.manual_seed(0)
    model = cls()
    reference = copy.deepcopy(model)
    opt = optimize(model)
    assert_equivalent(reference, opt, x)
    return model, reference, opt


def test_plain_attributes_changed_after_planning_are_planned_again():
    # A plan runs the graph, not the module's Python: it kept scale 1.0 and the residual, silently.
    x = torch.randn(3, 4, requires_grad=True)
    model, reference, opt = _planned_beside_a_copy(_Configurable, x)
    for change in (lambda m: setattr(m, "scale", 3.0), lambda m: setattr(m, "residual", False),
                   lambda m: m.a.eval()):
        change(model)
        change(reference)
        assert_equivalent(reference, opt, x)


def test_hooks_registered_after_planning_run():
    torch.manual_seed(0)
    model, x = _Configurable(), torch.randn(3, 4)
    reference = copy.deepcopy(model)
    opt = optimize(model)
    with torch.no_grad():
        opt(x)
        for m in (model, reference):
            m.a.register_forward_hook(lambda module, args, out: out * 0.5)
        torch.testing.assert_close(opt(x), reference(x))
        # a hook called for what it records would run only while planning: refused (see test_bad_input.py)
        model.register_forward_hook(lambda module, args, out: None)
        with pytest.raises(CaptureError, match="returned None"):
            opt(x)


def test_autocast_turned_on_after_planning_gives_autocasts_outputs():
    torch.manual_seed(0)
    model, x = _Configurable(), torch.randn(3, 4)
    model.residual = False  # the output is then the linear layer's, in autocast's dtype
    opt = optimize(model)
    opt(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = opt(x), model(x)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected)


class _PlainTensorAttribute(nn.Module):
    """A mask kept as a plain tensor attribute (not a buffer): a constant of the graph, which the
    gradient of the product reads too."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.mask = torch.tensor([1.0, 0.0, 2.0, 1.0])

    def forward(self, x):
        return (self.a(x) * self.mask).sum()


def test_a_plain_tensor_attribute_read_by_the_backward_and_then_replaced():
    # The backward's copy of the constant was never emitted (KeyError while building the plan); and a
    # mask assigned after planning was not seen (the plan kept the old one).
    x = torch.randn(3, 4, requires_grad=True)
    model, reference, opt = _planned_beside_a_copy(_PlainTensorAttribute, x)
    model.mask.mul_(2)
    reference.mask.mul_(2)
    assert_equivalent(reference, opt, x)
    model.mask = torch.tensor([0.0, 1.0, 0.0, 3.0])
    reference.mask = model.mask.clone()
    assert_equivalent(reference, opt, x)


def test_batch_norm_running_statistics_are_updated_once_per_step():
    """``native_batch_norm`` writes the running statistics without saying so in its schema: a plan that
    recomputes it in the backward (to get the batch statistics again) updated them twice a step."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.Conv2d(8, 32, 1, bias=False), nn.BatchNorm2d(32)).train()
    eager, planned = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(4, 3, 16, 16)
    opt = memplan.optimize(planned)
    for _ in range(2):
        eager(x).sum().backward()
        opt(x).sum().backward()
    torch.testing.assert_close(planned[2].running_mean, eager[2].running_mean)
    torch.testing.assert_close(planned[2].running_var, eager[2].running_var)
    assert planned[2].num_batches_tracked == eager[2].num_batches_tracked == 2
    assert opt.code.count("native_batch_norm.default(") == 1  # not recomputed in the backward


class _WithOptimizedEncoder(nn.Module):
    """A model of which only one part is optimized."""

    def __init__(self):
        super().__init__()
        self.encoder = memplan.optimize(nn.Sequential(nn.Linear(4, 8), nn.Tanh()))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.encoder(x))


def test_a_parent_saves_and_loads_an_optimized_part():
    # The parent's state_dict() took the optimized module's keys (the original's) while its
    # load_state_dict() walked into `model`: its own checkpoint failed to load.
    torch.manual_seed(0)
    source, x = _WithOptimizedEncoder(), torch.randn(3, 4)
    source(x).sum().backward()
    state = source.state_dict()
    assert "encoder.0.weight" in state
    target = _WithOptimizedEncoder()
    target.load_state_dict(state)
    torch.testing.assert_close(target(x), source(x))
    target.load_state_dict({k.replace("encoder.", "encoder.model."): v for k, v in state.items()})  # named_parameters' keys
    torch.testing.assert_close(target(x), source(x))


def test_copies_of_a_planned_module_plan_again():
    # A plan holds fake tensors and compiled code: deepcopy raised on a fake tensor's data pointer and
    # pickle on a local function, once the module had been called.
    import io
    import pickle

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(3, 4)
    opt = memplan.optimize(model)
    opt(x).sum().backward()
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert copied.plan is None
        assert_equivalent(copied.original, copied, x)
        torch.testing.assert_close(copied(x), opt(x))
    assert opt.plan is not None  # the original keeps its plans


def test_attributes_of_the_original_read_through():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    model.config = {"width": 8}
    opt = memplan.optimize(model)
    assert opt.config == {"width": 8}
    with pytest.raises(AttributeError):
        opt.missing_attribute


@pytest.mark.parametrize("options", [{"chunk.nests": False}, {"nonexistent.opt": 1}, {"chunk": False},
                                     {"remat.bann_ops": ()}])
def test_a_misspelt_pass_option_is_an_error(options):
    # They were accepted and did nothing.
    with pytest.raises(ValueError, match="option"):
        memplan.optimize(nn.Linear(4, 4), options=options)


def test_max_overhead_must_be_a_number():
    with pytest.raises(TypeError, match="max_overhead must be a number"):
        memplan.optimize(nn.Linear(4, 4), max_overhead="0.1")
