"""The :class:`Workload` record and the ``make`` that every example shares.

A workload is an ordinary PyTorch model together with example inputs: exactly what a user would hand to memplan.
An example module keeps only what is its own: its model, its sizes (a table of keyword arguments per size), and a
build function that creates the model and the inputs from one row of that table. :func:`workload_maker` turns
these into the module's public ``make(size, device, dtype, seed)``, which

1. checks the size;
2. seeds torch's RNG and calls the build function with factory functions allocating on the CPU (or on the meta
   device, when asked for ``device="meta"``), see :func:`seeded_build`;
3. only then moves the model and inputs to the requested device and dtype (:func:`finish`, :func:`place`), so
   that a given seed gives the same numbers on every device.
"""

from __future__ import annotations

import contextlib
import inspect
import textwrap
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["SIZES", "Built", "Workload", "check_size", "finish", "place", "seeded_build", "workload_maker"]

#: The sizes every workload accepts: ``"small"`` runs a CPU training step in well under a second,
#: ``"full"`` reproduces the sizes of the user report.
SIZES: tuple[str, ...] = ("small", "full")


@dataclass(frozen=True, eq=False)
class Workload:
    """A model and its example inputs, built from one of the user reports.

    Attributes
    ----------
    name : str
        Registry name, e.g. ``"maxsim"``.
    model : torch.nn.Module
        The user's model, in ``train()`` mode; its learned tensors are ``nn.Parameter``.
    inputs : tuple of torch.Tensor
        Positional arguments of ``model``. Inputs that receive gradients in training have ``requires_grad=True``.
    description : str
        One line saying what the workload computes.
    size : str
        ``"small"`` or ``"full"``.
    seed_report : str
        Number of the user report the workload reproduces, e.g. ``"002"``.
    """

    name: str
    model: nn.Module = field(repr=False)
    inputs: tuple[torch.Tensor, ...] = field(repr=False)
    description: str
    size: str
    seed_report: str


@dataclass(frozen=True, eq=False)
class Built:
    """What an example's build function returns: its model and inputs where they were built, not yet placed.

    Attributes
    ----------
    model : torch.nn.Module
        The user's model.
    inputs : tuple of torch.Tensor
        Positional arguments of ``model``; those that receive gradients in training have ``requires_grad=True``.
    description : str
        One line saying what the workload computes, with its sizes.
    """

    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    description: str


def check_size(size: str) -> None:
    """Raise ``ValueError`` naming the valid sizes when ``size`` is not one of :data:`SIZES`.

    Examples
    --------
    >>> check_size("small")
    >>> check_size("huge")
    Traceback (most recent call last):
        ...
    ValueError: unknown size 'huge'; valid sizes are: 'small', 'full'
    """
    if size not in SIZES:
        valid = ", ".join(repr(s) for s in SIZES)
        raise ValueError(f"unknown size {size!r}; valid sizes are: {valid}")


@contextlib.contextmanager
def seeded_build(device: torch.device | str, seed: int) -> Iterator[None]:
    """Seed torch's RNG and make factory functions allocate on the CPU, or on meta for ``device="meta"``.

    Building on the CPU and moving afterwards (see :func:`finish`) keeps the values independent of the target
    device; building on meta allocates nothing, which lets tests check the shapes of the ``"full"`` sizes.
    """
    torch.manual_seed(seed)
    build_device = torch.device("meta") if torch.device(device).type == "meta" else torch.device("cpu")
    with torch.device(build_device):
        yield


def place(
    tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype, *, requires_grad: bool = False
) -> torch.Tensor:
    """Move ``tensor`` to ``device`` (floating tensors also to ``dtype``) as a leaf, optionally requiring grad."""
    if tensor.is_floating_point():
        moved = tensor.to(device=device, dtype=dtype)
    else:
        moved = tensor.to(device=device)
    moved = moved.detach()
    if requires_grad:
        moved.requires_grad_(True)
    return moved


