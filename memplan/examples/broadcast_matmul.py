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

from memplan.examples._workload import Workload, check_size, finish, place, seeded_build

__all__ = ["HeadMatmul", "make"]

# (batch, heads, dim) per size.
_SHAPES: dict[str, tuple[int, int, int]] = {
    "small": (256, 8, 64),
    "full": (8192, 8, 64),
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


def make(
    size: str = "small",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Workload:
    """Build the broadcasting-matmul workload.

    Parameters
    ----------
    size : {"small", "full"}
        ``"small"``: batch 256, 8 heads of 64; ``"full"``: the report's batch 8192, 8 heads of 64.
    device, dtype, seed
        Target device and floating dtype; seed of torch's RNG.

    Returns
    -------
    Workload
        ``inputs == (x,)`` with ``x`` of shape ``(batch, heads * dim)`` requiring grad, as in the report.
    """
    check_size(size)
    batch, heads, dim = _SHAPES[size]
    with seeded_build(device, seed):
        model = HeadMatmul(heads, dim)
        x = torch.randn(batch, heads * dim)
    return Workload(
        name="broadcast_matmul",
        model=finish(model, device, dtype),
        inputs=(place(x, device, dtype, requires_grad=True),),
        description=(
            f"x.view({batch}, {heads}, 1, {dim}) @ W[{heads}, {dim}, {dim}]: per-head weights broadcast over the batch"
        ),
        size=size,
        seed_report="001",
    )
