"""Public testing helpers: the same oracles memplan's own tests use.

- :func:`random_model`: a seeded generator of small random programs (pointwise ops, matmuls,
  reductions, views, broadcasts, in-place updates, concatenations) as ordinary ``nn.Module``s.
- :func:`assert_equivalent`: outputs *and* gradients of two models agree.
- :func:`is_well_conditioned`: whether a model's rounding error stays small enough for such a comparison.
- :func:`zoo`: small models of the common shapes (MLP, conv net, unrolled RNN, attention block).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from memplan.equivalence import assert_equivalent, is_well_conditioned

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


# The structural fuzzer's generator and oracle (memplan.fuzz), public here beside the other oracles.
from memplan.fuzz import (  # noqa: E402
    CHECKS,
    FAMILIES,
    Finding,
    ProgramModule,
    StructuralProgram,
    check_program,
    minimise,
    same_failure,
    structural_program,
)

__all__ += ["CHECKS", "FAMILIES", "Finding", "ProgramModule", "StructuralProgram", "check_program", "minimise",
            "same_failure", "structural_program"]
