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

import argparse
import pathlib
import tempfile

import torch
from torch import nn

import memplan
from memplan.steps import step_fn
from memplan.testing import assert_equivalent


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes: runs in a few seconds")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for the HTML report")
    args = parser.parse_args()

    # The report's sizes are n, t, v, c = 500, 1, 40, 200; here a smaller batch and smaller matrices.
    n, t, v, c = (8, 1, 6, 8) if args.small else (64, 1, 16, 64)
    torch.manual_seed(0)
    model = ChainProduct(t, v, c)
    x = torch.randn(n, t, v, c) - 2.0  # data: no gradient
    inputs = (x,)
    print(f"log-space chain product of {v - 1} ({c} x {c}) matrices for a batch of {n}")

    # The eager model: its peak predicted by analyze (over fake tensors) and measured on one training step,
    # out.sum().backward() with gradients starting from None.
    analysis = memplan.analyze(model, *inputs)
    eager_step = step_fn(model, inputs, train=True)
    eager_step()  # warm-up
    eager = memplan.measure(eager_step)

    # The same model planned by memplan: the first call captures and plans, the second is measured.
    optimized = memplan.optimize(model)
    optimized_step = step_fn(optimized, inputs, train=True)
    optimized_step()
    planned = memplan.measure(optimized_step)

    print(f"{'peak of one training step':26s}{'measured':>12s}{'predicted':>12s}")
    print(f"  {'eager PyTorch':24s}{memplan.format_bytes(eager.peak):>12s}{memplan.format_bytes(analysis.peak):>12s}")
    print(
        f"  {'memplan':24s}{memplan.format_bytes(planned.peak):>12s}"
        f"{memplan.format_bytes(optimized.plan.planned_peak):>12s}   {eager.peak / planned.peak:.1f}x lower"
    )
    print(optimized.plan)

    assert_equivalent(model, optimized, *inputs)  # raises if an output or a gradient differs
    print("outputs and gradients match the eager model")

    out = args.out if args.out is not None else pathlib.Path(tempfile.mkdtemp(prefix="memplan-example-"))
    out.mkdir(parents=True, exist_ok=True)
    report = optimized.report(title="log-space chain product (user report 000)")
    path = report.save_html(out / "000_chain_product.html")
    print(f"report: {path}")


if __name__ == "__main__":
    main()
