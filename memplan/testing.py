"""Public testing helpers: the same oracles memplan's own tests use.

- :func:`random_model`: a seeded generator of small random programs (pointwise ops, matmuls,
  reductions, views, broadcasts, in-place updates, concatenations) as ordinary ``nn.Module``s.
- :func:`assert_equivalent`: outputs *and* gradients of two models agree.
- :func:`is_well_conditioned`: whether a model's rounding error stays small enough for such a comparison.
- :func:`zoo`: small models of the common shapes (MLP, conv net, unrolled RNN, attention block).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from memplan.capture import leaf_paths

__all__ = ["Instruction", "RandomProgram", "random_model", "assert_equivalent", "is_well_conditioned", "zoo", "ZooModel"]

_UNARY = ("exp", "sin", "tanh", "relu", "sigmoid", "neg", "square")
_BINARY = ("add", "mul", "sub")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One step of a random program: ``pool[out] = op(pool[args...])``, then drop ``frees``."""

    op: str
    args: tuple[int, ...]
    param: int | None = None
    dim: int = 0
    frees: tuple[int, ...] = ()


class RandomProgram(nn.Module):
    """An interpreter of :class:`Instruction` lists: a model no one wrote by hand.

    Tensors live in a pool; an instruction may drop pool entries afterwards, so Python lifetimes vary
    from "freed at once" to "kept to the end", as in real user code.
    """

    def __init__(self, program: Sequence[Instruction], weights: Sequence[torch.Tensor], outputs: Sequence[int]):
        super().__init__()
        self.program = tuple(program)
        self.weights = nn.ParameterList([nn.Parameter(w) for w in weights])
        self.outputs = tuple(outputs)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pool: list[torch.Tensor | None] = list(inputs)
        for ins in self.program:
            pool.append(self._step(ins, pool))
            for index in ins.frees:
                pool[index] = None
        return tuple(pool[i] for i in self.outputs)

    def _step(self, ins: Instruction, pool: list[torch.Tensor | None]) -> torch.Tensor:
        a = pool[ins.args[0]]
        if ins.op in _UNARY:
            return a * a if ins.op == "square" else getattr(torch, ins.op)(a)
        if ins.op in _BINARY:
            return getattr(torch, ins.op)(a, pool[ins.args[1]])
        if ins.op == "matmul":
            return a @ self.weights[ins.param]
        if ins.op == "sum_keepdim":
            return a.sum(dim=ins.dim, keepdim=True)
        if ins.op == "amax_keepdim":
            return a.amax(dim=ins.dim, keepdim=True)
        if ins.op == "transpose_twice":
            return a.t().contiguous().t()
        if ins.op == "expand_add":
            # a broadcast that materialises: (B, D) + (B, 1) -> (B, D)
            return pool[ins.args[1]] + a.mean(dim=1, keepdim=True).expand_as(pool[ins.args[1]])
        if ins.op == "clone_inplace":
            out = a.clone()
            out.mul_(0.5)
            return out
        if ins.op == "cat_chunk":
            both = torch.cat([a, pool[ins.args[1]]], dim=1)
            left, _right = both.chunk(2, dim=1)
            return left * 2
        if ins.op == "softmax":
            return torch.softmax(a, dim=-1)
        raise ValueError(f"unknown random-program op {ins.op!r}")


