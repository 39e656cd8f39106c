"""A long chain of matrix products in log space, multiplied pairwise as a tree (user report 000).

The model computes ``p_0 D_0 P_1 D_1 ... D_{v-2} P_{v-1} x_{v-1}`` for a batch of inputs: each ``D_i`` is the
diagonal matrix of the values ``x_i`` and each ``P_i`` a learned ``c x c`` matrix. To stay stable it works in log
space: neighbouring blocks are multiplied by subtracting a max, taking ``exp``, clamping, calling ``@`` and taking
``log`` again, level after level, until one block remains.

Every block is ``(n, t, c, c)`` for a batch of ``n``, so broadcasting ``x_i`` against ``log P_i`` makes the first
level ``v - 1`` blocks per example, and each level creates several tensors of that size which autograd keeps for
the backward. memplan runs the same computation a slice of the batch at a time.

    python examples/000_chain_product.py              # default size
    python examples/000_chain_product.py --small      # a few seconds
    python examples/000_chain_product.py --out DIR    # where the HTML report goes (default: a new temporary folder)
"""


import torch
from torch import nn

from _compare import compare, parse_args


class ChainProduct(nn.Module):
    """Batched ``p_0 D_0 P_1 ... P_{v-1} x_{v-1}`` in log space, for ``x`` of shape ``(n, t, v, c)``."""

    def __init__(self, t, v, c, eps=1e-10):
        super().__init__()
        self.eps = eps
        self.bulk = nn.Parameter(torch.rand(1, t, v - 1, c, c))  # the P_i
        self.p0 = nn.Parameter(torch.rand(1, t, c))

    def forward(self, x):
        x_first = x[..., :-1, :, None]  # (n, t, v-1, c, 1): the diagonals of D_0 .. D_{v-2}
        x_last = x[..., -1, None, :]  # (n, t, 1, c)
        middle = x_first + torch.log(self.bulk.abs() + self.eps)  # (n, t, v-1, c, c): log(D_{i-1} P_i)
        while middle.shape[-3] > 1:
            middle = self.multiply_pairs(middle)
        chain = torch.logsumexp(middle.squeeze(-3) + x_last, dim=-1)  # (n, t, c)
        return torch.logsumexp(torch.log(self.p0.abs() + self.eps) + chain, dim=-1)  # (n, t)

    def multiply_pairs(self, stack):
        """Multiply blocks 2k and 2k+1 (log space); an odd level is padded with a block of zeros."""
        if stack.shape[-3] % 2 == 1:
            pad_shape = stack.shape[:-3] + (1,) + stack.shape[-2:]
            stack = torch.cat([stack, stack.new_zeros(pad_shape)], dim=-3)
        left = stack[..., 0::2, :, :]
        right = stack[..., 1::2, :, :]
        left_max = torch.max(left, dim=-1, keepdim=True).values
        right_max = torch.max(right, dim=-2, keepdim=True).values
        left = torch.clamp(torch.exp(left - left_max), min=self.eps)
        right = torch.clamp(torch.exp(right - right_max), min=self.eps)
        return left_max + right_max + torch.log(left @ right)


def main():
    args = parse_args(__doc__)

    # The report's sizes are n, t, v, c = 500, 1, 40, 200; here a smaller batch and smaller matrices.
    n, t, v, c = (8, 1, 6, 8) if args.small else (64, 1, 16, 64)
    torch.manual_seed(0)
    model = ChainProduct(t, v, c)
    x = torch.randn(n, t, v, c) - 2.0  # data: no gradient
    inputs = (x,)
    print(f"log-space chain product of {v - 1} ({c} x {c}) matrices for a batch of {n}")

    compare(model, inputs, title="log-space chain product (user report 000)", name="000_chain_product", out=args.out)


if __name__ == "__main__":
    main()
