"""Per-head linear maps applied with a broadcasting ``@`` (user report 001).

The report splits a ``(batch, heads * dim)`` activation into ``heads`` chunks and multiplies each chunk by its own
``dim x dim`` weight with ``x.view(batch, heads, 1, dim) @ W`` where ``W`` is ``(heads, dim, dim)``. The result has
exactly as many numbers as the input, and the weight is small (8 x 64 x 64 floats, 128 KB).

What blows up memory, and why: ``torch.matmul`` has no derivative of its own. For these shapes it broadcasts ``W``
to the full batch shape ``(batch, heads, dim, dim)``, copies it into a contiguous ``(batch * heads, dim, dim)``
tensor and calls ``bmm`` with a ``(batch * heads, 1, dim)`` left operand. When the input requires grad, ``bmm``
saves that copy for the backward pass: ``batch`` copies of the weight, 1.07 GB for the report's ``batch = 8192``
(the report measured 1.1 GB allocated, against 35 MB with a single ``(512, 512)`` weight and the same output), and
the backward builds a gradient of the same size before reducing it over the batch. When the input does not require
grad the copy is not saved and is freed at once, which is why the report sees the difference only in training.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from memplan.examples._workload import Built, workload_maker

__all__ = ["HeadMatmul", "make"]

# Keyword arguments of _build per size; "full" is the report's.
_SHAPES: dict[str, dict[str, int]] = {
    "small": {"batch": 256, "heads": 8, "dim": 64},
    "full": {"batch": 8192, "heads": 8, "dim": 64},
}


class HeadMatmul(nn.Module):
    """Apply a separate ``dim x dim`` linear map to each of ``heads`` chunks of the features.

    Parameters
    ----------
    heads : int
        Number of chunks.
    dim : int
        Size of each chunk; the input has ``heads * dim`` features.

    Attributes
    ----------
    W : torch.nn.Parameter
        ``(heads, dim, dim)`` weights, one matrix per head.
    """

    def __init__(self, heads: int, dim: int) -> None:
        super().__init__()
        self.heads = heads
        self.dim = dim
        self.W = nn.Parameter(torch.randn(heads, dim, dim) / math.sqrt(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``x`` of shape ``(batch, heads * dim)`` to the same shape, head by head."""
        batch = x.shape[0]
        per_head = x.view(batch, self.heads, 1, self.dim)
        out = per_head @ self.W  # (batch, heads, 1, dim); W is broadcast over the batch
        return out.reshape(batch, self.heads * self.dim)


def _build(batch: int, heads: int, dim: int) -> Built:
    """``inputs == (x,)`` with ``x`` of shape ``(batch, heads * dim)`` requiring grad, as in the report."""
    model = HeadMatmul(heads, dim)
    x = torch.randn(batch, heads * dim, requires_grad=True)
    description = (
        f"x.view({batch}, {heads}, 1, {dim}) @ W[{heads}, {dim}, {dim}]: per-head weights broadcast over the batch"
    )
    return Built(model, (x,), description)


make = workload_maker("broadcast_matmul", seed_report="001", shapes=_SHAPES, build=_build)
