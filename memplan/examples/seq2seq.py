"""An OpenNMT-style attentional sequence-to-sequence model with Python-unrolled LSTM cells (user report 004).

The report describes how OpenNMT trains its RNN encoder-decoder: an encoder LSTM over the source, a *bridge* that
maps the final encoder state to the decoder's initial state, a decoder LSTM over the target, and a *generator*
(a linear layer to the vocabulary plus ``log_softmax``) applied to every decoder output. This model follows that
layout: embeddings, stacked ``nn.LSTMCell``s stepped in a Python loop for both encoder and decoder, a Linear+tanh
bridge, Luong dot attention over the encoder outputs with input feeding, and the NLL loss of the next target token
computed inside ``forward``. Tensors are time-major, ``(length, batch)``, as in OpenNMT.

What blows up memory, and why: unrolling keeps every time step's gate activations, cell states and attention
weights alive for the backward pass (the report's "clones", whose intermediate buffers it shares across time
steps by hand), and the generator produces ``(tgt_len - 1) * batch * vocab`` logits whose ``log_softmax`` is saved
too: 627 MB each in float32 at the ``full`` size (batch 64, length 50, vocabulary 50000), plus gradients of the same
size in the backward pass. OpenNMT-py later split the generator and loss into shards for this reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memplan.examples._workload import Built, workload_maker

__all__ = ["Seq2Seq", "make"]

# Keyword arguments of _build per size; "full" is OpenNMT's defaults: batch 64, vocabulary 50000, embeddings 500
# and 2 layers of 500, with sentences of 50 tokens.
_SHAPES: dict[str, dict[str, int]] = {
    "small": {"batch": 16, "src_len": 20, "tgt_len": 20, "vocab": 2000, "emb": 64, "hidden": 128, "layers": 1},
    "full": {"batch": 64, "src_len": 50, "tgt_len": 50, "vocab": 50000, "emb": 500, "hidden": 500, "layers": 2},
}


class Seq2Seq(nn.Module):
    """Encoder-decoder LSTM with a bridge, dot attention, input feeding and a log-softmax generator.

    Parameters
    ----------
    src_vocab, tgt_vocab : int
        Vocabulary sizes.
    emb_size : int
        Word embedding size.
    hidden_size : int
        LSTM state size, shared by encoder and decoder.
    num_layers : int
        Number of stacked LSTM cells in the encoder and in the decoder.
    """

    def __init__(self, src_vocab: int, tgt_vocab: int, emb_size: int, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.src_embedding = nn.Embedding(src_vocab, emb_size)
        self.tgt_embedding = nn.Embedding(tgt_vocab, emb_size)

        encoder_cells = []
        decoder_cells = []
        for layer in range(num_layers):
            encoder_in = emb_size if layer == 0 else hidden_size
            decoder_in = emb_size + hidden_size if layer == 0 else hidden_size  # input feeding on the first layer
            encoder_cells.append(nn.LSTMCell(encoder_in, hidden_size))
            decoder_cells.append(nn.LSTMCell(decoder_in, hidden_size))
        self.encoder = nn.ModuleList(encoder_cells)
        self.decoder = nn.ModuleList(decoder_cells)

        # The bridge sees the states of all layers at once, as OpenNMT's does.
        state_size = num_layers * hidden_size
        self.bridge_h = nn.Linear(state_size, state_size)
        self.bridge_c = nn.Linear(state_size, state_size)

        self.attention_out = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.generator = nn.Linear(hidden_size, tgt_vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """Return the mean NLL of ``tgt[1:]`` given ``src`` ``(src_len, batch)`` and ``tgt[:-1]``.

        ``tgt`` has shape ``(tgt_len, batch)``; the decoder reads ``tgt[:-1]`` and predicts ``tgt[1:]``.
        """
        memory_bank, final_h, final_c = self._encode(src)
        h, c = self._bridge(final_h, final_c)
        decoder_out = self._decode(tgt[:-1], memory_bank, h, c)  # (tgt_len - 1, batch, hidden)

        log_probs = F.log_softmax(self.generator(decoder_out), dim=-1)
        vocab = log_probs.shape[-1]
        return F.nll_loss(log_probs.reshape(-1, vocab), tgt[1:].reshape(-1))

    def _encode(
        self, src: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Run the encoder; return the top-layer outputs ``(batch, src_len, hidden)`` and the final states."""
        embedded = self.src_embedding(src)  # (src_len, batch, emb)
        batch = src.shape[1]
        h = [embedded.new_zeros(batch, self.hidden_size) for _ in range(self.num_layers)]
        c = [embedded.new_zeros(batch, self.hidden_size) for _ in range(self.num_layers)]
        outputs = []
        for x in embedded.unbind(0):
            for layer, cell in enumerate(self.encoder):
                h[layer], c[layer] = cell(x, (h[layer], c[layer]))
                x = h[layer]
            outputs.append(x)
        return torch.stack(outputs, dim=1), h, c

    def _bridge(
        self, h: list[torch.Tensor], c: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Map the final encoder states of all layers to the decoder's initial states."""
        new_h = torch.tanh(self.bridge_h(torch.cat(h, dim=1)))
        new_c = torch.tanh(self.bridge_c(torch.cat(c, dim=1)))
        return list(new_h.chunk(self.num_layers, dim=1)), list(new_c.chunk(self.num_layers, dim=1))

    def _decode(
        self,
        tgt_in: torch.Tensor,
        memory_bank: torch.Tensor,
        h: list[torch.Tensor],
        c: list[torch.Tensor],
    ) -> torch.Tensor:
        """Run the decoder with attention and input feeding; return the attentional outputs."""
        embedded = self.tgt_embedding(tgt_in)  # (tgt_len - 1, batch, emb)
        batch = tgt_in.shape[1]
        feed = embedded.new_zeros(batch, self.hidden_size)  # previous attentional output
        outputs = []
        for y in embedded.unbind(0):
            x = torch.cat([y, feed], dim=1)
            for layer, cell in enumerate(self.decoder):
                h[layer], c[layer] = cell(x, (h[layer], c[layer]))
                x = h[layer]
            scores = torch.bmm(memory_bank, x.unsqueeze(2)).squeeze(2)  # (batch, src_len)
            weights = torch.softmax(scores, dim=1)
            context = torch.bmm(weights.unsqueeze(1), memory_bank).squeeze(1)  # (batch, hidden)
            feed = torch.tanh(self.attention_out(torch.cat([context, x], dim=1)))
            outputs.append(feed)
        return torch.stack(outputs)


def _build(batch: int, src_len: int, tgt_len: int, vocab: int, emb: int, hidden: int, layers: int) -> Built:
    """``inputs == (src, tgt)``, int64 token ids of shapes ``(src_len, batch)`` and ``(tgt_len, batch)``.
    The model returns the scalar loss.
    """
    model = Seq2Seq(vocab, vocab, emb, hidden, layers)
    src = torch.randint(0, vocab, (src_len, batch))
    tgt = torch.randint(0, vocab, (tgt_len, batch))
    description = (
        f"OpenNMT-style LSTM seq2seq with attention, {layers}x{hidden}, vocabulary {vocab}, "
        f"batch {batch}, lengths {src_len}/{tgt_len}, loss inside forward"
    )
    return Built(model, (src, tgt), description)


make = workload_maker("seq2seq", seed_report="004", shapes=_SHAPES, build=_build)
