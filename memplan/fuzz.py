"""Structural fuzzing: random programs of the shapes real models have, an oracle, and a minimiser.

:mod:`memplan.testing`'s ``random_model`` draws small pointwise programs. The passes, though, look for
structures: a huge broadcast intermediate reduced at once (pairwise distances, log-space matmuls,
``einsum(...).max()``), a matmul followed by a max, a broadcast batched matmul, an unrolled loop with a
carried state, views and in-place writes into fresh tensors. This module draws programs made of those
structures, checks memplan on them against the untouched program, and shrinks a failing program to a
short standalone script.

Stages of one fuzz case
-----------------------
(1) :func:`structural_program` draws a :class:`StructuralProgram` from a seed: leaves (inputs and
    parameters, each built from its own seed) and one to three *families* of statements (see
    :data:`FAMILIES`), each reading the leaves or an earlier family's results. Every statement is kept
    as the Python text it runs (with its operands as ``{a0}, {a1}, ...`` and its results as
    ``{o0}, ...``), so the program is data that the minimiser edits, and its ``to_source()`` prints the
    same text as a runnable script. :class:`ProgramModule` interprets a program by running exactly
    those statements, so the module and its printed source cannot disagree.
(2) :func:`check_program` runs memplan on the program and compares it with the untouched module: outputs,
    gradients and buffers; the random draws of two consecutive calls; inference under ``no_grad``; the
    measured training peak against eager's; the plan's predicted peak against the measured one; and a
    budget at half of eager's peak, honoured or refused. Each disagreement is a :class:`Finding`.
(3) :func:`minimise` drops statements (and whatever reads them) by delta debugging while the finding
    persists, so that a report reads as a few lines.

Sizes
-----
A program's tensors are small enough that running it takes milliseconds (a full check takes a second
or two on one CPU thread, most of it planning), but the families that reduce a huge intermediate are
sized (``n, m`` in 48-96, ``d`` in 32-128) so that the intermediate dominates the step's memory, as in
the models that need memplan: chunking and rewriting then have something to remove. ``size="small"``
divides every extent by about four, for quick tests.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import random
import re
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from memplan.equivalence import assert_equivalent, is_well_conditioned, settles_near_ties
from memplan.errors import CaptureError, InfeasibleBudgetError
from memplan.pipeline import pass_failures

__all__ = [
    "FAMILIES",
    "CHECKS",
    "Leaf",
    "Statement",
    "StructuralProgram",
    "ProgramModule",
    "structural_program",
    "Finding",
    "check_program",
    "minimise",
    "same_failure",
]

# Placeholders of a statement's text: its operands and its results (see Statement.render).
A0, A1, A2, A3 = "{a0}", "{a1}", "{a2}", "{a3}"
O0, O1 = "{o0}", "{o1}"
_PLACEHOLDER = re.compile(r"\{([ao])(\d+)\}")


# ----------------------------------------------------------------------------------------------
# programs as data


@dataclasses.dataclass(frozen=True)
class Leaf:
    """An input or parameter of a program: ``name`` and the expression that builds its value.

    ``code`` reads a ``torch.Generator`` named ``g`` (seeded in the expression itself), so each leaf's
    values depend on its own seed only and survive the removal of other leaves.
    """

    name: str
    code: str
    shape: tuple[int, ...]
    dtype: str
    parameter: bool = False

    def value(self) -> torch.Tensor:
        """The leaf's tensor (a plain tensor; :class:`ProgramModule` wraps parameters)."""
        return eval(_compiled(self.code, "eval"), {"torch": torch, "g": torch.Generator()})


@dataclasses.dataclass(frozen=True)
class Statement:
    """One step of a program: Python text that reads ``args`` and defines ``outs``.

    ``code`` names its operands ``{a0}, {a1}, ...`` and its results ``{o0}, {o1}, ...``; temporaries
    of a statement (a loop's state) are named after its first result. ``frees`` are deleted after the
    statement (``del``), as user code drops a large value it no longer needs. ``shapes`` and ``dtypes``
    describe ``outs``; ``family`` and ``op`` say what the statement is an instance of.
    """

    family: str
    op: str
    code: str
    args: tuple[str, ...]
    outs: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    frees: tuple[str, ...] = ()

    def render(self) -> str:
        """The statement's text with its operands' and results' names filled in.

        Examples
        --------
        >>> Statement("demo", "add", "{o0} = {a0} + {a1}", ("x0", "x1"), ("v2",)).render()
        'v2 = x0 + x1'
        """

        def name(match: re.Match) -> str:
            names = self.args if match[1] == "a" else self.outs
            return names[int(match[2])]

        text = _PLACEHOLDER.sub(name, self.code)
        if self.frees:
            text += "\ndel " + ", ".join(self.frees)
        return text


@functools.lru_cache(maxsize=4096)
def _compiled(text: str, mode: str) -> Any:
    return compile(text, "<memplan.fuzz program>", mode)


def _tuple(names: Iterable[str]) -> str:
    """Python text of a tuple of ``names``: ``(a,)`` or ``a, b``."""
    names = list(names)
    return f"({names[0]},)" if len(names) == 1 else ", ".join(names) if names else "()"


def _namespace() -> dict[str, Any]:
    """The names a program's statements may read besides its values."""
    return {"torch": torch, "F": F, "math": math}


@dataclasses.dataclass(frozen=True)
class StructuralProgram:
    """A program as data: leaves, statements and the names it returns.

    ``seed`` is the seed :func:`structural_program` drew it from (None for an edited program that
    forgot it). :meth:`build` gives the module and inputs; :meth:`to_source` a standalone script that
    builds the same.
    """

    leaves: tuple[Leaf, ...]
    statements: tuple[Statement, ...]
    outputs: tuple[str, ...]
    seed: int | None = None

    @property
    def inputs(self) -> tuple[Leaf, ...]:
        return tuple(leaf for leaf in self.leaves if not leaf.parameter)

    @property
    def parameters(self) -> tuple[Leaf, ...]:
        return tuple(leaf for leaf in self.leaves if leaf.parameter)

    @property
    def families(self) -> tuple[str, ...]:
        """The families of the program's statements, each once, in order."""
        return tuple(dict.fromkeys(s.family for s in self.statements))

    def build(self) -> tuple[ProgramModule, tuple[torch.Tensor, ...]]:
        """The module interpreting this program, and fresh copies of its inputs."""
        return ProgramModule(self), tuple(leaf.value() for leaf in self.inputs)

    # -- edits (for the minimiser) -------------------------------------------------------------

    def without(self, indices: Iterable[int]) -> StructuralProgram | None:
        """The program without the statements at ``indices`` and every statement that reads what they
        define; outputs so lost are dropped, and so are leaves nothing reads. None if no output is left.

        Examples
        --------
        >>> model, _ = structural_program(0)
        >>> program = model.program
        >>> program.without(range(len(program.statements))) is None
        True
        """
        dropped = set(indices)
        gone: set[str] = set()
        kept = []
        for i, statement in enumerate(self.statements):
            if i in dropped or gone.intersection(statement.args):
                gone.update(statement.outs)
                continue
            kept.append(statement)
        outputs = tuple(o for o in self.outputs if o not in gone)
        if not outputs:
            return None
        return dataclasses.replace(self, statements=tuple(kept), outputs=outputs)._tidied()

    def bypassed(self, index: int, arg: str) -> StructuralProgram:
        """The program without statement ``index``, its one result read as ``arg`` instead (an operand
        of the same shape and dtype)."""
        statement = self.statements[index]
        (out,) = statement.outs
        statements = list(self.statements[:index])
        for later in self.statements[index + 1:]:
            statements.append(dataclasses.replace(later, args=tuple(arg if a == out else a for a in later.args)))
        outputs = tuple(dict.fromkeys(arg if o == out else o for o in self.outputs))
        return dataclasses.replace(self, statements=tuple(statements), outputs=outputs)._tidied()

    def with_outputs(self, outputs: Sequence[str]) -> StructuralProgram:
        return dataclasses.replace(self, outputs=tuple(outputs))._tidied()

    def _tidied(self) -> StructuralProgram:
        """Frees of names that are gone or read later dropped; leaves nothing reads dropped."""
        defined = {leaf.name for leaf in self.leaves}
        statements = []
        for i, statement in enumerate(self.statements):
            defined.update(statement.outs)
            later_reads = {a for s in self.statements[i + 1:] for a in s.args} | set(self.outputs)
            frees = tuple(f for f in statement.frees if f in defined and f not in later_reads)
            statements.append(dataclasses.replace(statement, frees=frees))
        read = {a for s in statements for a in s.args} | set(self.outputs)
        leaves = tuple(leaf for leaf in self.leaves if leaf.name in read)
        return dataclasses.replace(self, leaves=leaves, statements=tuple(statements))

    # -- printing ---------------------------------------------------------------------------------

    def forward_lines(self) -> list[str]:
        """The body of the program's forward, one line per entry (unindented)."""
        lines = [f"{p.name} = self.{p.name}" for p in self.parameters]
        for statement in self.statements:
            lines.extend(statement.render().splitlines())
        lines.append(f"return {_tuple(self.outputs)}")
        return lines

    def to_source(self, header: str = "", passes: str | None = None) -> str:
        """A standalone script that builds this program's module and inputs (``model, inputs``) and,
        run as a script, prints :func:`check_program`'s findings for ``passes``.

        Examples
        --------
        >>> model, inputs = structural_program(0)
        >>> namespace = {}
        >>> exec(model.program.to_source(), namespace)
        >>> [tuple(x.shape) for x in namespace["inputs"]] == [tuple(x.shape) for x in inputs]
        True
        """
        title = "memplan structural fuzz program" + (f", seed {self.seed}" if self.seed is not None else "")
        doc = [f'"""{title}.']
        if header:
            doc += [""] + header.rstrip().splitlines()
        doc.append('"""')
        out = doc + [
            "import math",
            "",
            "import torch",
            "import torch.nn.functional as F",
            "from torch import nn",
            "",
            "",
            "class Program(nn.Module):",
            "    def __init__(self):",
            "        super().__init__()",
            "        g = torch.Generator()",
        ]
        for p in self.parameters:
            out.append(f"        self.{p.name} = nn.Parameter({p.code})")
        args = "".join(f", {leaf.name}" for leaf in self.inputs)
        out += ["", f"    def forward(self{args}):"]
        out += [f"        {line}" for line in self.forward_lines()]
        out += ["", "", "def make_inputs():", "    g = torch.Generator()"]
        for leaf in self.inputs:
            out.append(f"    {leaf.name} = {leaf.code}")
        out.append(f"    return {_tuple(leaf.name for leaf in self.inputs)}")
        out += [
            "",
            "",
            "model, inputs = Program(), make_inputs()",
            "",
            'if __name__ == "__main__":',
            "    from memplan.fuzz import check_program",
            "",
            f"    for finding in check_program(model, inputs, passes={passes!r}):",
            "        print(finding)",
            "",
        ]
        return "\n".join(out)


