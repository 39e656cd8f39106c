import pytest
import torch
from torch import nn

import memplan
from memplan.testing import assert_equivalent, is_well_conditioned, random_model, zoo


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.fn(x * self.w)


def test_is_well_conditioned_tells_rounding_amplifiers_and_overflows_from_the_rest():
    x = torch.rand(8, 4) * 3
    assert is_well_conditioned(Fn(torch.tanh), x)
    assert is_well_conditioned(Fn(lambda v: v.max(1)), x)  # indices compared exactly
    assert not is_well_conditioned(Fn(lambda v: torch.sin(torch.exp(torch.exp(v + 2)))), x)  # sin of ~1e20
    assert not is_well_conditioned(Fn(lambda v: torch.exp(torch.exp(v * 3))), x)  # overflow: inf, NaN gradients
    # random programs: most are well-conditioned, and the seeds named in the pass tests are not
    assert not is_well_conditioned(*_flat(random_model(3122, requires_grad_input=True)))
    assert sum(is_well_conditioned(*_flat(random_model(s, requires_grad_input=True))) for s in range(20)) >= 18


def test_a_gradient_that_is_rounding_noise_on_every_scale_is_ill_conditioned():
    """The maximum of a cosine similarity is the diagonal's 1 whatever x is: x's gradient is zero in
    exact arithmetic, and its float32 values (about eps) are noise that two summation orders need not
    agree on. A gradient that cancels beside others of scale 1 (a bias before a centring) is judged on
    its family's floor instead, and stays comparable."""
    x = torch.randn(2, 17, 4, generator=torch.Generator().manual_seed(0)).requires_grad_()
    cosine = Fn(lambda v: torch.nn.functional.cosine_similarity(v[..., :, None, :], v[..., None, :, :], dim=-1).amax(-1))
    assert not is_well_conditioned(cosine, x)
    centred = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16, elementwise_affine=False), nn.Linear(16, 4))
    assert is_well_conditioned(centred, x)


def test_a_sum_that_cancels_from_larger_terms_is_judged_against_float64():
    """Sums of 25600 minus 25600 round on the scale of their terms, not of their result (about 50): two
    orders differ by more than the derived tolerance, yet each is as close to the float64 result as
    the other. A difference eager's rounding does not explain (1.0, where sqrt(256) times eager's
    distance is 0.05) is still refused, the message giving both distances from float64."""
    big = torch.full((256,), 100.0)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))

    def original(v):
        return ((v + big).sum(-1) - big.sum(),)

    def reordered(v):
        return ((v + big).flip(-1).reshape(64, 16, 16).sum(-1).sum(-1) - big.sum(),)

    with pytest.raises(AssertionError):  # beyond the derived tolerance alone
        assert_equivalent(original, reordered, x, grad=False, rtol=0.0, atol=256 * torch.finfo().eps * 54)
    assert_equivalent(original, reordered, x, grad=False)
    with pytest.raises(AssertionError, match="Against the original run in float64"):
        assert_equivalent(original, lambda v: (reordered(v)[0] + 1.0,), x, grad=False)
    nan = x.clone()
    nan[3, 5] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):  # never arbitrated
        assert_equivalent(original, lambda v: (reordered(v)[0].nan_to_num(0.0),), nan, grad=False)


def test_is_well_conditioned_leaves_the_rng_alone():
    x = torch.rand(8, 4)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    assert is_well_conditioned(Fn(lambda v: torch.nn.functional.dropout(v, 0.5)), x)  # same mask in both runs
    assert torch.equal(torch.rand(3), expected)


def _flat(pair):
    model, inputs = pair
    return (model, *inputs)


def test_assert_equivalent_passes_keyword_arguments_and_names_the_leaf_that_differs():
    def model(x, *, weight, scale=1.0):
        return (x * weight).sum() * scale

    def other_scale(x, *, weight, scale=1.0):
        return model(x, weight=weight, scale=scale + 1.0)

    def wrong_gradient(x, *, weight):  # the same value, but d/dweight is 2 instead of x
        return (x * weight.detach()).sum() + (weight - weight.detach()).sum() * 2.0

    x, weight = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    assert_equivalent(model, model, x, kwargs={"weight": weight, "scale": 2.0})
    with pytest.raises(AssertionError, match=r"output 0 differs"):
        assert_equivalent(model, other_scale, x, kwargs={"weight": weight})
    with pytest.raises(AssertionError, match=r"gradient of kwargs\['weight'\] differs"):
        assert_equivalent(model, wrong_gradient, x, kwargs={"weight": weight})
    assert x.grad is None and weight.grad is None  # the caller's tensors are copied, not used