def finish(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Move ``model`` to ``device`` and ``dtype`` and put it in training mode."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    target = torch.device(device)
    for tensor in list(model.parameters()) + list(model.buffers()):
        same_device = tensor.device.type == target.type and (target.index is None or tensor.device == target)
        same_dtype = tensor.dtype == dtype or not tensor.is_floating_point()
        if not (same_device and same_dtype):
            # Skipping the no-op conversion also lets the builders run under FakeTensorMode, where
            # ``Module.to`` cannot swap fake parameters.
            model = model.to(device=target, dtype=dtype)
            break
    return model.train()


_MAKE_DOC = """Build the ``{name}`` workload (user report {seed_report}).

Parameters
----------
size : {{"small", "full"}}
{sizes}
device : torch.device or str
    Where the model and inputs live. ``"meta"`` builds them without allocating memory.
dtype : torch.dtype
    Floating dtype of the parameters and floating inputs (integer inputs, such as token ids, stay as they are).
seed : int
    Seed of torch's RNG, set before anything is built.

Returns
-------
Workload
{returns}
"""


def workload_maker(
    name: str,
    *,
    seed_report: str,
    shapes: Mapping[str, Mapping[str, Any]],
    build: Callable[..., Built],
) -> Callable[..., Workload]:
    """Return the public ``make(size, device, dtype, seed)`` of the example ``name``.

    Parameters
    ----------
    name : str
        Registry name of the workload, e.g. ``"maxsim"``.
    seed_report : str
        Number of the user report it reproduces, e.g. ``"002"``.
    shapes : mapping of str to mapping of str to object
        For each of :data:`SIZES`, the keyword arguments of ``build`` at that size.
    build : callable
        ``build(**shapes[size]) -> Built``, called inside :func:`seeded_build`. It creates the model and the
        inputs as a user would, marking the inputs that receive gradients with ``requires_grad=True``; ``make``
        then moves them to the requested device and dtype. Its docstring says what the inputs are: it becomes
        the Returns section of ``make``'s docstring, under a Parameters section that lists the sizes.

    Returns
    -------
    callable
        ``make(size="small", device="cpu", dtype=torch.float32, seed=0) -> Workload``, named ``make`` in the
        module of ``build``.

    Raises
    ------
    ValueError
        If ``shapes`` does not give exactly the sizes of :data:`SIZES`, or ``build`` has no docstring.

    Examples
    --------
    >>> def build(rows):
    ...     '''``inputs == (x,)`` with ``x`` of shape ``(rows, 4)``.'''
    ...     return Built(nn.Linear(4, 2), (torch.randn(rows, 4),), f"a linear layer on {rows} rows")
    >>> make = workload_maker("tiny", seed_report="999", shapes={"small": {"rows": 3}, "full": {"rows": 10**6}},
    ...                       build=build)
    >>> workload = make()
    >>> workload.description, tuple(workload.inputs[0].shape)
    ('a linear layer on 3 rows', (3, 4))
    >>> print(make.__doc__)  # doctest: +ELLIPSIS
    Build the ``tiny`` workload (user report 999).
    <BLANKLINE>
    Parameters
    ----------
    size : {"small", "full"}
        ``"small"``: rows=3;
        ``"full"``: rows=1000000.
    ...
    Returns
    -------
    Workload
        ``inputs == (x,)`` with ``x`` of shape ``(rows, 4)``.
    <BLANKLINE>
    """
    if tuple(shapes) != SIZES:
        raise ValueError(f"shapes of {name!r} must give the sizes {SIZES} in that order, got {tuple(shapes)}")
    if not build.__doc__:
        raise ValueError(f"the build function of {name!r} needs a docstring saying what the inputs are")

    def make(
        size: str = "small",
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> Workload:
        check_size(size)
        with seeded_build(device, seed):
            built = build(**shapes[size])
        model = finish(built.model, device, dtype)
        inputs = tuple(place(x, device, dtype, requires_grad=x.requires_grad) for x in built.inputs)
        return Workload(
            name=name,
            model=model,
            inputs=inputs,
            description=built.description,
            size=size,
            seed_report=seed_report,
        )

    size_lines = []
    for size, kwargs in shapes.items():
        values = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
        size_lines.append(f'``"{size}"``: {values}')
    sizes = ";\n".join(size_lines) + "."
    make.__doc__ = _MAKE_DOC.format(
        name=name,
        seed_report=seed_report,
        sizes=textwrap.indent(sizes, "    "),
        returns=textwrap.indent(inspect.cleandoc(build.__doc__), "    "),
    )
    make.__module__ = build.__module__
    make.__qualname__ = "make"
    return make
