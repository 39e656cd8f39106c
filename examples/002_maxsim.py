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


import torch
from torch import nn

from _compare import compare, parse_args


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
    args = parse_args(__doc__)

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

    compare(model, inputs, title="max-sim (user report 002)", name="002_maxsim", out=args.out)


if __name__ == "__main__":
    main()
