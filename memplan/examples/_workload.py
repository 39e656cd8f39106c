"""The :class:`Workload` record and the helpers every example builder shares.

A workload is an ordinary PyTorch model together with example inputs: exactly what a user would hand to memplan.
Builders construct everything on the CPU (or on the meta device, when asked for ``device="meta"``) with torch's
RNG seeded, and only then move the model and inputs to the requested device and dtype, so that a given seed gives
the same numbers on every device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["SIZES", "Workload", "check_size", "seeded_build", "place", "finish"]

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
