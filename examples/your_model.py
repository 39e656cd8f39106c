"""Your own model: analyze, optimize, measure, report.

A template. Replace ``MyModel`` and ``make`` with your model and one batch of its inputs; the steps in ``main``
work on any model that memplan can capture (a forward written in plain PyTorch, control flow that depends only on
shapes).

    python examples/your_model.py              # default size
    python examples/your_model.py --small      # a few seconds
    python examples/your_model.py --out DIR    # where the HTML report goes (default: a new temporary folder)

The same report from the command line: ``memplan report examples/your_model.py:make --out report.html``.
"""

import torch
import torch.nn.functional as F
from torch import nn

import memplan
from memplan.steps import step_fn
from memplan.testing import assert_equivalent

from _compare import parse_args, print_peaks, write_report


# 1. Your model. Here a small transformer-style classifier: one self-attention block, mean pooling, a linear head,
#    and the loss computed inside forward.
class MyModel(nn.Module):
    def __init__(self, dim, heads, classes):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x, labels):
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        attention = torch.softmax(q @ k.transpose(-2, -1) / (dim // self.heads) ** 0.5, dim=-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(batch, length, dim))
        x = x + self.mlp(self.norm2(x))
        return F.cross_entropy(self.head(x.mean(dim=1)), labels)


# 2. Your model and one batch of its inputs, as (model, (inputs, ...)). `memplan report FILE.py:make` calls it too.
def make(small=False):
    batch, length, dim, heads, classes = (2, 8, 16, 2, 3) if small else (16, 256, 128, 4, 10)
    torch.manual_seed(0)
    model = MyModel(dim, heads, classes)
    x = torch.randn(batch, length, dim)
    labels = torch.randint(0, classes, (batch,))
    return model, (x, labels)


def main():
    args = parse_args(__doc__)
    model, inputs = make(small=args.small)

    # 3. Analyze: capture one training step (forward, then backward of the output's sum, here the loss) over fake
    #    tensors, so nothing big is allocated, and predict its peak. explain() lists the tensors alive at the
    #    peak, with the line of your code that made each and why it is still alive.
    analysis = memplan.analyze(model, *inputs)
    print(analysis.explain(top=5))

    # 4. Optimize: a module with your model's own parameters (an optimizer built on model.parameters() keeps
    #    working). Its first call captures and plans for these input shapes; later calls with the same shapes run
    #    the plan. In your training loop, call `optimized` where you called `model`.
    #    memplan.optimize(model, budget="50%") asks for a predicted peak at most half the model's own.
    optimized = memplan.optimize(model)

    # 5. Measure: the real peak of one training step (gradients starting from None, as analyze assumes), for your
    #    model and for memplan's plan. The first call of the plan's step is the one that plans.
    eager_step = step_fn(model, inputs, train=True)
    eager_step()  # warm-up
    eager = memplan.measure(eager_step)
    optimized_step = step_fn(optimized, inputs, train=True)
    optimized_step()
    planned = memplan.measure(optimized_step)

    print_peaks(eager, analysis.peak, planned, optimized)

    # 6. Check: the same outputs and gradients as your model, on copies of the inputs and from the same RNG seed.
    assert_equivalent(model, optimized, *inputs)
    print("outputs and gradients match the eager model")

    # 7. Report: one HTML file with the memory timeline before and after, the passes and the graph.
    write_report(optimized, title="your model", name="your_model", out=args.out)


if __name__ == "__main__":
    main()
