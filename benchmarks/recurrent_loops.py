"""Recurrent loops written by hand in Python, against eager and the user's usual fix, checkpointing.

Three cells, each unrolled over time in plain PyTorch the way research code writes them, none of them one
of memplan's examples:

* ``lstm``: two stacked ``nn.LSTMCell`` layers, the outputs of the top layer stacked;
* ``gru``: a GRU written out gate by gate (its own gate layout: reset applied after the hidden
  projection, one fused input projection), a mean-squared loss summed inside the loop;
* ``attention_rnn``: a decoder whose every step attends (dot-product, softmax) over encoder states and
  feeds the context back, as a sequence-to-sequence decoder does.

For each: eager, ``memplan.optimize(model)`` (the default, ``max_overhead=0.3``), and the model with
``torch.utils.checkpoint`` around every segment of ``round(sqrt(T))`` steps (``use_reentrant=False``),
the hand fix. Peaks by :func:`memplan.measure` of :func:`memplan.steps.step_fn` (deterministic), times
as medians of interleaved blocks (:func:`memplan.bench.interleaved_medians`), one thread by default.

Run ``python benchmarks/recurrent_loops.py [--size small|default] [--repeats 10] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

import memplan
from memplan.bench import side_by_side
from memplan.measure import format_bytes

__all__ = ["MODELS", "Checkpointed", "build", "main"]


class LSTMLoop(nn.Module):
    def __init__(self, inputs: int, hidden: int, layers: int = 2):
        super().__init__()
        self.cells = nn.ModuleList(nn.LSTMCell(inputs if i == 0 else hidden, hidden) for i in range(layers))
        self.hidden = hidden

    def initial(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x.new_zeros(x.shape[1], self.hidden) for _ in range(2 * len(self.cells))]

    def steps(self, xs: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = list(state)
        outs = []
        for x in xs:
            for i, cell in enumerate(self.cells):
                state[2 * i], state[2 * i + 1] = cell(x, (state[2 * i], state[2 * i + 1]))
                x = state[2 * i]
            outs.append(x)
        return (torch.stack(outs), *state)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        return self.steps(xs, *self.initial(xs))[0]


class GRULoop(nn.Module):
    """A GRU cell written gate by gate: one fused input projection, the reset gate applied after the
    hidden projection; the loss (squared error against a target) summed inside the loop."""

    def __init__(self, inputs: int, hidden: int):
        super().__init__()
        self.inp = nn.Linear(inputs, 3 * hidden)
        self.rec = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, inputs)
        self.hidden = hidden

    def initial(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x.new_zeros(x.shape[1], self.hidden), x.new_zeros(())]

    def steps(self, xs: torch.Tensor, h: torch.Tensor, loss: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for t in range(xs.shape[0] - 1):
            gx = self.inp(xs[t]).chunk(3, dim=-1)
            gh = self.rec(h).chunk(3, dim=-1)
            z = torch.sigmoid(gx[0] + gh[0])
            r = torch.sigmoid(gx[1] + gh[1])
            n = torch.tanh(gx[2] + r * gh[2])
            h = (1 - z) * n + z * h
            loss = loss + ((self.out(h) - xs[t + 1]) ** 2).mean()
        return h, loss

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        # the last step predicts nothing: steps() runs over the first T - 1
        return self.steps(xs, *self.initial(xs))[1]


class AttentionRNN(nn.Module):
    """A decoder that attends over encoder states at every step and feeds the context back."""

    def __init__(self, inputs: int, hidden: int):
        super().__init__()
        self.cell = nn.GRUCell(inputs + hidden, hidden)
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.out = nn.Linear(2 * hidden, inputs)
        self.hidden = hidden

    def initial(self, xs: torch.Tensor, memory: torch.Tensor) -> list[torch.Tensor]:
        return [xs.new_zeros(xs.shape[1], self.hidden), xs.new_zeros(xs.shape[1], self.hidden)]

    def steps(self, xs: torch.Tensor, memory: torch.Tensor, h: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = []
        for x in xs:
            h = self.cell(torch.cat([x, context], dim=-1), h)
            scores = torch.einsum("bh,bsh->bs", self.query(h), memory) / math.sqrt(self.hidden)
            context = torch.einsum("bs,bsh->bh", scores.softmax(-1), memory)
            outs.append(self.out(torch.cat([h, context], dim=-1)))
        return (torch.stack(outs), h, context)

    def forward(self, xs: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.steps(xs, memory, *self.initial(xs, memory))[0]


class Checkpointed(nn.Module):
    """``model`` with ``torch.utils.checkpoint`` around every ``segment`` steps: only the state between
    segments is kept for the backward, each segment run again in it (the hand fix)."""

    def __init__(self, model: nn.Module, segment: int):
        super().__init__()
        self.model, self.segment = model, segment

    def forward(self, xs: torch.Tensor, *context: torch.Tensor) -> torch.Tensor:
        state = self.model.initial(xs, *context)
        pieces = []
        for first in range(0, xs.shape[0], self.segment):
            # a GRULoop segment reads one step past its end (the next step's target)
            part = xs[first:first + self.segment + (1 if isinstance(self.model, GRULoop) else 0)]
            if part.shape[0] < 2 and isinstance(self.model, GRULoop):
                break
            result = checkpoint.checkpoint(self.model.steps, part, *context, *state, use_reentrant=False)
            if isinstance(self.model, GRULoop):
                state = list(result)
            else:
                pieces.append(result[0])
                state = list(result[1:])
        return state[1] if isinstance(self.model, GRULoop) else torch.cat(pieces)


SIZES = {"small": dict(steps=16, batch=4, inputs=16, hidden=32, memory=8),
         "test": dict(steps=48, batch=8, inputs=32, hidden=96, memory=16),
         "default": dict(steps=128, batch=16, inputs=64, hidden=256, memory=32)}


def build(name: str, size: str = "default", seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    s = SIZES[size]
    torch.manual_seed(seed)
    xs = torch.randn(s["steps"], s["batch"], s["inputs"])
    if name == "lstm":
        return LSTMLoop(s["inputs"], s["hidden"]), (xs,)
    if name == "gru":
        return GRULoop(s["inputs"], s["hidden"]), (xs,)
    if name == "attention_rnn":
        memory = torch.randn(s["batch"], s["memory"], s["hidden"])
        return AttentionRNN(s["inputs"], s["hidden"]), (xs, memory)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


MODELS = ("lstm", "gru", "attention_rnn")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="default")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    print(f"{'model':14s} {'variant':12s} {'peak':>10s} {'lower':>7s} {'time':>6s} {'plan s':>7s}")
    for name in MODELS:
        model, inputs = build(name, args.size)
        segment = max(1, round(math.sqrt(inputs[0].shape[0])))
        opt = memplan.optimize(model)
        variants = {"eager": model, "memplan": opt, f"ckpt {segment}": Checkpointed(model, segment)}
        peaks, times = side_by_side(variants, inputs, args.repeats)
        for label in variants:
            plan = f"{opt.plan.plan_seconds:7.1f}" if label == "memplan" else ""
            print(f"{name:14s} {label:12s} {format_bytes(peaks[label]):>10s} {peaks['eager'] / peaks[label]:6.2f}x "
                  f"{times[label] / times['eager']:6.2f} {plan}", flush=True)
        print(f"{'':14s} memplan predicted step time {1 + opt.plan.overhead:.2f}x eager's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
