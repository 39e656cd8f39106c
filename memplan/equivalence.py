"""Whether two models compute the same thing: outputs, gradients and buffers, within the rounding
error that reordering a sum explains.

The oracle of :mod:`memplan.testing` (public there), here on its own so that the checks inside memplan
that compare a plan with eager (``optimize(..., verify=True)``, the structural fuzzer) use it without
importing the testing helpers, which hand the fuzzer on in turn.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from memplan.capture import leaf_paths

__all__ = ["assert_equivalent", "is_well_conditioned", "settles_near_ties"]


def _grad_leaves(model: nn.Module | Callable[..., Any], call: Any) -> list[torch.Tensor]:
    leaves = [t for t in pytree.tree_leaves(call) if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(model, nn.Module):
        leaves += [p for p in model.parameters() if p.requires_grad]
    return leaves


def _run_with_grads(
    model: Callable[..., Any], inputs: Sequence[Any], kwargs: Mapping[str, Any], grad: bool, seed: int,
    widen: Sequence[torch.dtype] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Outputs and gradients of one call. ``widen``: run on float64 copies of the floating point
    arguments, drawing each upstream gradient in the dtype the narrow run's output had (``widen``
    lists the dtypes of all its outputs, in order)."""

    def fresh(t: torch.Tensor) -> torch.Tensor:
        value = t.detach().to(torch.float64) if widen is not None and t.is_floating_point() else t.detach()
        return value.clone().requires_grad_(t.requires_grad)

    call = pytree.tree_map_only(torch.Tensor, fresh, (tuple(inputs), dict(kwargs)))
    torch.manual_seed(seed)
    with torch.set_grad_enabled(grad):  # without gradients, the call an inference loop makes (no_grad)
        out = model(*call[0], **call[1])
    flat = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not grad:
        return [t.detach() for t in flat], []
    owner = model if isinstance(model, nn.Module) else None
    leaves = _grad_leaves(owner if owner is not None else model, call)
    diff = [t for t in flat if t.requires_grad]
    if not diff or not leaves:
        return [t.detach() for t in flat], []
    # A fixed, non-uniform upstream gradient so every element of every output matters.
    gen = torch.Generator().manual_seed(seed + 1)
    dtypes = [d for t, d in zip(flat, widen or [t.dtype for t in flat]) if t.requires_grad]
    tangents = [torch.randn(t.shape, generator=gen, dtype=d).to(t.device, t.dtype) for t, d in zip(diff, dtypes)]
    grads = torch.autograd.grad(diff, leaves, tangents, allow_unused=True)
    return [t.detach() for t in flat], list(grads)


def _buffers(model: Any) -> list[tuple[str, torch.Tensor]]:
    """The named buffers of ``model`` when it is a module."""
    return list(model.named_buffers()) if isinstance(model, nn.Module) else []


