"""A GRU-like cell with a sampled latent state, unrolled over time in Python (user report 003).

At every time step the cell predicts a mean and a log-variance from the hidden state, samples a latent ``z`` with
the reparameterisation trick (``mean + eps * exp(0.5 * log_var)``, ``eps`` drawn with ``torch.randn`` inside
``forward``), and then updates the hidden state with GRU gates computed from the input and from ``z``.

What blows up memory, and why: the loop is unrolled, so autograd keeps the tensors of every step alive until the
backward pass: the inputs of the three ``torch.mm`` calls, the ``exp``, ``sigmoid`` and ``tanh`` outputs, and the
gate products, about a dozen ``(batch, hidden)``-sized tensors per step. The report found training used about
twice the memory of ``nn.LSTM`` (whose fused kernel saves only a few gate buffers per step) and that every
``torch.mm`` in the loop made a new allocation; ``out=`` cannot help because autograd needs the results.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from memplan.examples._workload import Built, workload_maker

__all__ = ["LatentGRU", "make"]

# Keyword arguments of _build per size: T steps, a batch of B, nx input features and H hidden units.
_SHAPES: dict[str, dict[str, int]] = {
    "small": {"seq_len": 64, "batch": 16, "input_size": 32, "hidden_size": 64},
    "full": {"seq_len": 1000, "batch": 64, "input_size": 128, "hidden_size": 256},
}


class LatentGRU(nn.Module):
    """GRU-style recurrence driven by the input and by a latent sampled from the hidden state.

    Parameters
    ----------
    input_size : int
        Features per time step, ``nx``.
    hidden_size : int
        Size ``H`` of the hidden state and of the latent.

    Attributes
    ----------
    W_enc : torch.nn.Parameter
        ``(H, 2H)``: hidden state to latent mean and log-variance.
    W_ih : torch.nn.Parameter
        ``(nx, 3H)``: input to reset, update and candidate pre-activations.
    W_zh : torch.nn.Parameter
        ``(H, 3H)``: latent to reset, update and candidate pre-activations.
    """

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        bound = 1.0 / math.sqrt(hidden_size)
        self.W_enc = nn.Parameter(torch.empty(hidden_size, 2 * hidden_size).uniform_(-bound, bound))
        self.W_ih = nn.Parameter(torch.empty(input_size, 3 * hidden_size).uniform_(-bound, bound))
        self.W_zh = nn.Parameter(torch.empty(hidden_size, 3 * hidden_size).uniform_(-bound, bound))

    def forward(self, input_seq: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the cell over ``input_seq`` of shape ``(T, B, nx)`` from ``hidden`` of shape ``(B, H)``.

        Returns
        -------
        outputs : torch.Tensor
            ``(T, B, H)``, the hidden state after every step.
        hidden : torch.Tensor
            ``(B, H)``, the final hidden state.
        """
        seq_len, batch, _ = input_seq.shape
        noise = torch.randn(
            seq_len, batch, self.hidden_size, device=input_seq.device, dtype=input_seq.dtype
        )
        outputs = []
        for x, eps in zip(input_seq.unbind(0), noise.unbind(0)):
            stats = torch.mm(hidden, self.W_enc)
            mean, log_var = stats.chunk(2, dim=1)
            latent = mean + eps * torch.exp(0.5 * log_var)

            x_gates = torch.mm(x, self.W_ih)
            z_gates = torch.mm(latent, self.W_zh)
            x_reset, x_update, x_new = x_gates.chunk(3, dim=1)
            z_reset, z_update, z_new = z_gates.chunk(3, dim=1)

            update = torch.sigmoid(x_update + z_update)
            reset = torch.sigmoid(x_reset + z_reset)
            candidate = torch.tanh(x_new + reset * z_new)
            hidden = candidate + update * (hidden - candidate)
            outputs.append(hidden)
        return torch.stack(outputs), hidden


def _build(seq_len: int, batch: int, input_size: int, hidden_size: int) -> Built:
    """``inputs == (input_seq, hidden)``: ``input_seq`` of shape ``(seq_len, batch, input_size)`` requires grad,
    the initial ``hidden`` of shape ``(batch, hidden_size)`` is zeros without grad. The forward draws random numbers,
    so seed torch's RNG before each call to compare runs.
    """
    model = LatentGRU(input_size, hidden_size)
    input_seq = torch.randn(seq_len, batch, input_size, requires_grad=True)
    hidden = torch.zeros(batch, hidden_size)
    description = (
        f"GRU-like cell with a sampled latent, unrolled in Python over {seq_len} steps "
        f"(B={batch}, H={hidden_size})"
    )
    return Built(model, (input_seq, hidden), description)


make = workload_maker("latent_gru", seed_report="003", shapes=_SHAPES, build=_build)
