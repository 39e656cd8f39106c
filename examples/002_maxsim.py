"""Max-sim scores with einsum: a 4-d similarity tensor that only a max reads (user report 002).

Every sequence ``a[i]`` is scored against every sequence ``b[m]``: each token of ``a[i]`` takes its best dot
product with the tokens of ``b[m]``, and the best values are summed over the tokens of ``a[i]``:

    torch.einsum("ijk,mnk->ijmn", a, b).max(-1).values.sum(1)

``einsum`` builds the whole ``(i, j, m, n)`` similarity before ``max`` reduces it to ``(i, j, m)``, and the
backward of ``max`` scatters its gradient into a zero tensor of the same 4-d shape. memplan computes the same
scores and gradients a slice at a time.

    python examples/002_maxsim.py              # default size
    python examples/002_maxsim.py --small      # a few seconds
    python examples/002_maxsim.py --out DIR    # where the HTML report goes (default: a new temporary folder)
"""

import argparse
import pathlib
import tempfile

import torch
from torch import nn

import memplan
from memplan.steps import step_fn
from memplan.testing import assert_equivalent


class MaxSim(nn.Module):
    """ColBERT-style late interaction, with a learned temperature so that training has a parameter."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, a, b):
        similarity = torch.einsum("ijk,mnk->ijmn", a, b)  # (i, j, m, n): every token against every token
        best = similarity.max(dim=-1).values  # (i, j, m)
        return self.scale * best.sum(dim=1)  # (i, m)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes: runs in a few seconds")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for the HTML report")
    args = parser.parse_args()

    # The report scores 300 sequences of 2000 tokens against 315 of 1990 (width 256); here fewer and shorter.
    if args.small:
        a_shape, b_shape = (4, 16, 8), (5, 15, 8)
    else:
        a_shape, b_shape = (16, 256, 64), (16, 250, 64)
    torch.manual_seed(0)
    model = MaxSim()
    a = torch.randn(a_shape, requires_grad=True)  # in practice both come from encoders, so both get gradients
    b = torch.randn(b_shape, requires_grad=True)
    inputs = (a, b)
    print(f"max-sim of a{a_shape} against b{b_shape}")

    # The eager model: its peak predicted by analyze (over fake tensors) and measured on one training step,
    # scores.sum().backward() with gradients starting from None.
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
    report = optimized.report(title="max-sim (user report 002)")
    path = report.save_html(out / "002_maxsim.html")
    print(f"report: {path}")


if __name__ == "__main__":
    main()
