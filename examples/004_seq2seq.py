"""An OpenNMT-style attentional sequence-to-sequence model with LSTM cells stepped in Python (user report 004).

The layout is OpenNMT's: an encoder LSTM over the source, a bridge that maps the final encoder state to the
decoder's initial state, a decoder LSTM with dot attention over the encoder outputs and input feeding, and a
generator (a linear layer to the vocabulary, then ``log_softmax``) applied to every decoder output, with the loss
computed inside ``forward``. Unrolling keeps every time step's gates, cell states and attention weights for the
backward (OpenNMT shared their buffers across time steps by hand), and the generator's logits and their
``log_softmax``, ``(tgt_len - 1) * batch * vocab`` numbers each, are the largest tensors of the step. From the
model as written, memplan computes the generator and its loss a few time steps at a time, recomputes cheap
tensors in the backward instead of keeping them, and writes others in place; the plan it prints says which.

    python examples/004_seq2seq.py              # default size
    python examples/004_seq2seq.py --small      # a few seconds
    python examples/004_seq2seq.py --out DIR    # where the HTML report goes (default: a new temporary folder)
"""


import torch
import torch.nn.functional as F
from torch import nn

from _compare import compare, parse_args


class Seq2Seq(nn.Module):
    """Encoder-decoder LSTM with a bridge, dot attention, input feeding and a log-softmax generator."""

    def __init__(self, vocab, emb_size, hidden_size, num_layers):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.src_embedding = nn.Embedding(vocab, emb_size)
        self.tgt_embedding = nn.Embedding(vocab, emb_size)
        self.encoder = nn.ModuleList(
            nn.LSTMCell(emb_size if layer == 0 else hidden_size, hidden_size) for layer in range(num_layers)
        )
        # input feeding: the first decoder layer also reads the previous attentional output
        self.decoder = nn.ModuleList(
            nn.LSTMCell(emb_size + hidden_size if layer == 0 else hidden_size, hidden_size)
            for layer in range(num_layers)
        )
        self.bridge_h = nn.Linear(num_layers * hidden_size, num_layers * hidden_size)
        self.bridge_c = nn.Linear(num_layers * hidden_size, num_layers * hidden_size)
        self.attention_out = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.generator = nn.Linear(hidden_size, vocab)

    def forward(self, src, tgt):
        """Mean NLL of ``tgt[1:]`` given ``src`` and ``tgt[:-1]``; both ``(length, batch)`` token ids."""
        memory_bank, h, c = self.encode(src)
        h, c = self.bridge(h, c)
        decoder_out = self.decode(tgt[:-1], memory_bank, h, c)  # (tgt_len - 1, batch, hidden)
        log_probs = F.log_softmax(self.generator(decoder_out), dim=-1)
        return F.nll_loss(log_probs.reshape(-1, log_probs.shape[-1]), tgt[1:].reshape(-1))

    def encode(self, src):
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
        return torch.stack(outputs, dim=1), h, c  # memory bank: (batch, src_len, hidden)

    def bridge(self, h, c):
        new_h = torch.tanh(self.bridge_h(torch.cat(h, dim=1)))
        new_c = torch.tanh(self.bridge_c(torch.cat(c, dim=1)))
        return list(new_h.chunk(self.num_layers, dim=1)), list(new_c.chunk(self.num_layers, dim=1))

    def decode(self, tgt_in, memory_bank, h, c):
        embedded = self.tgt_embedding(tgt_in)
        feed = embedded.new_zeros(tgt_in.shape[1], self.hidden_size)  # the previous attentional output
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


def main():
    args = parse_args(__doc__)

    # OpenNMT's defaults are batch 64, vocabulary 50000, embeddings 500 and 2 layers of 500; here smaller.
    if args.small:
        batch, length, vocab, emb_size, hidden_size, num_layers = 2, 4, 50, 8, 8, 1
    else:
        batch, length, vocab, emb_size, hidden_size, num_layers = 32, 16, 8000, 128, 256, 1
    torch.manual_seed(0)
    model = Seq2Seq(vocab, emb_size, hidden_size, num_layers)
    src = torch.randint(0, vocab, (length, batch))
    tgt = torch.randint(0, vocab, (length, batch))
    inputs = (src, tgt)
    print(f"seq2seq {num_layers}x{hidden_size}, vocabulary {vocab}, batch {batch}, sentences of {length} tokens")

    compare(model, inputs, title="OpenNMT-style seq2seq (user report 004)", name="004_seq2seq", out=args.out)


if __name__ == "__main__":
    main()
