"""Log-space chain product of many matrices, multiplied pairwise as a tree (user report 000).

The report computes ``p_0 D_0 P_1 D_1 ... D_{v-2} P_{v-1} x_{v-1}`` for a batch of inputs, where each ``D_i`` is
the diagonal matrix of the values ``x_i`` and each ``P_i`` is a learned ``c x c`` matrix of conditional
probabilities. For numerical stability everything stays in log space: ``B_i = D_{i-1} P_i`` becomes
``x_{i-1}[:, None] + log P_i``, and two neighbouring blocks are multiplied by subtracting a max, taking ``exp``,
clamping, calling ``@`` and taking ``log`` again. The blocks are paired up level after level until a single
``c x c`` block remains; a level with an odd number of blocks is padded with a block of zeros, as in the report.
In probability space that block is a matrix of ones rather than the identity, so padding changes the value; it is
kept as reported (when ``v - 1`` is a power of two no padding happens and the result is the exact chain product).

What blows up memory, and why: every block is ``(n, t, c, c)`` for a batch of ``n``, so the first level already
holds ``n * (v-1) * c * c`` numbers (3.1 GB in float32 at the report's ``n, v, c = 500, 40, 200``), and each level
creates several tensors of its size (``exp``, ``clamp``, the matmul result, ``log``) which autograd saves for the
backward pass. In the report the forward alone ran out of memory on a shared 10.75 GB GPU, asking for another
1.57 GB with 3.2 GB already allocated; a training step at that size peaks near 18 GB.
"""

from __future__ import annotations

import torch
from torch import nn

from memplan.examples._workload import Built, workload_maker

__all__ = ["ChainProduct", "make"]

# Keyword arguments of _build per size: the batch n, chains t, variables v and states c of the report, whose own
# sizes are "full".
_SHAPES: dict[str, dict[str, int]] = {
    "small": {"n": 64, "t": 1, "v": 16, "c": 48},
    "full": {"n": 500, "t": 1, "v": 40, "c": 200},
}


class ChainProduct(nn.Module):
    """Batched ``p_0 D_0 P_1 ... P_{v-1} x_{v-1}`` computed in log space by pairwise (tree) multiplication.

    Parameters
    ----------
    num_steps : int
        ``t``, the number of independent chains per example (1 in the report).
    num_variables : int
        ``v``, the number of variables ``x_i``; there are ``v - 1`` transition matrices.
    num_states : int
        ``c``, the size of each transition matrix.
    eps : float
        Lower clamp of the exponentiated blocks, and the offset that keeps the logarithms of the parameters
        finite.

    Attributes
    ----------
    bulk : torch.nn.Parameter
        ``(1, t, v-1, c, c)`` transition matrices ``P_i``; used through ``log(|bulk| + eps)`` so they stay
        positive.
    p0 : torch.nn.Parameter
        ``(1, t, c)`` initial distribution, used through ``log(|p0| + eps)``.
    """

    def __init__(self, num_steps: int, num_variables: int, num_states: int, eps: float = 1e-10) -> None:
        super().__init__()
        if num_variables < 2:
            raise ValueError(f"need at least 2 variables, got {num_variables}")
        self.eps = eps
        self.bulk = nn.Parameter(torch.rand(1, num_steps, num_variables - 1, num_states, num_states))
        self.p0 = nn.Parameter(torch.rand(1, num_steps, num_states))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the ``(n, t)`` log of the chain product for log-values ``x`` of shape ``(n, t, v, c)``."""
        x_first = x[..., :-1, :, None]  # (n, t, v-1, c, 1): the diagonals of D_0 .. D_{v-2}
        x_last = x[..., -1, None, :]  # (n, t, 1, c): the final vector x_{v-1}
        log_bulk = torch.log(self.bulk.abs() + self.eps)
        middle = x_first + log_bulk  # (n, t, v-1, c, c): log B_i
        while middle.shape[-3] > 1:
            middle = self._multiply_pairs(middle)
        chain = torch.logsumexp(middle.squeeze(-3) + x_last, dim=-1)  # (n, t, c)
        log_p0 = torch.log(self.p0.abs() + self.eps)
        return torch.logsumexp(log_p0 + chain, dim=-1)

    def _multiply_pairs(self, stack: torch.Tensor) -> torch.Tensor:
        """Multiply blocks ``2k`` and ``2k+1`` of ``stack`` (log space) along dimension ``-3``."""
        if stack.shape[-3] % 2 == 1:
            pad_shape = stack.shape[:-3] + (1,) + stack.shape[-2:]
            stack = torch.cat([stack, stack.new_zeros(pad_shape)], dim=-3)
        left = stack[..., 0::2, :, :]
        right = stack[..., 1::2, :, :]

        left_max = torch.max(left, dim=-1, keepdim=True).values  # max over each row
        right_max = torch.max(right, dim=-2, keepdim=True).values  # max over each column

        left = torch.clamp(torch.exp(left - left_max), min=self.eps)
        right = torch.clamp(torch.exp(right - right_max), min=self.eps)

        product = torch.log(left @ right)
        return left_max + right_max + product


def _build(n: int, t: int, v: int, c: int) -> Built:
    """``inputs == (x,)`` with ``x`` of shape ``(n, t, v, c)``, the log-values of the diagonals (data, no grad)."""
    model = ChainProduct(t, v, c)
    x = torch.randn(n, t, v, c) - 2.0
    description = f"log-space pairwise tree product of {v - 1} ({c}x{c}) matrices for a batch of {n}"
    return Built(model, (x,), description)


make = workload_maker("chain_product", seed_report="000", shapes=_SHAPES, build=_build)