def test_assert_equivalent_without_gradients_compares_what_inference_runs():
    # An optimized module plans a call under no_grad apart from one with gradients (the inference plan);
    # grad=False ran the models with gradients on, so it never compared the inference plan.
    class OffInInference(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, inputs):
            return self.inner(inputs) + (0.0 if torch.is_grad_enabled() else 1.0)

    torch.manual_seed(0)
    model, x = nn.Linear(4, 3), torch.randn(5, 4)
    off_in_inference = OffInInference(model)
    assert_equivalent(model, off_in_inference, x)
    with pytest.raises(AssertionError, match="output 0 differs"):
        assert_equivalent(model, off_in_inference, x, grad=False)


def test_models_that_update_their_buffers_start_from_the_same_values():
    # The first run advanced spectral_norm's power-iteration vector before the second: a model
    # compared with itself failed.
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(16, 32)), nn.ReLU(), nn.Linear(32, 1))
    x = torch.randn(4, 16)
    assert_equivalent(model, model, x)
    assert_equivalent(model, model, x, grad=False)


class _Counter(nn.Module):
    def __init__(self, step):
        super().__init__()
        self.step = step
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(self.step)
        return x * 2


def test_buffers_that_end_apart_are_a_difference():
    with pytest.raises(AssertionError, match="buffer count differs"):
        assert_equivalent(_Counter(1.0), _Counter(2.0), torch.randn(3))


# ----------------------------------------------------------------------------------------------
# tolerances: derived from the scale of the values and the length of the sums (see docs/testing.md)

EPS = torch.finfo(torch.float32).eps


def _identity(v):
    return v * 1.0


def _shifted(delta):
    """A model whose output is its input plus ``delta`` (a tensor or a number)."""
    return lambda v: v + delta


def test_a_difference_at_the_derived_scale_passes_and_one_past_it_fails():
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    bound = 64 * EPS * x.abs().max()  # terms: the largest dimension of the input
    assert_equivalent(_identity, _shifted(0.9 * bound), x, grad=False)
    with pytest.raises(AssertionError, match=r"differ by more than .*\nAllowed: .* = 64 terms x eps 1.19e-07"):
        assert_equivalent(_identity, _shifted(1.1 * bound), x, grad=False)
    assert_equivalent(_identity, _shifted(3 * bound), x, grad=False, terms=256)  # a longer sum may round further


def test_a_sum_in_another_order_passes_and_is_not_bit_for_bit():
    torch.manual_seed(0)
    x = torch.randn(4096, 16) * 100

    def in_chunks(v):  # what the chunk pass does to a reduction
        return sum(part.sum(0) for part in v.split(100))

    assert not torch.equal(in_chunks(x), x.sum(0))
    assert_equivalent(lambda v: v.sum(0), in_chunks, x)
    with pytest.raises(AssertionError, match=r"not bit for bit equal.*exact=True"):
        assert_equivalent(lambda v: v.sum(0), in_chunks, x, exact=True)


def test_a_real_error_fails():
    torch.manual_seed(0)
    x = torch.randn(256, 32, requires_grad=True)
    with pytest.raises(AssertionError, match="output 0 differs"):
        assert_equivalent(_identity, lambda v: v * (1 + 1e-3), x)
    with pytest.raises(AssertionError, match="gradient of args\\[0\\] differs"):  # the same value, a wrong gradient
        assert_equivalent(_identity, lambda v: v + (v - v.detach()) * 1e-3, x)


def test_near_zero_elements_of_a_large_tensor_are_judged_at_the_tensors_scale():
    x = torch.tensor([1000.0, 1e-6, -2e-6, 0.0])
    nudge = torch.tensor([0.0, 1e-5, -1e-5, 1e-5])  # 10x the element, 1e-8 of the tensor's scale
    assert_equivalent(_identity, _shifted(nudge), x, grad=False)
    with pytest.raises(AssertionError, match=r"(?s)1 of 4 elements .* index \(0,\) .*scale 1000"):
        assert_equivalent(_identity, _shifted(torch.tensor([1.0, 0.0, 0.0, 0.0])), x, grad=False)


class _BiasBeforeCentring(nn.Module):
    """The gradient of ``first.bias`` is zero (the centring removes whatever it adds), and computes to
    the rounding noise of a sum over the batch; ``chunks`` sums it in another order."""

    def __init__(self, chunks=1):
        super().__init__()
        self.chunks = chunks
        self.first, self.second = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        h = torch.cat([self.first(part) for part in x.chunk(self.chunks)])
        return self.second(h - h.mean(0, keepdim=True))


