"""The best hand-written fix of each example workload, to compare memplan with.

Each baseline wraps the example's own module (same parameters, same outputs and gradients) and is what a
careful user writes after reading the user report's thread:

* ``broadcast_matmul`` (report 001): ``einsum`` with the head dimension as the batch of one ``bmm``
  (the fix the report's thread arrives at).
* ``maxsim`` (report 002): a loop over chunks of ``a``'s sequences, each chunk checkpointed
  (the thread's "checkpoint before einsum, then einsum per chunk" proposal).
* ``chain_product`` (report 000): the batch split into chunks, each chunk's tree product checkpointed
  (micro-batching with recomputation).
* ``latent_gru`` (report 003): every ``k`` time steps wrapped in ``torch.utils.checkpoint``, ``k`` about
  the square root of the sequence length (the usual hand-placed checkpointing of an unrolled RNN).
* ``seq2seq`` (report 004): the generator and loss run over shards of time steps, each shard checkpointed
  (OpenNMT-py's ``max_generator_batches``).

Every checkpoint uses ``use_reentrant=False``. ``memplan bench`` runs them beside eager and memplan;
``benchmarks/hand_written.py`` and ``benchmarks/checkpoint_baselines.py`` vary their parameters.

Examples
--------
>>> import memplan.examples as examples
>>> w = examples.make("maxsim")
>>> hand = hand_written("maxsim", w.model)
>>> torch.allclose(hand(*w.inputs), w.model(*w.inputs), atol=1e-5)
True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "BASELINES",
    "CheckpointedLatentGRU",
    "ChunkedChainProduct",
    "ChunkedMaxSim",
    "EinsumHeadMatmul",
    "ShardedGeneratorSeq2Seq",
    "hand_written",
]


class EinsumHeadMatmul(nn.Module):
    """Report 001, hand-written: ``einsum('bhd,hde->bhe')``, one bmm over heads, no copy of ``W``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        out = torch.einsum("bhd,hde->bhe", x.view(x.shape[0], m.heads, m.dim), m.W)
        return out.reshape(x.shape[0], m.heads * m.dim)


class ChunkedMaxSim(nn.Module):
    """Report 002, hand-written: ``a``'s sequences in chunks of ``chunk``, each chunk checkpointed."""

    def __init__(self, model: nn.Module, chunk: int = 1):
        super().__init__()
        self.model = model
        self.chunk = chunk

    @staticmethod
    def _scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ijk,mnk->ijmn", a, b).max(dim=-1).values.sum(dim=1)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        parts = [checkpoint(self._scores, a[i : i + self.chunk], b, use_reentrant=False) for i in range(0, a.shape[0], self.chunk)]
        return self.model.scale * torch.cat(parts)


class ChunkedChainProduct(nn.Module):
    """Report 000, hand-written: the batch in chunks of ``chunk``, each chunk's product checkpointed."""

    def __init__(self, model: nn.Module, chunk: int = 2):
        super().__init__()
        self.model = model
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [checkpoint(self.model, x[i : i + self.chunk], use_reentrant=False) for i in range(0, x.shape[0], self.chunk)]
        return torch.cat(parts)


class ShardedGeneratorSeq2Seq(nn.Module):
    """Report 004, hand-written: the generator and NLL over shards of ``shard`` time steps, each
    checkpointed; the shards' summed losses are divided by the number of target tokens (the NLL mean)."""

    def __init__(self, model: nn.Module, shard: int = 4):
        super().__init__()
        self.model = model
        self.shard = shard

    def _loss_sum(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_probs = F.log_softmax(self.model.generator(out), dim=-1)
        return F.nll_loss(log_probs.reshape(-1, log_probs.shape[-1]), target.reshape(-1), reduction="sum")

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        m = self.model
        memory_bank, final_h, final_c = m._encode(src)
        h, c = m._bridge(final_h, final_c)
        decoder_out = m._decode(tgt[:-1], memory_bank, h, c)
        target = tgt[1:]
        total = sum(
            checkpoint(self._loss_sum, decoder_out[t : t + self.shard], target[t : t + self.shard], use_reentrant=False)
            for t in range(0, decoder_out.shape[0], self.shard)
        )
        return total / target.numel()


def _gru_step(model: nn.Module, hidden: torch.Tensor, x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """One step of :class:`~memplan.examples.latent_gru.LatentGRU`, op for op (its loop body is inline)."""
    stats = torch.mm(hidden, model.W_enc)
    mean, log_var = stats.chunk(2, dim=1)
    latent = mean + eps * torch.exp(0.5 * log_var)
    x_gates = torch.mm(x, model.W_ih)
    z_gates = torch.mm(latent, model.W_zh)
    x_reset, x_update, x_new = x_gates.chunk(3, dim=1)
    z_reset, z_update, z_new = z_gates.chunk(3, dim=1)
    update = torch.sigmoid(x_update + z_update)
    reset = torch.sigmoid(x_reset + z_reset)
    candidate = torch.tanh(x_new + reset * z_new)
    return candidate + update * (hidden - candidate)


class CheckpointedLatentGRU(nn.Module):
    """Report 003, hand-written: every ``segment`` steps of the latent GRU wrapped in ``checkpoint``.

    ``segment=None`` takes the square root of the sequence length, rounded (the classic choice: about
    ``2 sqrt(T)`` states alive). The noise is drawn once before the loop, as the original draws it, so both
    consume the RNG alike; the checkpointed segments read it, never redraw it.
    """

    def __init__(self, model: nn.Module, segment: int | None = None):
        super().__init__()
        self.model = model
        self.segment = segment

    def _segment(self, hidden: torch.Tensor, xs: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = []
        for x, eps in zip(xs.unbind(0), noise.unbind(0)):
            hidden = _gru_step(self.model, hidden, x, eps)
            outputs.append(hidden)
        return torch.stack(outputs), hidden

    def forward(self, input_seq: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq_len, batch, _ = input_seq.shape
        segment = self.segment or max(1, round(math.sqrt(seq_len)))
        noise = torch.randn(seq_len, batch, self.model.hidden_size, device=input_seq.device, dtype=input_seq.dtype)
        outputs = []
        for first in range(0, seq_len, segment):
            last = min(first + segment, seq_len)
            out, hidden = checkpoint(self._segment, hidden, input_seq[first:last], noise[first:last], use_reentrant=False)
            outputs.append(out)
        return torch.cat(outputs), hidden


#: Workload name -> (what the baseline does, in a few words; its class).
BASELINES: dict[str, tuple[str, Callable[[nn.Module], nn.Module]]] = {
    "chain_product": ("batch chunks, each checkpointed", ChunkedChainProduct),
    "broadcast_matmul": ("einsum with heads as the bmm batch", EinsumHeadMatmul),
    "maxsim": ("chunks of a, each checkpointed", ChunkedMaxSim),
    "latent_gru": ("checkpoint every sqrt(T) steps", CheckpointedLatentGRU),
    "seq2seq": ("generator + loss in checkpointed time shards", ShardedGeneratorSeq2Seq),
}


def hand_written(name: str, model: nn.Module, **kwargs) -> nn.Module:
    """The hand-written version of workload ``name`` around ``model`` (same parameters).

    ``kwargs`` go to the baseline's constructor (``chunk=``, ``segment=``, ``shard=``).
    """
    if name not in BASELINES:
        raise KeyError(f"no hand-written baseline for {name!r}; there are: {', '.join(BASELINES)}")
    return BASELINES[name][1](model, **kwargs)

