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

import math

import torch
from torch import nn

from _compare import compare, parse_args


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
    args = parse_args(__doc__)

    # Steps, batch, input features and hidden units.
    seq_len, batch, input_size, hidden_size = (6, 2, 4, 8) if args.small else (128, 32, 32, 128)
    torch.manual_seed(0)
    model = LatentGRU(input_size, hidden_size)
    input_seq = torch.randn(seq_len, batch, input_size, requires_grad=True)
    hidden = torch.zeros(batch, hidden_size)
    inputs = (input_seq, hidden)
    print(f"latent GRU unrolled over {seq_len} steps, batch {batch}, {hidden_size} hidden units")

    compare(model, inputs, title="latent GRU unrolled in Python (user report 003)", name="003_latent_gru", out=args.out)


if __name__ == "__main__":
    main()