class ProgramModule(nn.Module):
    """The module of a :class:`StructuralProgram`: it runs the program's statements, in order, in one
    namespace holding the inputs (by name), the parameters and the statements' results, as the
    ``forward`` of :meth:`StructuralProgram.to_source` does.

    Examples
    --------
    >>> model, inputs = structural_program(1)
    >>> outputs = model(*inputs)
    >>> isinstance(outputs, tuple) and len(outputs) == len(model.program.outputs)
    True
    """

    def __init__(self, program: StructuralProgram):
        super().__init__()
        self.program = program
        for p in program.parameters:
            self.register_parameter(p.name, nn.Parameter(p.value()))

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = _namespace()
        for p in self.program.parameters:
            values[p.name] = getattr(self, p.name)
        for leaf, x in zip(self.program.inputs, inputs, strict=True):
            values[leaf.name] = x
        for statement in self.program.statements:
            exec(_compiled(statement.render(), "exec"), values)
        return tuple(values[name] for name in self.program.outputs)


# ----------------------------------------------------------------------------------------------
# the generator


@dataclasses.dataclass(frozen=True)
class _Extents:
    """A program's extents: two point counts, two widths, a batch and a head count. Families draw
    from these few values, so the result of one often has the shape another reads."""

    n: tuple[int, int]
    d: tuple[int, int]
    batch: int
    heads: int
    # the most elements a family's broadcast intermediate may have (it must dominate, yet stay fast)
    cap: int

    @classmethod
    def draw(cls, rng: random.Random, size: str) -> _Extents:
        if size == "default":
            n = (rng.randint(48, 72), rng.randint(64, 96))
            d = (rng.choice((32, 48, 64)), rng.choice((64, 96, 128)))
            return cls(n, d, rng.randint(2, 3), rng.randint(2, 3), 1_300_000)
        if size == "small":
            n = (rng.randint(10, 16), rng.randint(14, 24))
            d = (rng.choice((8, 12, 16)), rng.choice((16, 24, 32)))
            return cls(n, d, 2, 2, 20_000)
        raise ValueError(f'size must be "default" or "small", not {size!r}')


class _Builder:
    """Draws leaves and statements, learning each result's shape and dtype by running the statement
    once (the tensors are small; running them costs less than tracing them on fake tensors would).
    The caller's global random generator is left as it was."""

    def __init__(self, seed: int, size: str):
        self.seed = seed
        self.rng = random.Random(seed)
        self.ext = _Extents.draw(self.rng, size)
        self.leaves: list[Leaf] = []
        self.statements: list[Statement] = []
        self.meta: dict[str, torch.Tensor] = {}  # the value of every leaf and result
        self.alive: list[str] = []  # values later statements may read
        self.results: list[str] = []  # candidates for outputs
        self.forced: list[str] = []  # outputs a family asked for
        self.family = ""  # the family drawing statements now
        self._values = _namespace()
        self._count = itertools.count()

    # -- extents ----------------------------------------------------------------------------------

    def n(self) -> int:
        return self.rng.choice(self.ext.n)

    def d(self) -> int:
        return self.rng.choice(self.ext.d)

    def lead(self, most: int = 2) -> tuple[int, ...]:
        """Leading batch dimensions: none, (batch,) or (batch, heads)."""
        leads = [(), (self.ext.batch,), (self.ext.batch, self.ext.heads)][: most + 1]
        return self.rng.choice(leads)

    def fit(self, lead: tuple[int, ...], *extents: int) -> tuple[int, ...]:
        """``lead`` without its first dimensions until ``prod(lead + extents)`` fits the cap."""
        while lead and math.prod(lead) * math.prod(extents) > self.ext.cap:
            lead = lead[1:]
        return lead

    # -- leaves -----------------------------------------------------------------------------------

    def _leaf(self, prefix: str, code: str, parameter: bool) -> str:
        name = f"{prefix}{next(self._count)}"
        value = eval(code, {"torch": torch, "g": torch.Generator()})
        if parameter:
            value.requires_grad_()
        self.leaves.append(Leaf(name, code, tuple(value.shape), str(value.dtype), parameter))
        self.meta[name] = value
        self.alive.append(name)
        return name

    def _seed(self) -> int:
        return self.rng.randrange(2**31)

    def input(self, shape: Sequence[int], *, scale: float = 1.0, grad: bool = True) -> str:
        code = f"torch.randn({_dims(shape)}, generator=g.manual_seed({self._seed()}))"
        if scale != 1.0:
            code += f".mul({scale:.4g})"
        if grad:
            code += ".requires_grad_()"
        return self._leaf("x", code, parameter=False)

    def param(self, shape: Sequence[int], *, scale: float | None = None) -> str:
        """A new parameter; by default a weight scaled by ``1/sqrt(fan_in)`` (its next-to-last extent)."""
        if scale is None:
            scale = shape[-2] ** -0.5 if len(shape) >= 2 else 1.0
        code = f"torch.randn({_dims(shape)}, generator=g.manual_seed({self._seed()}))"
        if scale != 1.0:
            code += f".mul({scale:.4g})"
        return self._leaf("w", code, parameter=True)

    def index(self, shape: Sequence[int], high: int) -> str:
        code = f"torch.randint(0, {high}, ({_dims(shape)},), generator=g.manual_seed({self._seed()}))"
        return self._leaf("i", code, parameter=False)

    def tensor(self, shape: Sequence[int], *, scale: float | None = None, reuse: float = 0.5) -> str:
        """A float value of ``shape`` that requires grad: an earlier value of that shape (with
        probability ``reuse`` when there is one), a projection of an earlier result that differs in its
        last dimension only (as often), else a new input or parameter."""
        shape = tuple(shape)
        usable = [v for v in self.alive if self._is_float(v) and self.meta[v].requires_grad]
        same = [v for v in usable if tuple(self.meta[v].shape) == shape]
        if same and self.rng.random() < reuse:
            return self.rng.choice(same)
        near = [v for v in usable if v in self.results and tuple(self.meta[v].shape[:-1]) == shape[:-1]]
        if near and self.rng.random() < reuse:
            source = self.rng.choice(near)
            w = self.param((self.meta[source].shape[-1], shape[-1]))
            return self.emit("project", f"{O0} = {A0} @ {A1}", source, w, result=False)
        if scale is None:
            scale = self.rng.choice((1.0, shape[-1] ** -0.5))
        if self.rng.random() < 0.25:
            return self.param(shape, scale=scale)
        return self.input(shape, scale=scale)

    def some_result(self, min_rank: int = 2) -> str | None:
        """An earlier float result of at least ``min_rank`` dimensions, if any."""
        found = [v for v in self.results if v in self.alive and self._is_float(v) and self.meta[v].dim() >= min_rank]
        return self.rng.choice(found) if found else None

    def _is_float(self, name: str) -> bool:
        return self.meta[name].dtype == torch.float32

    # -- statements -------------------------------------------------------------------------------

    def emit(self, op: str, code: str, *args: str, outs: int = 1, result: bool = True) -> Any:
        """Append a statement of the current family; return its result's name (a tuple of names when
        it has several)."""
        names = tuple(f"v{next(self._count)}" for _ in range(outs))
        statement = Statement(self.family, op, code, tuple(args), names)
        scope = self._values | {a: self.meta[a] for a in args}
        with torch.random.fork_rng(devices=()):  # a random op draws from a generator the caller gets back
            exec(statement.render(), scope)
        shapes, dtypes = [], []
        for name in names:
            self.meta[name] = scope[name]
            shapes.append(tuple(scope[name].shape))
            dtypes.append(str(scope[name].dtype))
        self.statements.append(dataclasses.replace(statement, shapes=tuple(shapes), dtypes=tuple(dtypes)))
        self.alive.extend(names)
        if result:
            self.results.extend(names)
        return names[0] if outs == 1 else names

    def free(self, name: str) -> None:
        """Delete ``name`` after the last statement (``del``): no later statement may read it."""
        last = self.statements[-1]
        self.statements[-1] = dataclasses.replace(last, frees=last.frees + (name,))
        self.alive.remove(name)
        if name in self.results:
            self.results.remove(name)

    def force_output(self, *names: str) -> None:
        self.forced.extend(names)

    def choose(self, *options: Any) -> Any:
        return self.rng.choice(options)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    # -- the program ------------------------------------------------------------------------------

    def outputs(self) -> tuple[str, ...]:
        """The forced outputs, the last result that requires grad, and each other result no later
        statement reads with probability 3/4 (the rest stay dead code, as in user programs)."""
        read = {a for s in self.statements for a in s.args}
        chosen = [n for n in self.forced if n in self.alive]
        grads = [n for n in self.results if n in self.alive and self.meta[n].requires_grad]
        if not grads:
            raise AssertionError(f"seed {self.seed}: no result requires grad (a generator bug)")
        if not any(self.meta[n].requires_grad for n in chosen):
            chosen.append(grads[-1])
        terminal = [n for n in self.results if n in self.alive and n not in read and n not in chosen]
        for name in terminal:
            if self.chance(0.75):
                chosen.append(name)
        return tuple(dict.fromkeys(chosen))

    def program(self) -> StructuralProgram:
        return StructuralProgram(tuple(self.leaves), tuple(self.statements), self.outputs(), self.seed)