def test_a_tensor_of_rounding_noise_is_judged_at_its_familys_scale():
    torch.manual_seed(0)
    model, x = _BiasBeforeCentring(), torch.randn(256, 32)
    chunked = _BiasBeforeCentring(chunks=8)
    chunked.load_state_dict(model.state_dict())
    upstream = torch.randn(256, 32)
    bias = [torch.autograd.grad(m(x), m.first.bias, upstream)[0] for m in (model, chunked)]
    assert bias[0].abs().max() < 1e-3  # noise, where the largest gradient is about 40
    # Judged at its own scale, another order's noise would be a difference:
    assert (bias[1] - bias[0]).abs().max() > 256 * EPS * bias[0].abs().max()
    assert_equivalent(model, chunked, x)  # judged at the floor, the gradients' scale over sqrt(256)


def test_nan_positions_must_match():
    x = torch.tensor([1.0, float("nan"), 3.0])
    assert_equivalent(_identity, _identity, x, grad=False)
    assert_equivalent(_identity, _identity, x, grad=False, exact=True)
    with pytest.raises(AssertionError, match=r"NaN at 2 of 3 places .* index \(1,\)"):
        assert_equivalent(_identity, lambda v: v.roll(1), x, grad=False)
    with pytest.raises(AssertionError, match="NaN at 1 of 3 places"):
        assert_equivalent(_identity, lambda v: v.nan_to_num(2.0), x, grad=False)
    with pytest.raises(AssertionError, match="output 0 differs"):  # explicit tolerances too
        assert_equivalent(_identity, lambda v: v.nan_to_num(2.0), x, grad=False, rtol=1.0, atol=1.0)
    y = torch.tensor([1.0, float("inf"), -3.0])
    with pytest.raises(AssertionError, match=r"infinities differ at 1 of 3 places"):
        assert_equivalent(_identity, lambda v: v * torch.tensor([1.0, -1.0, 1.0]), y, grad=False)


def test_explicit_tolerances_are_those_of_assert_close_and_exact_takes_none():
    x = torch.ones(3)
    assert_equivalent(_identity, _shifted(0.01), x, grad=False, rtol=0.0, atol=0.02)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_equivalent(_identity, _shifted(0.01), x, grad=False, rtol=0.0, atol=0.005)
    with pytest.raises(ValueError, match="exact=True"):
        assert_equivalent(_identity, _identity, x, exact=True, atol=0.0, rtol=0.0)


def test_tensors_that_are_not_floating_point_are_compared_exactly():
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    assert_equivalent(lambda v: v.argmax(1), lambda v: v.argmax(1), x, grad=False)
    with pytest.raises(AssertionError, match=r"not bit for bit equal.*torch.int64 values"):
        assert_equivalent(lambda v: v.argmax(1), lambda v: v.argmin(1), x, grad=False)


# ----------------------------------------------------------------------------------------------
# bit-exact passes: a plan made of them alone gives the same bits


EXACT_PASSES = ("inplace", "remat", "timesteps", "concat", "schedule", "arena")


def _exact_cases():
    for z in zoo():
        yield z.name, z.model, z.inputs
    for seed in range(4):
        model, inputs = random_model(seed, requires_grad_input=True)
        yield f"random_{seed}", model, inputs


@pytest.mark.parametrize("passes", [*EXACT_PASSES, ",".join(EXACT_PASSES)])
def test_bit_exact_passes_give_the_same_bits(passes):
    changed = 0
    for _name, model, inputs in _exact_cases():
        opt = memplan.optimize(model, passes=passes, max_overhead=10.0)
        assert_equivalent(model, opt, *inputs, exact=True)
        changed += any(record.changed for record in opt.plan.records) or passes == "arena"  # arena annotates
        assert_equivalent(model, opt, *inputs, grad=False, exact=True)
    assert changed >= 1  # the pass did something on these models: the check is not empty


class _SharedWeightLoop(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, h):
        for _ in range(3):
            h = torch.tanh(h @ self.w)
        return h


def test_inplace_is_exact_but_for_its_fused_accumulations():
    # The weight's gradient is one product per step, summed; inplace fuses the sums into addmm_ (here
    # the product, 1 MiB, is larger than the operands it keeps), whose BLAS adds the product's partial
    # sums into the accumulator as it goes: over a long inner dimension (the batch, 256) the sum rounds
    # in another order.
    torch.manual_seed(0)
    model, x = _SharedWeightLoop(512), torch.randn(256, 512)
    opt = memplan.optimize(model, passes="inplace")
    assert_equivalent(model, opt, x)
    assert "addmm_" in opt.plan.code
    with pytest.raises(AssertionError, match="gradient of w differs: .* not bit for bit equal"):
        assert_equivalent(model, opt, x, exact=True)
    assert_equivalent(model, opt, x, grad=False, exact=True)  # the forward has no accumulation
