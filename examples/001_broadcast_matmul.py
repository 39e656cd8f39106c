"""Per-head weights applied with a broadcasting ``@``, whose backward keeps a copy of the weight per example
(user report 001).

The features of each example are split into ``heads`` chunks, and each chunk is multiplied by its own
``dim x dim`` weight: ``x.view(batch, heads, 1, dim) @ W`` with ``W`` of shape ``(heads, dim, dim)``. The output
is no bigger than the input and the weight is small, yet training needs far more memory than the same step with
one big ``(heads * dim, heads * dim)`` weight: ``torch.matmul`` broadcasts ``W`` over the batch, copies it into a
contiguous ``(batch * heads, dim, dim)`` tensor for ``bmm``, and autograd saves that copy for the backward, which
then builds a gradient of the same size before summing it over the batch. memplan gives the same outputs and
gradients without the per-example copies.

    python examples/001_broadcast_matmul.py              # default size
    python examples/001_broadcast_matmul.py --small      # a few seconds
    python examples/001_broadcast_matmul.py --out DIR    # where the HTML report goes (default: a new temporary folder)
"""

import math

import torch
from torch import nn

from _compare import compare, parse_args


class HeadMatmul(nn.Module):
    """A separate ``dim x dim`` linear map for each of ``heads`` chunks of the features."""

    def __init__(self, heads, dim):
        super().__init__()
        self.heads = heads
        self.dim = dim
        self.W = nn.Parameter(torch.randn(heads, dim, dim) / math.sqrt(dim))

    def forward(self, x):
        batch = x.shape[0]
        per_head = x.view(batch, self.heads, 1, self.dim)
        out = per_head @ self.W  # (batch, heads, 1, dim): W is broadcast over the batch
        return out.reshape(batch, self.heads * self.dim)


def main():
    args = parse_args(__doc__)

    # The report's batch is 8192, with 8 heads of 64; here a smaller batch.
    batch, heads, dim = (16, 2, 8) if args.small else (1024, 8, 64)
    torch.manual_seed(0)
    model = HeadMatmul(heads, dim)
    x = torch.randn(batch, heads * dim, requires_grad=True)  # as in the report, the input requires grad
    inputs = (x,)
    print(f"x.view({batch}, {heads}, 1, {dim}) @ W[{heads}, {dim}, {dim}]")

    compare(model, inputs, title="broadcasting matmul (user report 001)", name="001_broadcast_matmul", out=args.out)


if __name__ == "__main__":
    main()