def _dims(shape: Sequence[int]) -> str:
    return ", ".join(str(s) for s in shape)


# ----------------------------------------------------------------------------------------------
# families


def _pair_operands(b: _Builder, x_lead: tuple[int, ...], y_lead: tuple[int, ...]) -> tuple[str, str]:
    """How to write ``x`` (..., n, d) against ``y`` (..., m, d) as (..., n, m, d) broadcasts."""
    if not x_lead and not y_lead:
        return b.choose((f"{A0}[:, None]", f"{A1}[None]"), (f"{A0}.unsqueeze(1)", f"{A1}.unsqueeze(0)"),
                        (f"{A0}[:, None, :]", f"{A1}[None, :, :]"))
    return b.choose((f"{A0}.unsqueeze(-2)", f"{A1}.unsqueeze(-3)"), (f"{A0}[..., :, None, :]", f"{A1}[..., None, :, :]"))


def _pairwise_matrix(b: _Builder, *, distance_only: bool = False) -> tuple[str, str, tuple[int, ...]]:
    """Emit a pairwise distance or similarity matrix (..., n, m) of two point sets; return it, how it
    is best reduced ("min" for distances, "max" for similarities) and its leading dimensions."""
    n, m, d = b.n(), b.n(), b.d()
    lead = b.fit(b.lead(), n, m, d)
    y_lead = lead[b.rng.randint(0, len(lead)):]  # broadcasting between ranks
    x = b.tensor(lead + (n, d))
    y = b.tensor(y_lead + (m, d))
    xs, ys = _pair_operands(b, lead, y_lead)
    kind = "sqdiff" if distance_only else b.choose("sqdiff", "sqdiff", "absdiff", "dot", "cosine")
    if kind == "sqdiff":
        square = b.choose(f"({xs} - {ys}) ** 2", f"({xs} - {ys}).pow(2)", f"({xs} - {ys}).square()")
        if b.chance(0.3):  # the intermediate as a value of its own, dropped after the reduction
            diff = b.emit("broadcast_sub", f"{O0} = {square}", x, y, result=False)
            matrix = b.emit("sum", f"{O0} = {A0}.sum(-1)", diff, result=False)
            if b.chance(0.5):
                b.free(diff)
        else:
            matrix = b.emit("sqdist", f"{O0} = ({square}).sum(-1)", x, y, result=False)
        tail = b.choose("", ".add(1e-6).sqrt()", ".clamp_min(1e-6).sqrt()", f".div({d})", f".mul({1 / d:.4g}).add(1.0)")
        if tail:
            matrix = b.emit("affine", f"{O0} = {A0}{tail}", matrix, result=False)
        return matrix, "min", lead
    if kind == "absdiff":
        return b.emit("l1dist", f"{O0} = ({xs} - {ys}).abs().sum(-1)", x, y, result=False), "min", lead
    if kind == "dot":
        return b.emit("broadcast_dot", f"{O0} = ({xs} * {ys}).sum(-1)", x, y, result=False), "max", lead
    return b.emit("cosine", f"{O0} = F.cosine_similarity({xs}, {ys}, dim=-1)", x, y, result=False), "max", lead


def _pairwise(b: _Builder) -> None:
    """Pairwise distances or similarities reduced over one side: nearest neighbours, soft minima."""
    matrix, best, lead = _pairwise_matrix(b)
    sign = "" if best == "max" else ".neg()"
    dim = b.choose(-1, -2)
    reduction = b.choose("best", "best_indices", "amax", "logsumexp", "softmax", "softmax_matmul", "kernel")
    if reduction == "best":
        b.emit(best, f"{O0} = {A0}.{best}({dim}).values", matrix)
    elif reduction == "best_indices":
        values, indices = b.emit(f"{best}_indices", f"{O0}, {O1} = {A0}.{best}(dim={dim})", matrix, outs=2)
        if b.chance(0.5):
            b.force_output(values, indices)
    elif reduction == "amax":
        b.emit(f"a{best}", f"{O0} = {A0}.a{best}({dim})", matrix)
    elif reduction == "logsumexp":
        b.emit("logsumexp", f"{O0} = {A0}{sign}.logsumexp({dim})", matrix)
    elif reduction == "softmax":
        b.emit("softmax", f"{O0} = ({A0}{sign}.softmax({dim}) * {A0}).sum({dim})", matrix)
    elif reduction == "softmax_matmul":  # a soft nearest neighbour: weights over the other set's values
        m = b.meta[matrix].shape[-1]
        values = b.tensor(lead + (m, b.d()))
        b.emit("softmax_matmul", f"{O0} = torch.softmax({A0}{sign}, dim=-1) @ {A1}", matrix, values)
    elif best == "min":
        b.emit("kernel", f"{O0} = torch.exp(-{A0}).sum({dim})", matrix)
    else:
        b.emit("kernel", f"{O0} = torch.exp({A0}).mean({dim})", matrix)


def _chamfer(b: _Builder) -> None:
    """A chamfer distance: the distance matrix reduced both ways, the two means added."""
    matrix, _, _ = _pairwise_matrix(b, distance_only=True)
    form = b.choose("values", "indexed", "amin")
    if form == "values":
        b.emit("chamfer", f"{O0} = {A0}.min(-1).values.mean(-1) + {A0}.min(-2).values.mean(-1)", matrix)
    elif form == "indexed":
        b.emit("chamfer", f"{O0} = {A0}.min(dim=-1)[0].sum(-1) + {A0}.min(dim=-2)[0].sum(-1)", matrix)
    else:
        b.emit("chamfer", f"{O0} = torch.amin({A0}, -1).mean(-1) + torch.amin({A0}, -2).mean(-1)", matrix)


