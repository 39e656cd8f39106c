"""A GRU-like cell with a sampled latent, unrolled over time in a Python loop (user report 003).

At every time step the cell predicts a mean and a log-variance from the hidden state, samples a latent with the
reparameterisation trick (the noise is drawn with ``torch.randn`` inside ``forward``), and updates the hidden state
with GRU gates computed from the input and from the latent. Because the loop is unrolled, autograd keeps the
tensors of every step until the backward: the inputs of the three ``torch.mm`` calls, the ``exp``, ``sigmoid``
and ``tanh`` outputs and the gate products, about a dozen ``(batch, hidden)`` tensors per step. memplan keeps
fewer of them, recomputing the rest in the backward, with the same outputs and gradients (the same noise too).

    python examples/003_latent_gru.py              # default size
    python examples/003_latent_gru.py --small      # a few seconds
    python examples/003_latent_gru.py --out DIR    # where the HTML report goes (default: a new temporary folder)
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


class LatentGRU(nn.Module):
    """GRU-style recurrence driven by the input and by a latent sampled from the hidden state."""

    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.hidden_size = hidden_size
        bound = 1.0 / math.sqrt(hidden_size)
        self.weight_encoder = nn.Parameter(torch.empty(hidden_size, 2 * hidden_size).uniform_(-bound, bound))
        self.weight_ih = nn.Parameter(torch.empty(input_size, 3 * hidden_size).uniform_(-bound, bound))
        self.weight_zh = nn.Parameter(torch.empty(hidden_size, 3 * hidden_size).uniform_(-bound, bound))

    def forward(self, input_seq, hidden):
        seq_len, batch, _ = input_seq.shape
        noise = torch.randn(seq_len, batch, self.hidden_size, device=input_seq.device, dtype=input_seq.dtype)
        outputs = []
        for x, eps in zip(input_seq.unbind(0), noise.unbind(0)):
            mean, log_var = torch.mm(hidden, self.weight_encoder).chunk(2, dim=1)
            latent = mean + eps * torch.exp(0.5 * log_var)

            x_reset, x_update, x_new = torch.mm(x, self.weight_ih).chunk(3, dim=1)
            z_reset, z_update, z_new = torch.mm(latent, self.weight_zh).chunk(3, dim=1)

            update = torch.sigmoid(x_update + z_update)
            candidate = torch.tanh(x_new + torch.sigmoid(x_reset + z_reset) * z_new)
            hidden = candidate + update * (hidden - candidate)
            outputs.append(hidden)
        return torch.stack(outputs), hidden


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes: runs in a few seconds")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for the HTML report")
    args = parser.parse_args()

    # Steps, batch, input features and hidden units.
    seq_len, batch, input_size, hidden_size = (6, 2, 4, 8) if args.small else (128, 32, 32, 128)
    torch.manual_seed(0)
    model = LatentGRU(input_size, hidden_size)
    input_seq = torch.randn(seq_len, batch, input_size, requires_grad=True)
    hidden = torch.zeros(batch, hidden_size)
    inputs = (input_seq, hidden)
    print(f"latent GRU unrolled over {seq_len} steps, batch {batch}, {hidden_size} hidden units")

    # The eager model: its peak predicted by analyze (over fake tensors) and measured on one training step,
    # the sum of the outputs, backward, with gradients starting from None (step_fn also seeds torch's RNG,
    # so that the eager model and memplan's draw the same noise).
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

    assert_equivalent(model, optimized, *inputs)  # same seed for both, so the same noise
    print("outputs and gradients match the eager model")

    out = args.out if args.out is not None else pathlib.Path(tempfile.mkdtemp(prefix="memplan-example-"))
    out.mkdir(parents=True, exist_ok=True)
    report = optimized.report(title="latent GRU unrolled in Python (user report 003)")
    path = report.save_html(out / "003_latent_gru.html")
    print(f"report: {path}")


if __name__ == "__main__":
    main()