def assert_equivalent(
    original: Callable[..., Any],
    optimized: Callable[..., Any],
    *inputs: Any,
    grad: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    exact: bool = False,
    terms: int | None = None,
    seed: int = 0,
    kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Assert that two models give the same outputs and the same gradients.

    Both run on fresh copies of ``inputs`` (and of the keyword arguments ``kwargs``) under the same RNG
    seed, and from the same buffer values (a forward that updates buffers, running statistics or a
    power iteration's vector, leaves them as one call would; the buffers are compared after the
    calls); with ``grad=False`` under ``torch.no_grad()``, as inference runs (an optimized module then
    runs its inference plan), and only the outputs are compared. Otherwise gradients are taken with
    respect to every tensor argument that requires grad and every parameter of each model (in
    ``parameters()`` order, so an optimized module must expose the original's parameters, as memplan's
    do), with the same random upstream gradient.

    By default each pair of tensors may differ by the rounding error of a sum whose terms are added in
    another order (see Notes): ``n * eps * max(M, F / sqrt(n))``, with ``M`` the original tensor's
    largest magnitude, ``F`` the largest of its family (outputs, gradients or buffers) and ``n`` the
    length of the sums; beyond that, by as much as the original itself rounds away from its float64
    run (the arbiter, see Notes). NaN and infinities are never hidden: the optimized model must give NaN exactly
    where the original does, and the same infinities at the same places. Tensors that are not floating
    point (indices, masks, counts) are compared exactly.

    Parameters
    ----------
    original, optimized : callable
        The models; ``optimized`` is held to ``original``'s results.
    *inputs
        Positional arguments of both calls.
    grad : bool
        Compare gradients too (``True``), or run both models under ``torch.no_grad()`` and compare outputs.
    rtol, atol : float, optional
        Explicit tolerances, passed to :func:`torch.testing.assert_close` as given, instead of the derived
        one. Give both or neither.
    exact : bool
        Bit-exact comparison: ``torch.equal``, with NaN at the same places. For plans made only of the
        passes that keep every sum's order (see Notes).
    terms : int, optional
        ``n``: the length of the longest sum whose order the plan may change. By default the largest
        dimension of any tensor the check sees (the inputs, the original's parameters and buffers, its
        outputs), since a program's sums run along its tensors' dimensions.
    seed : int
        The RNG seed both models run under; ``seed + 1`` draws the upstream gradient.
    kwargs : mapping, optional
        Keyword arguments of both calls.

    Raises
    ------
    AssertionError
        Naming the first output, gradient or buffer that differs, how, and the tolerance it was held to
        and why.

    Notes
    -----
    *The derived tolerance.* With unit roundoff ``u = eps / 2`` (``eps = torch.finfo(dtype).eps``), a sum
    of ``n`` terms computed in any order makes ``n - 1`` additions, each of which rounds its partial sum
    ``s_k`` by at most ``u * |s_k|``. While the partial sums stay within the tensor's scale ``M``, one
    order is within ``(n - 1) * u * M`` of the exact sum and two orders are within
    ``2 * (n - 1) * u * M < n * eps * M`` of each other. The tolerance is absolute: an element near zero
    in a tensor of large values is judged on the tensor's scale, as its rounding error is. It is at
    least the dtype's smallest normal number (kernels that flush subnormals to zero give those as 0).

    *The floor.* A tensor far smaller than the rest of its family is usually a sum that cancelled (the
    gradient of a bias that a centring removes is zero, and computes to rounding noise), whose partial
    sums were on the family's scale ``F``, not its own. With rounding errors of random sign (Higham and
    Mary, "A new approach to probabilistic rounding error analysis", 2019) such noise is about
    ``sqrt(n) * u * F``, and two orders of it differ by about ``sqrt(2 * n) * u * F``, below
    ``n * eps * F / sqrt(n)``: the floor, a typical size and not a bound. A sum over several dimensions
    at once (a convolution's bias gradient sums over batch and pixels) is longer than the default ``n``;
    the bound has room for it, as rounding errors of random sign grow as ``sqrt(n)``, not ``n``. For
    ``bfloat16`` and ``float16`` the bound passes anything once ``n`` reaches ``1 / eps`` (128 and 1024
    terms): pass a smaller ``terms`` where their sums accumulate in float32, or ``exact=True``.

    *The float64 arbiter.* The bound assumes a sum's partial sums stay within its result's scale. A sum
    that cancels from larger terms (a softmax's backward over squared distances ten times the size of
    the gradient it makes) rounds further than that in eager itself. Where the bound refuses a
    floating point tensor, the original runs once more in float64 (a deep copy, the same seed, the
    same upstream gradient), and the optimized tensor passes if it is no further from that run than
    ``sqrt(n)`` times the original's own largest distance from it (at least twice) plus the derived
    tolerance: the original's distance is a typical rounding error, and another order's worst case is
    ``sqrt(n)`` times the typical one. Only while the original is within 1% of the float64 run's scale
    (so the float64 run stands for the exact result). NaN and infinities are never
    arbitrated; the message of a refusal gives both distances. Explicit ``rtol``/``atol`` and
    ``exact=True`` have no arbiter.

    *Bit-exact passes.* ``remat``, ``timesteps``, ``concat``, ``schedule`` and ``arena`` keep every op's
    arithmetic and the order of every sum (recomputation replays the same op on the same values, copies
    move values, reordering ops keeps each op as it is, the arena only annotates), so a plan made of
    them alone is bit-exact; so is the empty pipeline. So is ``inplace``, except for its fused
    accumulations: ``acc.add_(mm(a, b))`` becomes ``acc.addmm_(a, b)``, whose BLAS adds the product's
    partial sums into ``acc`` as it goes, in another order over a long inner dimension. ``chunk`` and
    ``rewrite`` change summation orders and are not. memplan's tests check the bit-exact passes with
    ``exact=True`` on :func:`~memplan.testing.zoo` and :func:`~memplan.testing.random_model` models.
    See ``docs/testing.md``.

    Examples
    --------
    >>> lin = torch.nn.Linear(3, 2)
    >>> assert_equivalent(lin, lin, torch.randn(4, 3), exact=True)
    >>> x = torch.ones(4, 3)
    >>> assert_equivalent(lambda v: v.sum(0), lambda v: v.sum(0) + 1e-3, x)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    AssertionError: output 0 differs: 3 of 3 elements differ by more than 1.907e-06; ...
    """
    if exact and (rtol is not None or atol is not None):
        raise ValueError("exact=True compares bit for bit: give it without rtol and atol")
    if terms is not None and terms < 1:
        raise ValueError(f"terms is the length of a sum, at least 1; got {terms}")
    kwargs = dict(kwargs or {})
    own_a, own_b = _buffers(original), _buffers(optimized)
    before = [b.detach().clone() for _, b in own_b]
    out_a, grads_a = _run_with_grads(original, inputs, kwargs, grad, seed)
    after_a = [b.detach().clone() for _, b in own_a]
    with torch.no_grad():  # the second model starts from its buffers' values before the first call
        for (_, b), value in zip(own_b, before):  # (an optimized module holds the original's buffers)
            b.copy_(value)
    out_b, grads_b = _run_with_grads(optimized, inputs, kwargs, grad, seed)
    if terms is None:
        terms = _longest_dimension([*pytree.tree_leaves((inputs, kwargs)), *_model_tensors(original), *out_a])
    if len(own_a) == len(own_b):  # an optimized module lists the original's buffers, in their order
        check = _Check(rtol, atol, exact, terms, _family_scale(after_a), "buffers")
        for (name, _), a, (_, b) in zip(own_a, after_a, own_b):
            check(f"buffer {name}", a, b.detach(), " after the call")
    if len(out_a) != len(out_b):
        raise AssertionError(f"the models return {len(out_a)} and {len(out_b)} tensors")
    derived = not exact and rtol is None and atol is None
    arbiter = _Arbiter(original, inputs, kwargs, grad, seed, before if len(own_a) == len(own_b) else None,
                       [t.dtype for t in out_a])
    check = _Check(rtol, atol, exact, terms, _family_scale(out_a), "outputs")
    for i, (a, b) in enumerate(zip(out_a, out_b)):
        _judged(check, f"output {i}", a, b, lambda i=i: arbiter.reference(0, i) if derived else None)
    if len(grads_a) != len(grads_b):
        raise AssertionError(f"the models have {len(grads_a)} and {len(grads_b)} gradient leaves")
    names = _leaf_names(original, (tuple(inputs), kwargs))
    check = _Check(rtol, atol, exact, terms, _family_scale(grads_a), "gradients")
    for i, (a, b) in enumerate(zip(grads_a, grads_b)):
        name = names[i] if i < len(names) else f"leaf {i}"
        if a is None or b is None:
            if (a is None) != (b is None):
                raise AssertionError(f"gradient of {name}: one model gives None, the other a tensor")
            continue
        _judged(check, f"gradient of {name}", a, b, lambda i=i: arbiter.reference(1, i) if derived else None)


class _Arbiter:
    """The original model run once more in float64, on demand: the exact results, near enough, that
    both float32 runs round away from (see :func:`_judged`)."""

    def __init__(self, model: Any, inputs: Sequence[Any], kwargs: Mapping[str, Any], grad: bool, seed: int,
                 buffers: Sequence[torch.Tensor] | None, tangent_dtypes: Sequence[torch.dtype]):
        self._args = (model, inputs, kwargs, grad, seed, buffers, tangent_dtypes)
        self._runs: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None

    def reference(self, family: int, index: int) -> torch.Tensor | None:
        """Tensor ``index`` of the float64 run's outputs (``family`` 0) or gradients (1); None when the
        model does not run in float64."""
        if self._runs is None:
            self._runs = self._run()
        found = self._runs[family]
        return found[index] if index < len(found) else None

    def _run(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        model, inputs, kwargs, grad, seed, buffers, dtypes = self._args
        try:
            if isinstance(model, nn.Module):
                if buffers is None:  # the buffers' values before the call are unknown
                    return [], []
                model = copy.deepcopy(model)
                with torch.no_grad():
                    for (_, b), value in zip(_buffers(model), buffers):
                        b.copy_(value)
                model = model.to(torch.float64)
            with torch.random.fork_rng():
                return _run_with_grads(model, inputs, kwargs, grad, seed, widen=dtypes)
        except Exception:  # a model that does not run in float64 has no arbiter
            return [], []


def _judged(check: "_Check", what: str, a: torch.Tensor, b: torch.Tensor,
            reference: Callable[[], torch.Tensor | None]) -> None:
    """``check(what, a, b)``; where the derived tolerance refuses ``b``, the float64 arbiter decides.

    The derived tolerance assumes a sum's partial sums stay within the scale of its result. A
    gradient that cancels from larger terms (a softmax's backward over squared distances of 100 beside
    a result of 10) rounds further than that in eager itself. So ``b`` is also accepted when it is no
    further from the original run in float64 than ``sqrt(n)`` times the original's own largest distance
    from it (at least twice), plus the derived tolerance. Eager's distance is a sample of the typical
    rounding error of the computation, which the probabilistic analysis behind the floor puts at
    ``sqrt(n) * u`` times the scale of the partial sums, where the worst case of another order is
    ``n * u`` times it: ``sqrt(n)`` times the typical one. Only where the original is within 1% of the
    float64 result's scale (otherwise the float64 run does not stand for the exact result: an
    ill-conditioned model, or random draws that differ). Counterexamples of a fixed factor of 2: seeds
    7552 and 3394 of the structural fuzzer (a chunked softmax over L1 distances; a layer norm of a
    cosine similarity's maxima, which are 1 and amplify their rounding 300 times) came out 2.01x and
    2.09x eager's distance from float64."""
    try:
        check(what, a, b)
        return
    except AssertionError as refused:
        usable = a.is_floating_point() and a.layout == torch.strided and b.layout == torch.strided and a.shape == b.shape
        if not (usable and bool(torch.isfinite(a).all() and torch.isfinite(b).all())):
            raise  # NaN and infinities are never arbitrated
        ref = reference()
        if ref is None or ref.shape != a.shape or not bool(torch.isfinite(ref).all()):
            raise
        eager = float((a.double() - ref).abs().max()) if a.numel() else 0.0
        plan = float((b.double() - ref).abs().max()) if b.numel() else 0.0
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        tolerance, factor = check.tolerance(a)[0], max(2.0, math.sqrt(check.terms))
        if eager <= 1e-2 * scale and plan <= factor * eager + tolerance:
            return
        raise AssertionError(
            f"{refused}\nAgainst the original run in float64: the original is {eager:.4g} from it, the optimized "
            f"model {plan:.4g} (allowed: sqrt({check.terms}) = {factor:.3g} times the original's plus {tolerance:.4g}, "
            f"where the original is within 1% of the float64 scale {scale:.4g})."
        ) from None


def _model_tensors(model: Any) -> list[torch.Tensor]:
    """The parameters and buffers of ``model`` when it is a module."""
    if not isinstance(model, nn.Module):
        return []
    return [*model.parameters(), *model.buffers()]


def _longest_dimension(values: Sequence[Any]) -> int:
    """The largest dimension of the tensors among ``values`` (1 if there is none): the default length
    of a sum, as a program's sums run along its tensors' dimensions."""
    return max((size for v in values if isinstance(v, torch.Tensor) for size in v.shape), default=1)


def _scale(t: torch.Tensor) -> float:
    """The largest finite magnitude of a floating point tensor (0.0 if it has none)."""
    magnitudes = _dense(t).abs()
    finite = magnitudes[torch.isfinite(magnitudes)]
    return float(finite.max()) if finite.numel() else 0.0


def _family_scale(tensors: Sequence[torch.Tensor | None]) -> float:
    """The largest finite magnitude among a family's floating point tensors."""
    scales = [_scale(t) for t in tensors if t is not None and (t.is_floating_point() or t.is_complex())]
    return max(scales, default=0.0)


@dataclasses.dataclass(frozen=True)
class _Check:
    """How :func:`assert_equivalent` compares the tensors of one family: outputs, gradients, buffers."""

    rtol: float | None
    atol: float | None
    exact: bool
    terms: int
    family_scale: float
    family: str

    def __call__(self, what: str, a: torch.Tensor, b: torch.Tensor, when: str = "") -> None:
        """Raise ``AssertionError`` when ``b`` (the optimized model's) is not close enough to ``a``."""
        if not self.exact and (self.rtol is not None or self.atol is not None):
            try:
                torch.testing.assert_close(b, a, rtol=self.rtol, atol=self.atol)
            except AssertionError as e:
                raise AssertionError(f"{what} differs{when}:\n{e}") from None
            return
        problem = _mismatch(a, b)
        if problem is None:
            a, b = _dense(a), _dense(b)
            floating = a.is_floating_point() or a.is_complex()
            problem = self._rounding_difference(a, b) if floating and not self.exact else _exact_difference(a, b)
        if problem is not None:
            raise AssertionError(f"{what} differs{when}: {problem}")

    def tolerance(self, a: torch.Tensor) -> tuple[float, str]:
        """The absolute tolerance for a reference tensor ``a`` of this family, and how it was derived."""
        eps = torch.finfo(a.dtype).eps
        own, floor = _scale(a), self.family_scale / math.sqrt(self.terms)
        if own >= floor:
            scale, why = own, "the original's largest magnitude"
        else:
            scale, why = floor, (
                f"the floor: the largest magnitude of the {self.family}, {self.family_scale:.4g}, over "
                f"sqrt({self.terms}), as this tensor's own, {own:.4g}, is smaller (a sum that cancelled)"
            )
        tolerance = self.terms * eps * scale
        reason = (
            f"{tolerance:.4g} = {self.terms} terms x eps {eps:.3g} ({a.dtype}) x scale {scale:.4g} ({why}): "
            f"how far apart two orders of a sum of {self.terms} terms may round (terms= sets the length, "
            "exact=True compares bit for bit; see assert_equivalent's docstring)"
        )
        tiny = torch.finfo(a.dtype).tiny
        if tolerance < tiny:
            tolerance, reason = tiny, f"{tiny:.4g}, the smallest normal {a.dtype}, as the scale is {scale:.4g}"
        return tolerance, reason

    def _rounding_difference(self, a: torch.Tensor, b: torch.Tensor) -> str | None:
        problem = _special_difference(a, b)
        if problem is not None:
            return problem
        tolerance, reason = self.tolerance(a)
        distance = (b - a).abs().masked_fill(~(torch.isfinite(a) & torch.isfinite(b)), 0)  # (both NaN or inf)
        wrong = distance > tolerance
        if not bool(wrong.any()):
            return None
        flat = int(distance.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
        return (
            f"{int(wrong.sum())} of {a.numel()} elements differ by more than {tolerance:.4g}; the largest "
            f"difference is {float(distance.max()):.4g} at index {index} (original {a[index].item():.8g}, "
            f"optimized {b[index].item():.8g}).\nAllowed: {reason}."
        )


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """What makes ``a`` and ``b`` incomparable: shape, dtype or device."""
    for attribute in ("shape", "dtype", "device"):
        if getattr(a, attribute) != getattr(b, attribute):
            return f"{attribute} {getattr(b, attribute)} where the original has {getattr(a, attribute)}"
    return None


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a strided tensor (sparse gradients, say, are compared as their dense values)."""
    return t.detach() if t.layout == torch.strided else t.detach().to_dense()


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    """The index of the first true element of ``mask``."""
    return tuple(int(i) for i in mask.nonzero()[0]) if mask.dim() else ()


def _special_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """NaN where only one of ``a`` and ``b`` has it, or infinities that differ."""
    nan = torch.isnan(a) != torch.isnan(b)
    if bool(nan.any()):
        index = _first(nan)
        return (
            f"NaN at {int(nan.sum())} of {a.numel()} places where the other has none; the first at index "
            f"{index} (original {a[index].item()}, optimized {b[index].item()})"
        )
    infinite = (torch.isinf(a) | torch.isinf(b)) & (a != b)
    if bool(infinite.any()):
        index = _first(infinite)
        return (
            f"infinities differ at {int(infinite.sum())} of {a.numel()} places; the first at index {index} "
            f"(original {a[index].item()}, optimized {b[index].item()})"
        )
    return None


def _exact_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Where ``a`` and ``b`` differ at all (NaN equal to NaN), for ``exact=True`` and non-float tensors."""
    if a.is_floating_point() or a.is_complex():
        problem = _special_difference(a, b)
        if problem is not None:
            return problem
        unequal = (a != b) & ~torch.isnan(a)
    else:
        unequal = a != b
    if not bool(unequal.any()):
        return None
    index = _first(unequal)
    return (
        f"{int(unequal.sum())} of {a.numel()} elements are not bit for bit equal; the first at index {index} "
        f"(original {a[index].item()!r}, optimized {b[index].item()!r}), compared exactly"
        + (" (exact=True)" if a.is_floating_point() or a.is_complex() else f" ({a.dtype} values)")
    )


def is_well_conditioned(model: nn.Module, *inputs: torch.Tensor, rtol: float | None = None, atol: float = 0.0) -> bool:
    """Whether float32 rounding moves the model's outputs and gradients by less than ``rtol`` of their
    scale away from a float64 run of the same model (by default ``sqrt(n)`` times the derived
    tolerance's ``n * eps``).

    Two equivalent programs (a matmul split into row blocks, a sum in another order) round
    differently. A well-conditioned model keeps that difference near the dtype's epsilon, so
    :func:`assert_equivalent` can hold them to a tight tolerance. An ill-conditioned one (the sine of
    a large exponential, say) amplifies it past any fixed tolerance, even in float64. A random test
    should skip such models rather than loosen its tolerance for all of them. So should it skip a model
    whose float64 outputs or gradients are not finite (an overflowed exponential, its NaN gradient).

    Each float32 tensor may differ from its float64 twin by ``rtol * S + atol``, with ``S`` the scale
    :func:`assert_equivalent` judges it on: its own float64 largest magnitude, or the floor of its
    family (outputs or gradients), the family's largest over ``sqrt(n)`` (``n``: the longest
    dimension). The default ``rtol`` is ``n ** 1.5 * eps``: a sum of ``n`` terms rounds by at most
    ``n * eps`` of its partial sums' scale, and the float64 arbiter of :func:`assert_equivalent` allows
    partial sums ``sqrt(n)`` times the result's (a sum that cancels). A model whose rounding moves
    further is amplifying it, and its float32 values are not a computation two orders can agree on.
    Counterexample of a fixed 1e-2: a layer norm of a cosine similarity's maxima, which are all 1, so
    that it multiplies their rounding by 300 (seed 3394 of the structural fuzzer: 3e-4 of the scale).
    So is a tensor that is rounding noise on every scale the comparison knows (a gradient
    that is zero in exact arithmetic, of a family that is all such gradients: the gradient of the
    maximum of a cosine similarity, reached on the diagonal, is one) is ill-conditioned: its float32
    values are noise, and two orders of noise need not agree within any tolerance derived from it.
    The model is deep-copied; both runs take the same upstream gradient and the same RNG seed, and
    the caller's RNG state is left as it was.

    Examples
    --------
    >>> is_well_conditioned(torch.nn.Linear(3, 2), torch.randn(4, 3))
    True
    """
    runs = [_conditioning_run(model, inputs, dtype) for dtype in (torch.float32, torch.float64)]
    return _agree(model, inputs, runs[1], runs[:1], rtol, atol)


def settles_near_ties(model: nn.Module, *inputs: torch.Tensor) -> bool:
    """Whether the model's float32 outputs and gradients stay within :func:`is_well_conditioned`'s
    tolerance of float64's when its inputs move by ``n * eps`` of their values (as much as another order
    of a sum of ``n`` terms may move a result), in two random directions, each both ways.

    A model can be well-conditioned at its inputs and still hold a near tie that float32 cannot decide:
    a minimum over squared distances whose two smallest are 4e-6 apart at a scale of 134 (seed 31468 of
    the structural fuzzer). Eager's float32 picked float64's index; the same sum over features in chunks
    picked the other one, and the gradient went to another row. Both are the float32 answer: another
    order of the sum may close the tie either way. A plan of such a model can be checked for its memory,
    not for its values.

    Examples
    --------
    >>> settles_near_ties(torch.nn.Linear(3, 2), torch.randn(4, 3))
    True
    """
    terms = _longest_dimension([*inputs, *_model_tensors(model)])
    nudge = terms * torch.finfo(torch.float32).eps
    reference = _conditioning_run(model, inputs, torch.float64)
    moved = [_conditioning_run(model, inputs, torch.float32, sign * nudge, draw) for draw in (2, 3) for sign in (1, -1)]
    return _agree(model, inputs, reference, moved, None, 0.0)


def _conditioning_run(model: nn.Module, inputs: Sequence[Any], dtype: torch.dtype, nudge: float = 0.0,
                      draw: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs and gradients of a deep copy of ``model`` in ``dtype`` (inputs moved by ``nudge`` of their
    values in the random direction ``draw``), with the upstream gradient and RNG seed every run shares."""
    copied = copy.deepcopy(model).to(dtype)
    xs = [x.detach().to(dtype).requires_grad_(x.requires_grad) if x.is_floating_point() else x for x in inputs]
    if nudge:
        noise = torch.Generator().manual_seed(draw)
        xs = [x.detach().mul(1 + nudge * torch.randn(x.shape, generator=noise, dtype=x.dtype)).requires_grad_(
            x.requires_grad) if x.is_floating_point() else x for x in xs]
    with torch.random.fork_rng():  # the caller's RNG state is left as it was
        torch.manual_seed(0)
        out = [t for t in pytree.tree_leaves(copied(*xs)) if isinstance(t, torch.Tensor)]
    diff = [t for t in out if t.requires_grad]
    gen = torch.Generator().manual_seed(1)
    tangents = [torch.randn(t.shape, generator=gen).to(t.device, dtype) for t in diff]
    leaves = [x for x in xs if x.requires_grad] + [p for p in copied.parameters() if p.requires_grad]
    grads = torch.autograd.grad(diff, leaves, tangents, allow_unused=True) if diff and leaves else ()
    return [t.detach() for t in out], [g for g in grads if g is not None]


def _agree(model: nn.Module, inputs: Sequence[Any], reference: tuple, runs: Sequence[tuple], rtol: float | None,
           atol: float) -> bool:
    """Whether every float32 run of ``runs`` is within the conditioning tolerance of the float64 ``reference``
    (see :func:`is_well_conditioned`)."""
    out64, grads64 = reference
    terms = _longest_dimension([*inputs, *_model_tensors(model), *out64])
    families = [pair for out32, grads32 in runs for pair in ((out32, out64), (grads32, grads64))]
    for family32, family64 in families:
        floor = _family_scale(family64) / math.sqrt(terms)
        for a, b in zip(family32, family64, strict=True):
            if not b.is_floating_point():
                if not torch.equal(a, b):  # indices, counts
                    return False
                continue
            if not bool(torch.isfinite(b).all()):
                return False
            scale = max(_scale(b), floor)
            within = rtol if rtol is not None else terms ** 1.5 * torch.finfo(a.dtype).eps
            if not bool(((a.double() - b).abs() <= within * (b.abs() + scale) + atol).all()):
                return False
    return True


def _leaf_names(model: Any, call: tuple[tuple, dict]) -> list[str]:
    names = [path for path, t in zip(leaf_paths(call), pytree.tree_leaves(call))
             if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(model, nn.Module):
        names += [n for n, p in model.named_parameters() if p.requires_grad]
    return names