def _attention(b: _Builder) -> None:
    """Scaled dot-product attention written out: ``softmax(q @ k^T / sqrt(d)) @ v``."""
    n, m, dk = 2 * b.n(), 2 * b.n(), max(4, min(b.ext.d) // 2)  # long sequences, narrow heads
    if b.chance(0.4):  # heads from one projection, reshaped and transposed
        batch, heads = b.ext.batch, b.ext.heads
        width = heads * dk
        x = b.tensor((batch, n, width))
        w = b.param((width, 3 * width))
        q, k, v = b.emit("qkv", f"{O0}, {O1}, {{o2}} = ({A0} @ {A1}).chunk(3, dim=-1)", x, w, outs=3, result=False)
        heads_of = f".view({batch}, {n}, {heads}, {dk}).transpose(1, 2)"
        q, k, v = (b.emit("split_heads", f"{O0} = {A0}{heads_of}", t, result=False) for t in (q, k, v))
        lead, m = (batch, heads), n
    else:
        lead = b.fit(b.lead(), n, m, 4)
        q, k, v = b.tensor(lead + (n, dk)), b.tensor(lead + (m, dk)), b.tensor(lead + (m, b.d()))
    scale = b.choose(f" * {dk ** -0.5:.6g}", f" / math.sqrt({dk})")
    product = b.choose(f"{A0} @ {A1}.transpose(-1, -2)", f"torch.matmul({A0}, {A1}.mT)",
                       f"torch.einsum('...nd,...md->...nm', {A0}, {A1})")
    scores = b.emit("scores", f"{O0} = {product}{scale}", q, k, result=False)
    if b.chance(0.3):
        bias = b.param((n, m), scale=1.0)
        scores = b.emit("bias", f"{O0} = {A0} + {A1}", scores, bias, result=False)
    elif n == m and b.chance(0.3):
        mask = f"torch.ones({n}, {m}, dtype=torch.bool).triu(1)"
        scores = b.emit("causal", f"{O0} = {A0}.masked_fill({mask}, float('-inf'))", scores, result=False)
    weights = b.choose(f"{A0}.softmax(-1)", f"torch.softmax({A0}, dim=-1)", f"F.softmax({A0}, dim=-1)")
    if b.chance(0.5):
        out = b.emit("attend", f"{O0} = {weights} @ {A1}", scores, v)
    else:
        probs = b.emit("softmax", f"{O0} = {weights}", scores, result=False)
        out = b.emit("attend", f"{O0} = {A0} @ {A1}", probs, v)
    if len(lead) == 2 and lead == (b.ext.batch, b.ext.heads) and b.chance(0.5):
        shape = b.meta[out].shape
        b.emit("merge_heads", f"{O0} = {A0}.transpose(1, 2).reshape({shape[0]}, {shape[2]}, -1)", out)


def _matmul_max(b: _Builder) -> None:
    """A matmul whose product is reduced by a max or min at once."""
    n, k, m = b.n(), max(4, min(b.ext.d) // 2), 6 * b.n()  # a wide product: it, not the operands, dominates
    lead = b.fit(b.lead(1), n, m, 2)
    a = b.tensor(lead + (n, k))
    form = b.choose("param", "transposed", "batched")
    if form == "param" or (form == "batched" and not lead):
        w = b.param((k, m))
        mm = "torch.matmul" if lead else "torch.mm"
        product = b.choose(f"{A0} @ {A1}", f"{mm}({A0}, {A1})")
    elif form == "transposed":
        w = b.tensor((m, k))
        product = b.choose(f"{A0} @ {A1}.t()", f"{A0} @ {A1}.T", f"torch.matmul({A0}, {A1}.transpose(0, 1))")
    else:
        w = b.tensor(lead + (k, m))
        product = f"torch.bmm({A0}, {A1})" if len(lead) == 1 else f"{A0} @ {A1}"
    dim = b.choose(-1, -2)
    reduction = b.choose("max", "max_indices", "min", "amax")
    if reduction == "max":
        b.emit("max", f"{O0} = ({product}).max({dim}).values", a, w)
    elif reduction == "max_indices":
        values, indices = b.emit("max_indices", f"{O0}, {O1} = torch.max({product}, dim={dim})", a, w, outs=2)
        if b.chance(0.5):
            b.force_output(values, indices)
    elif reduction == "min":
        b.emit("min", f"{O0} = ({product}).min(dim={dim})[0]", a, w)
    else:
        b.emit("amax", f"{O0} = ({product}).amax({dim})", a, w)


def _broadcast_matmul(b: _Builder) -> None:
    """A matmul that broadcasts a small weight over a batch: per-head maps, ``x[:, None] @ w``."""
    if b.chance(0.5):  # per-head linear maps on a flat activation
        heads = b.choose(4, 8)
        dim = b.choose(16, 32) if b.ext.cap > 100_000 else 4
        batch = min(256, max(8, b.ext.cap // (heads * dim * dim)))  # the broadcast copy of w near the cap
        x = b.tensor((batch, heads * dim))
        w = b.param((heads, dim, dim))
        view = b.choose(f"{A0}.view({batch}, {heads}, 1, {dim})", f"{A0}.reshape({batch}, {heads}, 1, {dim})")
        b.emit("head_matmul", f"{O0} = ({view} @ {A1}).reshape({batch}, {heads * dim})", x, w)
    else:
        heads, n, d, e = b.ext.heads, b.n(), b.d(), b.choose(*b.ext.d)
        batch = max(2, min(16, b.ext.cap // (heads * d * e)))
        x = b.tensor((batch, n, d))
        w = b.param((heads, d, e))
        out = b.emit("broadcast_matmul", f"{O0} = {A0}[:, None] @ {A1}", x, w, result=False)
        b.emit("reduce", b.choose(f"{O0} = {A0}.tanh().sum(1)", f"{O0} = {A0}.mean(-1)", f"{O0} = {A0}.relu()"), out)


def _logspace_matmul(b: _Builder) -> None:
    """A matmul in log space (or max-plus): a broadcast sum reduced by logsumexp or max."""
    n, k, m = b.n(), b.choose(*b.ext.d), b.n()
    lead = b.fit(b.lead(1), n, k, m)
    a = b.tensor(lead + (n, k), scale=1.0)
    w = b.tensor((k, m), scale=1.0) if b.chance(0.6) else b.tensor(lead + (k, m), scale=1.0)
    total = b.choose(f"({A0}.unsqueeze(-1) + {A1}.unsqueeze(-3))", f"({A0}[..., :, :, None] + {A1}[..., None, :, :])")
    if not lead and b.chance(0.5):
        total = f"({A0}[:, :, None] + {A1}[None])"
    reduction = b.choose("logsumexp", "logsumexp", "amax", "max")
    if reduction == "logsumexp":
        b.emit("logsumexp", f"{O0} = {total}.logsumexp(-2)", a, w)
    elif reduction == "amax":
        b.emit("amax", f"{O0} = {total}.amax(dim=-2)", a, w)
    else:
        b.emit("max", f"{O0} = {total}.max(-2).values", a, w)


def _einsum_reduce(b: _Builder) -> None:
    """An einsum or bmm that makes a large intermediate and reduces it at once (a short contraction,
    long free dimensions: the product is many times its operands)."""
    k = max(4, min(b.ext.d) // 2)
    form = b.choose("maxsim", "bmm_logsumexp", "einsum_softmax", "einsum_amax")
    if form == "maxsim":
        seqs, tokens = b.choose(3, 4), b.n()
        a, c = b.tensor((seqs, tokens, k)), b.tensor((seqs + 1, tokens + 2, k))
        b.emit("maxsim", f"{O0} = torch.einsum('ijk,mnk->ijmn', {A0}, {A1}).max(-1).values.sum(1)", a, c)
    elif form == "bmm_logsumexp":
        batch, n, m = b.ext.batch, b.n(), 4 * b.n()
        a, c = b.tensor((batch, n, k)), b.tensor((batch, m, k))
        b.emit("bmm_logsumexp", f"{O0} = torch.bmm({A0}, {A1}.transpose(1, 2)).logsumexp(-1)", a, c)
    elif form == "einsum_softmax":
        batch, n, m = b.ext.batch, b.n(), 4 * b.n()
        a, w = b.tensor((batch, n, k)), b.param((m, k))
        b.emit("einsum_softmax", f"{O0} = torch.einsum('bnd,md->bnm', {A0}, {A1}).softmax(-1).sum(-2)", a, w)
    else:
        n, m = 2 * b.n(), 2 * b.n()
        a, c = b.tensor((n, k)), b.tensor((m, k))
        b.emit("einsum_amax", f"{O0} = torch.einsum('nd,md->nm', {A0}, {A1}).amax(0)", a, c)


def _loop(b: _Builder) -> None:
    """A Python loop with a carried state: an RNN-like cell, its states listed and stacked."""
    batch, steps, e, h = b.choose(4, 8), b.rng.randint(3, 10), b.choose(*b.ext.d), b.choose(*b.ext.d)
    x = b.tensor((batch, steps, e), scale=1.0)
    wx, wh = b.param((e, h)), b.param((h, h))
    carried = [v for v in b.alive if b._is_float(v) and tuple(b.meta[v].shape) == (batch, h)]
    args = [x, wx, wh]
    if carried and b.chance(0.5):
        args.append(b.rng.choice(carried))
        start = f"{O0}_h = {A3}"
    else:
        start = f"{O0}_h = {A0}.new_zeros({batch}, {h})"
    cell = b.choose("tanh", "gated")
    if cell == "tanh":
        update = [f"    {O0}_h = torch.tanh({A0}[:, {O0}_t] @ {A1} + {O0}_h @ {A2})"]
    else:
        update = [f"    {O0}_z = torch.sigmoid({A0}[:, {O0}_t] @ {A1} - {O0}_h @ {A2})",
                  f"    {O0}_h = (1 - {O0}_z) * {O0}_h + {O0}_z * torch.tanh({A0}[:, {O0}_t] @ {A1} + {O0}_h @ {A2})"]
    collect = b.choose("stack", "cat", "buffer", "last")
    if collect == "buffer":  # states written into a fresh tensor, slice by slice
        lines = [start, f"{O0} = {A0}.new_zeros({batch}, {steps}, {h})", f"for {O0}_t in range({steps}):",
                 *update, f"    {O0}[:, {O0}_t] = {O0}_h"]
    elif collect == "last":
        lines = [start, f"for {O0}_t in range({steps}):", *update, f"{O0} = {O0}_h"]
    else:
        joined = f"torch.stack({O0}_states, dim=1)" if collect == "stack" else f"torch.cat({O0}_states, dim=-1)"
        lines = [start, f"{O0}_states = []", f"for {O0}_t in range({steps}):", *update,
                 f"    {O0}_states.append({O0}_h)", f"{O0} = {joined}"]
    b.emit(f"{cell}_{collect}", "\n".join(lines), *args)


def _views(b: _Builder) -> None:
    """Chains of views (reshape, permute, strided slices, select, expand, unsqueeze, ``t()``) read by
    a pointwise op, a reduction or a matmul; or a view of a result that a broadcast op also reads."""
    if b.chance(0.3):
        n, d, e = b.n(), b.d(), 2 * b.choose(*b.ext.d)
        x, w = b.tensor((n, d)), b.param((d, e))
        h = b.emit("project", f"{O0} = {A0} @ {A1}", x, w, result=False)
        view = b.emit("view", b.choose(f"{O0} = {A0}.view({n}, 2, {e // 2})", f"{O0} = {A0}.t()",
                                       f"{O0} = {A0}[:, ::2]"), h, result=False)
        near = b.emit("broadcast_read", f"{O0} = ({A0}[:, None] * {A0}[None]).sum(-1).amax(-1)", h)
        b.emit("view_read", f"{O0} = {A0}.tanh().sum(-1) + {A1}.sum()", view, near)
        return
    source = b.some_result(2) if b.chance(0.5) else None
    if source is None:
        source = b.tensor(b.lead(1) + (b.n(), b.d()))
    chain, shape = "", tuple(b.meta[source].shape)
    for _ in range(b.rng.randint(1, 3)):
        step, shape = _view_step(b, shape)
        chain += step
    view = b.emit("view_chain", f"{O0} = {A0}{chain}", source, result=False)
    shape = tuple(b.meta[view].shape)
    reader = b.choose("pointwise", "reduce", "matmul", "broadcast")
    if reader == "pointwise":
        b.emit("pointwise", f"{O0} = {A0}.sin() * 2 + {A0}", view)
    elif reader == "reduce":
        b.emit("reduce", f"{O0} = {A0}.sum(-1)", view)
    elif reader == "matmul":
        w = b.param((shape[-1], b.d()))
        b.emit("matmul", f"{O0} = {A0} @ {A1}", view, w)
    else:
        b.emit("broadcast", f"{O0} = {A0} * {A0}.mean(-1, keepdim=True)", view)


def _view_step(b: _Builder, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """One view of a value of ``shape``: its text and the shape it gives."""
    rank = len(shape)
    options = ["permute", "slice", "unsqueeze_expand", "narrow"]
    if rank >= 2:
        options += ["merge"]
    if rank == 2:
        options += ["t"]
    if rank >= 3:
        options += ["select"]
    if shape[-1] % 2 == 0:
        options += ["split"]
    step = b.rng.choice(options)
    if step == "permute":
        order = list(range(rank))
        b.rng.shuffle(order)
        return f".permute({_dims(order)})", tuple(shape[i] for i in order)
    if step == "slice":
        dim = b.rng.randrange(rank)
        start, stride = b.choose(0, 1), b.choose(2, 3)
        index = ", ".join([":"] * dim + [f"{start}::{stride}"])
        size = len(range(start, shape[dim], stride))
        return f"[{index}]", shape[:dim] + (size,) + shape[dim + 1:]
    if step == "unsqueeze_expand":
        dim = b.rng.randrange(rank + 1)
        sizes = ["-1"] * (rank + 1)
        sizes[dim] = "3"
        return f".unsqueeze({dim}).expand({', '.join(sizes)})", shape[:dim] + (3,) + shape[dim:]
    if step == "narrow":
        dim = b.rng.randrange(rank)
        length = max(1, shape[dim] // 2)
        start = 1 if shape[dim] > length else 0
        return f".narrow({dim}, {start}, {length})", shape[:dim] + (length,) + shape[dim + 1:]
    if step == "merge":
        return f".reshape({_dims(shape[:-2] + (shape[-2] * shape[-1],))})", shape[:-2] + (shape[-2] * shape[-1],)
    if step == "t":
        return b.choose(".t()", ".T", ".transpose(0, 1)"), (shape[1], shape[0])
    if step == "select":
        dim = b.rng.randrange(rank - 1)
        return f".select({dim}, {shape[dim] - 1})", shape[:dim] + shape[dim + 1:]
    return f".unflatten(-1, (2, {shape[-1] // 2}))", shape[:-1] + (2, shape[-1] // 2)


def _inplace(b: _Builder) -> None:
    """In-place writes into fresh tensors and their views."""
    source = b.some_result(2) if b.chance(0.4) else None
    if source is None:
        source = b.tensor(b.lead(1) + (b.n(), b.d()))
    shape = tuple(b.meta[source].shape)
    half = shape[-1] // 2
    form = b.choose("strided_mul", "halves", "zeros_setitem", "normalise", "relu_", "masked_fill", "transposed")
    if form == "strided_mul":
        lines = [f"{O0} = {A0}.clone()", f"{O0}[..., ::2].mul_(2)"]
    elif form == "halves":
        lines = [f"{O0} = {A0}.clone()", f"{O0}[..., {half}:{2 * half}].add_({A0}[..., :{half}].sin())"]
    elif form == "zeros_setitem":
        lines = [f"{O0} = torch.zeros_like({A0})", f"{O0}[..., :{half}] = {A0}[..., :{half}].tanh()"]
    elif form == "normalise":
        lines = [f"{O0} = {A0}.exp() * 1.0", f"{O0}.div_({O0}.sum(-1, keepdim=True))"]
    elif form == "relu_":
        lines = [f"{O0} = {A0} * 2", f"{O0}.relu_()"]
    elif form == "masked_fill":
        lines = [f"{O0} = {A0}.clone()", f"{O0}.masked_fill_({A0} < -1, 0.0)"]
    else:
        lines = [f"{O0} = {A0}.clone()", f"{O0}.transpose(-1, -2)[..., 1:, :].sub_(0.5)"]
    out = b.emit(form, "\n".join(lines), source)
    if b.chance(0.3):
        b.emit("read", f"{O0} = {A0}.sum(-1)", out)


def _index(b: _Builder) -> None:
    """index_add, scatter_add, gather and indexing with int64 indices."""
    n, d, count = b.n(), b.d(), 2 * b.n()
    form = b.choose("index_add", "index_add_base", "index_add_", "scatter_add", "gather", "getitem", "index_select")
    if form in ("index_add", "index_add_base", "index_add_", "scatter_add"):
        src = b.tensor((count, d))
        idx = b.index((count,), n)
        if form == "index_add":
            b.emit(form, f"{O0} = {A0}.new_zeros({n}, {d}).index_add(0, {A1}, {A0})", src, idx)
        elif form == "index_add_base":
            base = b.tensor((n, d))
            b.emit(form, f"{O0} = {A2}.index_add(0, {A1}, {A0}, alpha=0.5)", src, idx, base)
        elif form == "index_add_":
            b.emit(form, f"{O0} = {A0}.new_zeros({n}, {d})\n{O0}.index_add_(0, {A1}, {A0}.tanh())", src, idx)
        else:
            b.emit(form, f"{O0} = {A0}.new_zeros({n}, {d}).scatter_add(0, {A1}[:, None].expand(-1, {d}), {A0})",
                   src, idx)
    elif form == "gather":
        x = b.tensor((n, d))
        idx = b.index((n, 5), d)
        b.emit(form, f"{O0} = {A0}.gather(1, {A1})", x, idx)
    elif form == "getitem":
        x = b.tensor((n, d))
        idx = b.index((count,), n)
        b.emit(form, f"{O0} = {A0}[{A1}].relu()", x, idx)
    else:
        x = b.tensor((n, d))
        idx = b.index((count,), n)
        b.emit(form, f"{O0} = {A0}.index_select(0, {A1}).sum(0)", x, idx)


def _norm(b: _Builder) -> None:
    """Normalisations: layer norm, RMS norm, vector norms."""
    source = b.some_result(2) if b.chance(0.4) else None
    if source is None:
        source = b.tensor(b.lead(1) + (b.n(), b.d()))
    d = b.meta[source].shape[-1]
    form = b.choose("layer_norm", "layer_norm_affine", "rms_norm", "vector_norm", "normalize", "divide_norm", "rsqrt")
    if form == "layer_norm":
        b.emit(form, f"{O0} = F.layer_norm({A0}, ({d},))", source)
    elif form == "layer_norm_affine":
        w, bias = b.param((d,), scale=1.0), b.param((d,), scale=0.1)
        b.emit(form, f"{O0} = F.layer_norm({A0}, ({d},), {A1}, {A2})", source, w, bias)
    elif form == "rms_norm":
        w = b.param((d,), scale=1.0)
        b.emit(form, f"{O0} = F.rms_norm({A0}, ({d},), {A1}, eps=1e-6)", source, w)
    elif form == "vector_norm":
        b.emit(form, f"{O0} = torch.linalg.vector_norm({A0}, dim=-1)", source)
    elif form == "normalize":
        b.emit(form, f"{O0} = F.normalize({A0}, dim=-1)", source)
    elif form == "divide_norm":
        b.emit(form, f"{O0} = {A0} / {A0}.norm(dim=-1, keepdim=True).clamp_min(1e-6)", source)
    else:
        b.emit(form, f"{O0} = {A0} * torch.rsqrt({A0}.pow(2).mean(-1, keepdim=True) + 1e-6)", source)


def _conv(b: _Builder) -> None:
    """conv1d and conv2d, with padding, strides or a bias."""
    batch, channels, out_channels = b.ext.batch, b.choose(3, 4, 8), b.choose(4, 8, 16)
    if b.chance(0.5):
        length = b.n()
        x = b.tensor((batch, channels, length), scale=1.0)
        w = b.param((out_channels, channels, 3), scale=(3 * channels) ** -0.5)
        options = b.choose("padding=1", "stride=2", "padding=2, dilation=2")
        out = b.emit("conv1d", f"{O0} = F.conv1d({A0}, {A1}, {options})", x, w, result=False)
    else:
        side = b.choose(8, 12, 16)
        x = b.tensor((batch, channels, side, side), scale=1.0)
        w = b.param((out_channels, channels, 3, 3), scale=(9 * channels) ** -0.5)
        bias = b.param((out_channels,), scale=0.1)
        options = b.choose("padding=1", "stride=2", "padding=1, groups=1")
        out = b.emit("conv2d", f"{O0} = F.conv2d({A0}, {A1}, {A2}, {options})", x, w, bias, result=False)
    reader = b.choose(".relu()", ".tanh().mean(-1)", ".flatten(1)", ".sum(1)")
    b.emit("read", f"{O0} = {A0}{reader}", out)


def _embedding(b: _Builder) -> None:
    """Embedding lookups with int64 indices, pooled or read further."""
    vocab, d, batch, length = b.n(), b.d(), b.ext.batch, b.choose(8, 16)
    table = b.param((vocab, d), scale=1.0)
    ids = b.index((batch, length), vocab)
    lookup = b.choose(f"F.embedding({A1}, {A0})", f"{A0}[{A1}]")
    pool = b.choose(".sum(1)", ".mean(-2)", "", ".tanh()")
    b.emit("embedding", f"{O0} = {lookup}{pool}", table, ids)


def _random(b: _Builder) -> None:
    """Random ops: dropout, masks and noise from the global generator. The draws are float32 whatever
    the program's dtype, so a float64 run of the program draws the same values."""
    source = b.some_result(2) if b.chance(0.5) else None
    if source is None:
        source = b.tensor((b.n(), b.d()))
    form = b.choose("dropout", "rand_mask", "noise", "bernoulli")
    if form == "dropout":
        b.emit(form, f"{O0} = F.dropout({A0}, p={b.choose(0.1, 0.5)})", source)
    elif form == "rand_mask":
        b.emit(form, f"{O0} = {A0} * (torch.rand_like({A0}, dtype=torch.float32) > 0.3)", source)
    elif form == "noise":
        b.emit(form, f"{O0} = {A0} + 0.1 * torch.randn_like({A0}, dtype=torch.float32)", source)
    else:
        b.emit(form, f"{O0} = torch.bernoulli(torch.full_like({A0}, 0.7, dtype=torch.float32)) * {A0}", source)


def _mixed_dtypes(b: _Builder) -> None:
    """Branches in other dtypes, cast back: float64, bfloat16 (on an input that needs no gradient, so
    that bfloat16 rounding of a gradient cannot amplify rounding differences), booleans and indices."""
    source = b.some_result(2) if b.chance(0.4) else None
    if source is None:
        source = b.tensor((b.n(), b.d()))
    form = b.choose("float64", "bfloat16", "bool_mask", "argmax_gather")
    if form == "float64":
        b.emit(form, f"{O0} = {A0}.double().sin().mul(2).to({A0}.dtype) + {A0}", source)
    elif form == "bfloat16":
        shape = tuple(b.meta[source].shape)
        gate = b.input(shape, grad=False)
        b.emit(form, f"{O0} = {A0} * {A1}.to(torch.bfloat16).sigmoid().to({A0}.dtype)", source, gate)
    elif form == "bool_mask":
        b.emit(form, f"{O0} = {A0} * ({A0} > 0).to({A0}.dtype)", source)
    else:
        b.emit(form, f"{O0} = {A0}.gather(-1, {A0}.argmax(-1, keepdim=True)).squeeze(-1)", source)


def _outputs(b: _Builder) -> None:
    """Several outputs that are views of one another (a result, its slice, its transpose), or a max's
    values and indices."""
    source = b.some_result(2)
    if source is None:
        x = b.tensor((b.n(), b.d()))
        w = b.param((b.meta[x].shape[-1], b.d()))
        source = b.emit("matmul", f"{O0} = ({A0} @ {A1}).tanh()", x, w)
    form = b.choose("slice", "transpose", "flat", "max")
    if form == "slice":
        view = b.emit("slice_output", f"{O0} = {A0}[..., :3]", source)
    elif form == "transpose":
        view = b.emit("transpose_output", f"{O0} = {A0}.transpose(-1, -2)", source)
    elif form == "flat":
        flatten = "view" if b.meta[source].is_contiguous() else "reshape"
        view = b.emit("flat_output", f"{O0} = {A0}.{flatten}(-1)", source)
    else:
        values, indices = b.emit("max_output", f"{O0}, {O1} = {A0}.max(-1)", source, outs=2)
        b.force_output(values, indices)
        return
    b.force_output(source, view)


#: The families of :func:`structural_program`, by name: each appends the statements of one structure.
FAMILIES: dict[str, Callable[[_Builder], None]] = {
    "pairwise": _pairwise,
    "chamfer": _chamfer,
    "attention": _attention,
    "matmul_max": _matmul_max,
    "broadcast_matmul": _broadcast_matmul,
    "logspace_matmul": _logspace_matmul,
    "einsum_reduce": _einsum_reduce,
    "loop": _loop,
    "views": _views,
    "inplace": _inplace,
    "index": _index,
    "norm": _norm,
    "conv": _conv,
    "embedding": _embedding,
    "random": _random,
    "mixed_dtypes": _mixed_dtypes,
    "outputs": _outputs,
}


def structural_program(
    seed: int, *, families: Sequence[str] | None = None, blocks: tuple[int, int] = (1, 3), size: str = "default"
) -> tuple[ProgramModule, tuple[torch.Tensor, ...]]:
    """A seeded random program of the structures memplan's passes look for, and its inputs.

    The program is ``blocks`` (drawn between the two bounds) instances of families from ``families``
    (all of :data:`FAMILIES` by default), each reading new leaves or earlier results of matching
    shape. ``model.program`` holds it as data (:class:`StructuralProgram`). The same arguments give
    the same program and inputs.

    Parameters
    ----------
    seed : int
    families : sequence of str, optional
        The families to draw from (keys of :data:`FAMILIES`).
    blocks : (int, int)
        The least and most family instances.
    size : {"default", "small"}
        ``"small"`` divides the extents by about four (for quick tests; the intermediates then
        dominate less).

    Examples
    --------
    >>> model, inputs = structural_program(7, families=["pairwise"], blocks=(1, 1))
    >>> model.program.families
    ('pairwise',)
    >>> outputs = model(*inputs)
    """
    names = tuple(FAMILIES) if families is None else tuple(families)
    unknown = [name for name in names if name not in FAMILIES]
    if unknown or not names:
        raise ValueError(f"unknown families {unknown}: choose among {', '.join(FAMILIES)}")
    builder = _Builder(seed, size)
    for _ in range(builder.rng.randint(*blocks)):
        builder.family = builder.rng.choice(names)
        FAMILIES[builder.family](builder)
    return builder.program().build()


# ----------------------------------------------------------------------------------------------
# the oracle


#: The checks of :func:`check_program`, in the order it runs them.
CHECKS: tuple[str, ...] = ("random", "equivalence", "inference", "peak", "prediction", "budget")

# The kind of a finding that is not a failure: the program's rounding error is too large to compare.
ILL_CONDITIONED = "ill-conditioned"
# The kind of a finding that is counted but is not a failure: the plan's predicted peak is more than 5%
# above the measured one. Such a plan keeps every budget it accepts; it may refuse one it could keep.
OVERESTIMATE = "overestimate"
#: A program whose float32 values another order of a sum may move past the tolerance (a near tie in a
#: selection: :func:`~memplan.equivalence.settles_near_ties`): its values are not compared, its memory is.
NEAR_TIE = "near-tie"
#: The checks that compare values, left out for a :data:`NEAR_TIE` program (``budget`` keeps its peak check).
_VALUE_CHECKS = ("random", "equivalence", "inference")


@dataclasses.dataclass(frozen=True)
class Finding:
    """What :func:`check_program` found wrong with memplan on one program.

    ``kind`` is one of: ``"output"``, ``"gradient"``, ``"buffer"`` (a training call differs from the
    original's), ``"inference"`` (the call under ``no_grad`` differs), ``"random"`` (the random draws of
    two consecutive calls differ), ``"peak"`` (the optimized step's measured peak is above eager's),
    ``"prediction"`` (the measured peak is more than 5% above the plan's prediction: a budget the plan
    accepts could be broken), ``"overestimate"`` (the prediction is more than 5% above the measured
    peak: counted, not a failure), ``"budget"`` (a
    budget neither honoured nor refused), ``"capture"`` (a ``CaptureError``), ``"error"`` (any other
    exception from memplan), ``"invalid"`` (the original program itself fails: a generator bug). The
    kinds ``"ill-conditioned"`` (the program was skipped), ``"near-tie"`` (its values were not compared,
    its memory was) and ``"overestimate"`` are not failures (see :attr:`failed`).
    ``check`` names the check (of :data:`CHECKS`) that found it; ``where`` is, for an exception, its
    type and the memplan line that raised it.
    """

    kind: str
    message: str
    seed: int | None = None
    program: StructuralProgram | None = dataclasses.field(default=None, repr=False, compare=False)
    check: str = ""
    where: str = ""

    @property
    def failed(self) -> bool:
        """False for a skipped (ill-conditioned) program and for an overestimated peak."""
        return self.kind not in (ILL_CONDITIONED, OVERESTIMATE, NEAR_TIE)

    @property
    def signature(self) -> tuple[str, str, str]:
        """``(kind, check, where)``: what a smaller program must reproduce to be the same failure."""
        return self.kind, self.check, self.where

    def __str__(self) -> str:
        seed = f" (seed {self.seed})" if self.seed is not None else ""
        where = f" {self.where}:" if self.where else ""
        return f"{self.kind}{seed}: {self.check}:{where} {self.message}"


class _Found(Exception):
    """A check's finding, raised to end the check."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _mismatch_kind(error: AssertionError) -> str | None:
    """The finding kind of an ``assert_equivalent`` failure; None for any other assertion (one of
    memplan's own, which is an error)."""
    message = str(error)
    for prefix, kind in (("output", "output"), ("gradient", "gradient"), ("buffer", "buffer"),
                         ("the models return", "output"), ("the models have", "gradient")):
        if message.startswith(prefix):
            return kind
    return None


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def _where(error: BaseException) -> str:
    """The exception's type and the last line of memplan (outside this module and the equivalence
    oracle it checks with) in its traceback, then the same of the exception it was raised from, if any:
    ``"PassError at pipeline.py:310 from ValueError at passes/chunk.py:120"``."""
    inside = [
        f for f in traceback.extract_tb(error.__traceback__)
        if os.path.abspath(f.filename).startswith(_PACKAGE + os.sep)
        and os.path.basename(f.filename) not in ("fuzz.py", "equivalence.py")
    ]
    where = type(error).__name__
    if inside:
        path = os.path.relpath(inside[-1].filename, _PACKAGE).replace(os.sep, "/")
        where += f" at {path}:{inside[-1].lineno}"
    if isinstance(error.__cause__, Exception):
        where += f" from {_where(error.__cause__)}"
    return where


def _first_line(error: BaseException, limit: int = 400) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:limit] if lines else ""


class _Twice(nn.Module):
    """Two consecutive calls of a model: the outputs of both in one tuple."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        first = _tensors(self.model(*args))
        return (*first, *_tensors(self.model(*args)))


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


class _Checker:
    """The checks of one program, sharing one optimized module and eager's measured peak."""

    def __init__(self, model: nn.Module, inputs: Sequence[Any], settings: Mapping[str, Any], values: bool = True):
        from memplan.api import optimize

        self.optimize = functools.partial(optimize, **settings)
        self.model = model
        self.inputs = tuple(inputs)
        self.values = values  # False: a near tie (NEAR_TIE), whose values are not compared
        self.opt = self.optimize(model)  # plans on its first call, in whichever check comes first
        self._eager_peak: int | None = None

    def eager_peak(self) -> int:
        from memplan.measure import measure
        from memplan.steps import step_fn

        if self._eager_peak is None:
            step = step_fn(self.model, self.inputs, train=True)
            step()
            self._eager_peak = measure(step).peak
        return self._eager_peak

    def equivalence(self) -> None:
        assert_equivalent(self.model, self.opt, *self.inputs)

    def random(self) -> None:
        """Two consecutive calls from one seed draw what eager's do. This check runs first, so the
        first call also plans: planning must leave the generator alone."""
        with torch.random.fork_rng():
            torch.manual_seed(0)
            eager = [_tensors(self.model(*self.inputs)) for _ in range(2)]
        if all(torch.equal(a, b) for a, b in zip(*eager)):
            return  # the program draws no random numbers
        try:
            with torch.random.fork_rng():
                assert_equivalent(_Twice(self.model), _Twice(self.opt), *self.inputs)
        except AssertionError as e:
            if _mismatch_kind(e) is None:
                raise
            count = len(eager[0])
            raise _Found("random", f"two consecutive calls from one seed differ (outputs 0-{count - 1} are the "
                                   f"first call's, {count}-{2 * count - 1} the second's): {e}") from None

    def inference(self) -> None:
        try:
            assert_equivalent(self.model, self.opt, *self.inputs, grad=False)
        except AssertionError as e:
            if _mismatch_kind(e) is None:
                raise
            raise _Found("inference", str(e)) from None

    def _planned_peak(self) -> int:
        """The measured peak of the optimized module's training step (planned before it is measured)."""
        from memplan.measure import measure
        from memplan.steps import step_fn

        step = step_fn(self.opt, self.inputs, train=True)
        step()
        return measure(step).peak

    def peak(self) -> None:
        planned, eager = self._planned_peak(), self.eager_peak()
        if planned > eager:
            raise _Found("peak", f"the optimized step's measured peak is {planned} B, above eager's {eager} B")

    def prediction(self) -> None:
        from memplan.analysis.peak import step_margin

        measured = self._planned_peak()
        plan = self.opt.plan
        predicted = plan.planned_peak + step_margin(plan.graph)
        if measured > 1.05 * predicted:
            raise _Found("prediction", f"the plan predicts {predicted} B, the ruler measures {measured} B "
                                       f"({predicted / measured:.3f}x)")
        if predicted > 1.05 * measured:
            raise _Found(OVERESTIMATE, f"the plan predicts {predicted} B, the ruler measures {measured} B "
                                       f"({predicted / measured:.3f}x)")

    def budget(self) -> None:
        from memplan.measure import measure
        from memplan.steps import step_fn

        budget = self.eager_peak() // 2
        constrained = self.optimize(self.model, budget=budget)
        step = step_fn(constrained, self.inputs, train=True)
        try:
            step()
        except InfeasibleBudgetError:
            return
        peak = measure(step).peak
        if peak > budget:
            raise _Found("budget", f"budget {budget} B (half of eager's measured peak) accepted, but the step's "
                                   f"measured peak is {peak} B")
        if not self.values:
            return
        try:
            assert_equivalent(self.model, constrained, *self.inputs)
        except AssertionError as e:
            kind = _mismatch_kind(e)
            if kind is None:
                raise
            raise _Found(kind, f"under budget {budget} B: {e}") from None


def check_program(
    model: nn.Module,
    inputs: Sequence[Any],
    *,
    passes: str | Sequence[str] | None = None,
    checks: Sequence[str] = CHECKS,
    max_overhead: float = 0.3,
    options: Mapping[str, Any] | None = None,
) -> list[Finding]:
    """Check ``memplan.optimize(model, passes=passes, max_overhead=..., options=...)`` against the
    untouched ``model`` on ``inputs``.

    Stages
    ------
    (1) A program that :func:`~memplan.testing.is_well_conditioned` rejects is skipped: the result is a
        single finding of kind ``"ill-conditioned"`` (``failed`` is False). One whose own run raises
        gives a finding of kind ``"invalid"``. One whose values :func:`~memplan.equivalence.settles_near_ties`
        finds undecided (a near tie) gets a finding of kind ``"near-tie"`` (not failed) and only the checks
        of memory and errors: ``peak``, ``prediction``, and ``budget`` without its comparison of values.
    (2) The ``checks`` (see :data:`CHECKS`) run in order:

        - ``"random"``: for a program that draws random numbers, two consecutive calls from one
          ``torch.manual_seed`` give what eager's two calls give (the first call also plans);
        - ``"equivalence"``: outputs, gradients and buffers of a training call agree
          (:func:`~memplan.testing.assert_equivalent`, default tolerances);
        - ``"inference"``: the outputs of a call under ``no_grad`` agree;
        - ``"peak"``: the optimized training step's measured peak (:func:`memplan.measure` on
          :func:`memplan.steps.step_fn`) is not above eager's;
        - ``"prediction"``: the plan's predicted peak (plus the step's loss, see
          :func:`~memplan.analysis.peak.step_margin`) is within 5% of that measured peak; a measured
          peak above it is a failure (kind ``"prediction"``), one below it an ``"overestimate"``;
        - ``"budget"``: ``budget=`` half of eager's measured peak is refused with
          :class:`~memplan.errors.InfeasibleBudgetError`, or honoured (the measured peak is at most the
          budget, and the plan's outputs and gradients agree).

        A ``CaptureError`` is a finding of kind ``"capture"``, any other exception one of kind
        ``"error"``; either ends the checks.

    Examples
    --------
    >>> model, inputs = structural_program(5, families=["norm"], blocks=(1, 1), size="small")
    >>> check_program(model, inputs, passes="", checks=("equivalence",))
    []
    """
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise ValueError(f"unknown checks {unknown}: choose among {', '.join(CHECKS)}")
    program = getattr(model, "program", None)
    if not isinstance(program, StructuralProgram):
        program = None
    seed = program.seed if program is not None else None

    def finding(kind: str, message: str, check: str, where: str = "") -> Finding:
        return Finding(kind, message, seed, program, check, where)

    try:
        conditioned = is_well_conditioned(model, *inputs)
    except Exception as e:  # the program itself fails: no memplan code ran
        return [finding("invalid", _first_line(e), "original", _where(e))]
    if not conditioned:
        return [finding(ILL_CONDITIONED, "rounding moves the outputs or gradients too far from float64's", "original")]
    values = settles_near_ties(model, *inputs)
    checker = _Checker(model, inputs, {"passes": passes, "max_overhead": max_overhead, "options": options}, values)
    findings = [] if values else [finding(NEAR_TIE, "another order of a sum may move the values past the "
                                                     "tolerance: only the memory is checked", "original")]
    for check in (c for c in CHECKS if c in checks and (values or c not in _VALUE_CHECKS)):
        try:
            with pass_failures("raise"):  # a pass that fails is a finding, not a rollback with a warning
                getattr(checker, check)()
        except _Found as e:
            findings.append(finding(e.kind, str(e), check))
        except AssertionError as e:
            kind = _mismatch_kind(e)
            if kind is None:  # an assertion inside memplan
                findings.append(finding("error", _first_line(e), check, _where(e)))
                break
            findings.append(finding(kind, str(e), check))
        except CaptureError as e:
            findings.append(finding("capture", _first_line(e), check, _where(e)))
            break
        except Exception as e:
            findings.append(finding("error", _first_line(e), check, _where(e)))
            break
    return findings


# ----------------------------------------------------------------------------------------------
# the minimiser


def minimise(
    program: StructuralProgram, still_fails: Callable[[StructuralProgram], bool], *, max_tries: int = 400
) -> StructuralProgram:
    """A smaller program on which ``still_fails`` still holds (delta debugging over statements).

    Stages
    ------
    (1) ddmin: split the statements into ``k`` parts (``k`` = 2 at first) and drop each part in turn
        (with every statement that reads it, and outputs lost with them); keep a drop that still fails
        and go on with ``k - 1`` parts, else double ``k`` until parts are single statements.
    (2) Bypass: a statement whose result has the shape and dtype of one of its operands is dropped, its
        readers reading that operand instead.
    (3) Drop outputs one at a time.

    Stages repeat until none removes anything; ``still_fails`` runs at most ``max_tries`` times. The
    result keeps the program's seed and leaves nothing reads dropped.

    Examples
    --------
    >>> model, _ = structural_program(2, blocks=(3, 3), size="small")
    >>> last = model.program.statements[-1].op
    >>> keeps_last = lambda p: any(s.op == last for s in p.statements)
    >>> small = minimise(model.program, keeps_last)
    >>> len(small.statements) <= len(model.program.statements) and keeps_last(small)
    True
    """
    tries = itertools.count()
    seen: set[tuple] = set()

    def fails(candidate: StructuralProgram | None) -> bool:
        if candidate is None:
            return False
        key = (tuple(s.render() for s in candidate.statements), candidate.outputs)
        if key in seen or next(tries) >= max_tries:
            return False
        seen.add(key)
        return still_fails(candidate)

    current = program._tidied()
    changed = True
    while changed:
        changed = False
        # Step 1: ddmin over statements
        parts = 2
        while current.statements:
            count = len(current.statements)
            parts = min(parts, count)
            bounds = [round(i * count / parts) for i in range(parts + 1)]
            for lo, hi in zip(bounds, bounds[1:]):
                candidate = current.without(range(lo, hi))
                if fails(candidate):
                    current, parts, changed = candidate, max(parts - 1, 2), True
                    break
            else:
                if parts >= count:
                    break
                parts = min(2 * parts, count)
        # Step 2: bypass statements that keep an operand's shape
        meta = {leaf.name: (leaf.shape, leaf.dtype) for leaf in current.leaves}
        for s in current.statements:
            meta.update({o: (shape, dtype) for o, shape, dtype in zip(s.outs, s.shapes, s.dtypes)})
        for index in reversed(range(len(current.statements))):
            statement = current.statements[index]
            if len(statement.outs) != 1 or index >= len(current.statements):
                continue
            for arg in dict.fromkeys(statement.args):
                if meta.get(arg) == (statement.shapes[0], statement.dtypes[0]):
                    candidate = current.bypassed(index, arg)
                    if fails(candidate):
                        current, changed = candidate, True
                        break
        # Step 3: drop outputs
        for output in list(current.outputs):
            if len(current.outputs) > 1:
                candidate = current.with_outputs([o for o in current.outputs if o != output])
                if fails(candidate):
                    current, changed = candidate, True
    return current


def same_failure(finding: Finding, **settings: Any) -> Callable[[StructuralProgram], bool]:
    """A predicate for :func:`minimise`: whether a program still fails as ``finding`` did (same
    :attr:`Finding.signature`), running only the check that found it. ``settings`` are
    :func:`check_program`'s keyword arguments (``passes``, ``max_overhead``, ``options``).

    Examples
    --------
    >>> model, _ = structural_program(0, size="small")
    >>> invalid = Finding("invalid", "", check="original", where="RuntimeError")
    >>> same_failure(invalid, passes="")(model.program)
    False
    """
    checks = (finding.check,) if finding.check in CHECKS else CHECKS

    def still_fails(program: StructuralProgram) -> bool:
        model, inputs = program.build()
        found = check_program(model, inputs, checks=checks, **settings)
        return any(f.signature == finding.signature for f in found)

    return still_fails
