"""The eager steps memplan measures and predicts: one training step or one inference call.

A training step is ``sum(out.sum()).backward()`` with gradients starting from ``None``, the same
step :func:`memplan.analyze` captures, so measured and predicted peaks describe the same work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from memplan.capture import sum_backward

__all__ = ["step_fn", "clear_grads", "seed_all"]


def seed_all(seed: int) -> None:
    """``torch.manual_seed(seed)``, without its cost where no GPU can be in use.

    ``torch.manual_seed`` also seeds every accelerator torch was built for; before CUDA is initialised it
    queues that seeding together with the formatted Python stack of the call, about 80 us a call on a CPU
    build, more than many small models' whole step. Where CUDA is unavailable or already initialised,
    the generators in use are seeded directly: the CPU's, and CUDA's when initialised.
    """
    if torch.cuda.is_available() and not torch.cuda.is_initialized():
        torch.manual_seed(seed)  # CUDA may be initialised by the step itself: queue its seeding
        return
    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def clear_grads(model: Any, inputs: Sequence[Any]) -> None:
    """Set ``.grad`` of the model's parameters and of the inputs to ``None``."""
    if isinstance(model, nn.Module):
        for p in model.parameters():
            p.grad = None
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.grad = None


def step_fn(model: Callable[..., Any], inputs: Sequence[Any], *, train: bool, seed: int = 0) -> Callable[[], Any]:
    """A zero-argument callable running one step of ``model`` on ``inputs``.

    Examples
    --------
    >>> lin = torch.nn.Linear(3, 2)
    >>> step = step_fn(lin, (torch.randn(4, 3),), train=True)
    >>> step(); lin.weight.grad.shape
    torch.Size([2, 3])
    """

    def train_step() -> None:
        clear_grads(model, inputs)
        seed_all(seed)
        sum_backward(model(*inputs))

    def inference_step() -> Any:
        seed_all(seed)
        with torch.no_grad():
            return model(*inputs)

    return train_step if train else inference_step