def random_model(
    seed: int, *, steps: int = 12, batch: int = 16, width: int = 32, requires_grad_input: bool = False
) -> tuple[RandomProgram, tuple[torch.Tensor, ...]]:
    """A seeded random model and its inputs.

    Every tensor in the program is (batch, width) or a keepdim reduction of one, so any pair can be
    combined with broadcasting. The same seed gives the same model and inputs.

    Examples
    --------
    >>> model, inputs = random_model(0)
    >>> [tuple(x.shape) for x in inputs]
    [(16, 32), (16, 32)]
    >>> out = model(*inputs); len(out) >= 1
    True
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    shapes: list[tuple[int, int]] = [(batch, width), (batch, width)]
    weights: list[torch.Tensor] = []
    program: list[Instruction] = []
    alive = [0, 1]
    for _ in range(steps):
        full = [i for i in alive if shapes[i] == (batch, width)]
        a = rng.choice(full)
        choice = rng.random()
        if choice < 0.3:
            op, args, shape = rng.choice(_UNARY), (a,), (batch, width)
        elif choice < 0.5:
            b = rng.choice(alive)
            op, args, shape = rng.choice(_BINARY), (a, b), (batch, width)
        elif choice < 0.62:
            weights.append(torch.randn(width, width, generator=gen) / width**0.5)
            op, args, shape = "matmul", (a,), (batch, width)
        elif choice < 0.7:
            op, args, shape = rng.choice(("sum_keepdim", "amax_keepdim")), (a,), None
        elif choice < 0.78:
            op, args, shape = "transpose_twice", (a,), (batch, width)
        elif choice < 0.85:
            op, args, shape = "expand_add", (a, rng.choice(full)), (batch, width)
        elif choice < 0.92:
            op, args, shape = "clone_inplace", (a,), (batch, width)
        elif choice < 0.96:
            op, args, shape = "cat_chunk", (a, rng.choice(full)), (batch, width)
        else:
            op, args, shape = "softmax", (a,), (batch, width)
        dim = rng.randrange(2)
        if shape is None:
            shape = (1, width) if dim == 0 else (batch, 1)
        out_index = len(shapes)
        shapes.append(shape)
        # Drop some operands from the pool afterwards (never the inputs, never the last full tensor).
        frees = tuple(sorted({i for i in args if i > 1 and rng.random() < 0.6}))
        alive = [i for i in alive if i not in frees] + [out_index]
        program.append(Instruction(op, args, len(weights) - 1 if op == "matmul" else None, dim, frees))
    full_alive = [i for i in alive if shapes[i] == (batch, width)]
    outputs = [full_alive[-1]] if full_alive else [alive[-1]]
    model = RandomProgram(program, weights, outputs)
    inputs = tuple(
        torch.randn(batch, width, generator=gen).requires_grad_(requires_grad_input) for _ in range(2)
    )
    return model, inputs


# ----------------------------------------------------------------------------------------------
# equivalence


def _grad_leaves(model: nn.Module | Callable[..., Any], call: Any) -> list[torch.Tensor]:
    leaves = [t for t in pytree.tree_leaves(call) if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(model, nn.Module):
        leaves += [p for p in model.parameters() if p.requires_grad]
    return leaves


def _run_with_grads(
    model: Callable[..., Any], inputs: Sequence[Any], kwargs: Mapping[str, Any], grad: bool, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    call = pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.requires_grad), (tuple(inputs), dict(kwargs))
    )
    torch.manual_seed(seed)
    with torch.set_grad_enabled(grad):  # without gradients, the call an inference loop makes (no_grad)
        out = model(*call[0], **call[1])
    flat = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not grad:
        return [t.detach() for t in flat], []
    owner = model if isinstance(model, nn.Module) else None
    leaves = _grad_leaves(owner or model, call)
    diff = [t for t in flat if t.requires_grad]
    if not diff or not leaves:
        return [t.detach() for t in flat], []
    # A fixed, non-uniform upstream gradient so every element of every output matters.
    gen = torch.Generator().manual_seed(seed + 1)
    tangents = [torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) for t in diff]
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
    seed: int = 0,
    kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Assert that two models give the same outputs and the same gradients.

    Both run on fresh copies of ``inputs`` (and of the keyword arguments ``kwargs``) under the same RNG
    seed, and from the same buffer values (a forward that updates buffers, running statistics or a
    power iteration's vector, leaves them as one call would; the buffers are compared after the calls); with ``grad=False`` under ``torch.no_grad()``, as inference runs (an optimized module then runs
    its inference plan), and only the outputs are compared. Otherwise gradients are taken with respect
    to every tensor argument that requires grad and every parameter of each model (in ``parameters()``
    order, so an optimized module must expose the original's parameters, as memplan's do), with the same
    random upstream gradient. Raises ``AssertionError`` naming the first output or gradient that differs.

    Examples
    --------
    >>> lin = torch.nn.Linear(3, 2)
    >>> assert_equivalent(lin, lin, torch.randn(4, 3))
    """
    kwargs = dict(kwargs or {})
    own_a, own_b = _buffers(original), _buffers(optimized)
    before = [b.detach().clone() for _, b in own_b]
    out_a, grads_a = _run_with_grads(original, inputs, kwargs, grad, seed)
    after_a = [b.detach().clone() for _, b in own_a]
    with torch.no_grad():  # the second model starts from its buffers' values before the first call
        for (_, b), value in zip(own_b, before):  # (an optimized module holds the original's buffers)
            b.copy_(value)
    out_b, grads_b = _run_with_grads(optimized, inputs, kwargs, grad, seed)
    if len(own_a) == len(own_b):  # an optimized module lists the original's buffers, in their order
        for (name, _), a, (_, b) in zip(own_a, after_a, own_b):
            try:
                torch.testing.assert_close(b.detach(), a, rtol=rtol, atol=atol)
            except AssertionError as e:
                raise AssertionError(f"buffer {name} differs after the call:\n{e}") from None
    if len(out_a) != len(out_b):
        raise AssertionError(f"the models return {len(out_a)} and {len(out_b)} tensors")
    for i, (a, b) in enumerate(zip(out_a, out_b)):
        try:
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol)
        except AssertionError as e:
            raise AssertionError(f"output {i} differs:\n{e}") from None
    if len(grads_a) != len(grads_b):
        raise AssertionError(f"the models have {len(grads_a)} and {len(grads_b)} gradient leaves")
    names = _leaf_names(original, (tuple(inputs), kwargs))
    for i, (a, b) in enumerate(zip(grads_a, grads_b)):
        name = names[i] if i < len(names) else f"leaf {i}"
        if a is None or b is None:
            if (a is None) != (b is None):
                raise AssertionError(f"gradient of {name}: one model gives None, the other a tensor")
            continue
        try:
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol)
        except AssertionError as e:
            raise AssertionError(f"gradient of {name} differs:\n{e}") from None


