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

import argparse
import math
import pathlib
import tempfile

import torch
from torch import nn

import memplan
from memplan.steps import step_fn
from memplan.testing import assert_equivalent


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes: runs in a few seconds")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for the HTML report")
    args = parser.parse_args()

    # The report's batch is 8192, with 8 heads of 64; here a smaller batch.
    batch, heads, dim = (16, 2, 8) if args.small else (1024, 8, 64)
    torch.manual_seed(0)
    model = HeadMatmul(heads, dim)
    x = torch.randn(batch, heads * dim, requires_grad=True)  # as in the report, the input requires grad
    inputs = (x,)
    print(f"x.view({batch}, {heads}, 1, {dim}) @ W[{heads}, {dim}, {dim}]")

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
    report = optimized.report(title="broadcasting matmul (user report 001)")
    path = report.save_html(out / "001_broadcast_matmul.html")
    print(f"report: {path}")


if __name__ == "__main__":
    main()
