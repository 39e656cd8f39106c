"""All-pairs late-interaction score ``einsum('ijk,mnk->ijmn').max(-1).sum(1)`` (user report 002).

The report scores every sequence ``a[i]`` (``j`` tokens) against every sequence ``b[m]`` (``n`` tokens): for each
token of ``a[i]`` take its best dot product over the tokens of ``b[m]``, then sum over the tokens of ``a[i]``. This is
the MaxSim operator of ColBERT-style retrieval. Here the score is multiplied by a learned temperature so that a
training step has a parameter to update, and both inputs require grad (they come from encoders in practice).

What blows up memory, and why: ``einsum`` materialises the full ``(i, j, m, n)`` similarity tensor before the
``max`` reduces it, although the result is only ``(i, m)``. For the report's ``a (300, 2000, 256)`` and
``b (315, 1990, 256)`` that is 1.5 TB; even the ``full`` size here (8 x 2000 against 8 x 1990) needs 1 GB for the
forward and as much again in the backward, where the gradient of ``max`` is scattered into a zero tensor of the
same 4-d shape before ``bmm`` contracts it.
"""

from __future__ import annotations

import torch
from torch import nn

from memplan.examples._workload import Built, workload_maker

__all__ = ["MaxSim", "make"]

# Keyword arguments of _build per size: the shapes (i, j, k) of a and (m, n, k) of b. "full" has the report's
# sequence lengths and width, with 8 sequences a side.
_SHAPES: dict[str, dict[str, tuple[int, int, int]]] = {
    "small": {"a_shape": (16, 64, 32), "b_shape": (20, 60, 32)},
    "full": {"a_shape": (8, 2000, 256), "b_shape": (8, 1990, 256)},
}


class MaxSim(nn.Module):
    """Sum over the tokens of ``a`` of the best dot product with any token of ``b``, for every pair of sequences.

    Attributes
    ----------
    scale : torch.nn.Parameter
        Scalar temperature multiplying the scores, initialised to 1.
    """

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Return the ``(i, m)`` scores of ``a`` of shape ``(i, j, k)`` against ``b`` of shape ``(m, n, k)``."""
        similarity = torch.einsum("ijk,mnk->ijmn", a, b)  # (i, j, m, n)
        best = similarity.max(dim=-1).values  # (i, j, m): best token of b[m] for each token of a[i]
        return self.scale * best.sum(dim=1)


def _build(a_shape: tuple[int, int, int], b_shape: tuple[int, int, int]) -> Built:
    """``inputs == (a, b)``, both requiring grad."""
    model = MaxSim()
    a = torch.randn(a_shape, requires_grad=True)
    b = torch.randn(b_shape, requires_grad=True)
    description = f"einsum('ijk,mnk->ijmn').max(-1).sum(1) on a{tuple(a_shape)} and b{tuple(b_shape)}"
    return Built(model, (a, b), description)


make = workload_maker("maxsim", seed_report="002", shapes=_SHAPES, build=_build)