def is_well_conditioned(model: nn.Module, *inputs: torch.Tensor, rtol: float = 1e-2, atol: float = 1e-3) -> bool:
    """Whether float32 rounding moves the model's outputs and gradients less than ``rtol``/``atol``
    away from a float64 run of the same model.

    Two equivalent programs (a matmul split into row blocks, a sum in another order) round
    differently. A well-conditioned model keeps that difference near the dtype's epsilon, so
    :func:`assert_equivalent` can hold them to a tight tolerance. An ill-conditioned one (the sine of
    a large exponential, say) amplifies it past any fixed tolerance, even in float64. A random test
    should skip such models rather than loosen its tolerance for all of them. So should it skip a model
    whose float64 outputs or gradients are not finite (an overflowed exponential, its NaN gradient).
    The model is deep-copied; both runs take the same upstream gradient and the same RNG seed, and
    the caller's RNG state is left as it was.

    Examples
    --------
    >>> is_well_conditioned(torch.nn.Linear(3, 2), torch.randn(4, 3))
    True
    """
    runs = []
    for dtype in (torch.float32, torch.float64):
        copied = copy.deepcopy(model).to(dtype)
        xs = [
            x.detach().to(dtype).requires_grad_(x.requires_grad) if x.is_floating_point() else x for x in inputs
        ]
        with torch.random.fork_rng():  # the caller's RNG state is left as it was
            torch.manual_seed(0)
            out = [t for t in pytree.tree_leaves(copied(*xs)) if isinstance(t, torch.Tensor)]
        diff = [t for t in out if t.requires_grad]
        gen = torch.Generator().manual_seed(1)
        tangents = [torch.randn(t.shape, generator=gen).to(t.device, dtype) for t in diff]
        leaves = [x for x in xs if x.requires_grad] + [p for p in copied.parameters() if p.requires_grad]
        grads = torch.autograd.grad(diff, leaves, tangents, allow_unused=True) if diff and leaves else ()
        runs.append([t.detach() for t in out] + [g for g in grads if g is not None])
    return all(
        bool(torch.isfinite(b).all() and torch.isclose(a.double(), b, rtol=rtol, atol=atol).all())
        if b.is_floating_point() else torch.equal(a, b)  # indices, counts
        for a, b in zip(*runs, strict=True)
    )


def _leaf_names(model: Any, call: tuple[tuple, dict]) -> list[str]:
    names = [path for path, t in zip(leaf_paths(call), pytree.tree_leaves(call))
             if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(model, nn.Module):
        names += [n for n, p in model.named_parameters() if p.requires_grad]
    return names


# ----------------------------------------------------------------------------------------------
# zoo


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]


class _UnrolledRNN(nn.Module):
    def __init__(self, nx: int, nh: int):
        super().__init__()
        self.cell = nn.RNNCell(nx, nh)
        self.head = nn.Linear(nh, nx)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(seq.shape[1], self.cell.hidden_size, dtype=seq.dtype, device=seq.device)
        outs = []
        for t in range(seq.shape[0]):
            h = self.cell(seq[t], h)
            outs.append(self.head(h))
        return torch.stack(outs)


class _AttentionBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        attn = scores.softmax(dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(x)


def zoo(seed: int = 0) -> Iterator[ZooModel]:
    """Small models of the common shapes: MLP, conv net, unrolled RNN, attention block.

    Examples
    --------
    >>> [z.name for z in zoo()]
    ['mlp', 'convnet', 'rnn', 'attention']
    """
    torch.manual_seed(seed)
    yield ZooModel(
        "mlp",
        nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 10)),
        (torch.randn(32, 64),),
    )
    yield ZooModel(
        "convnet",
        nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 10),
        ),
        (torch.randn(4, 3, 16, 16),),
    )
    yield ZooModel("rnn", _UnrolledRNN(16, 32), (torch.randn(12, 8, 16),))
    yield ZooModel("attention", _AttentionBlock(32, 4), (torch.randn(2, 16, 32),))
