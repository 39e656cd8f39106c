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

import argparse
import pathlib
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import memplan
from memplan.steps import step_fn
from memplan.testing import assert_equivalent


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes: runs in a few seconds")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for the HTML report")
    args = parser.parse_args()

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

    # The eager model: its peak predicted by analyze (over fake tensors) and measured on one training step,
    # loss.backward() with gradients starting from None.
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

    assert_equivalent(model, optimized, *inputs)  # raises if the loss or a gradient differs
    print("outputs and gradients match the eager model")

    out = args.out if args.out is not None else pathlib.Path(tempfile.mkdtemp(prefix="memplan-example-"))
    out.mkdir(parents=True, exist_ok=True)
    report = optimized.report(title="OpenNMT-style seq2seq (user report 004)")
    path = report.save_html(out / "004_seq2seq.html")
    print(f"report: {path}")


if __name__ == "__main__":
    main()
