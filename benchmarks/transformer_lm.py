"""A GPT-style language model written in plain PyTorch: eager, hand-placed checkpointing and memplan.

None of memplan's passes was written for this model: it is the model people try first. A decoder-only
transformer (token and position embeddings, pre-norm blocks of causal ``scaled_dot_product_attention`` and
a GELU MLP, a vocabulary head and cross-entropy), trained on random tokens. Side by side in one run:

* eager;
* the usual hand fix: every block wrapped in ``torch.utils.checkpoint`` (``use_reentrant=False``), so
  only the blocks' inputs are kept and each block runs again in the backward;
* ``memplan.optimize(model)`` with the default pipeline, and with ``--max-overheads`` other than 0.3.

Peaks are ``memplan.measure`` on ``memplan.steps.step_fn(model, inputs, train=True)``; times are medians of
interleaved steps, against eager's median in the same rounds. "plan s" is the first call's planning
(capture, passes, emitting the code). Every variant is checked for equal loss and gradients first.

Run ``python benchmarks/transformer_lm.py [--layers 4] [--width 256] [--heads 4] [--seq 256] [--batch 8]
[--vocab 5000] [--repeats 5] [--max-overheads 0.3 1.0] [--threads N]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import memplan
from memplan.bench import interleaved_medians
from memplan.measure import format_bytes, measure
from memplan.steps import step_fn
from memplan.testing import assert_equivalent

__all__ = ["LanguageModel", "main"]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP, each with a residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class LanguageModel(nn.Module):
    """Decoder-only transformer returning the mean cross-entropy of next-token targets.

    ``checkpointed=True`` wraps each block in ``torch.utils.checkpoint`` (the hand fix); the parameters
    and results are the same either way.
    """

    def __init__(self, vocab: int, width: int, heads: int, layers: int, seq: int, checkpointed: bool = False):
        super().__init__()
        self.checkpointed = checkpointed
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-overheads", type=float, nargs="+", default=[0.3])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = LanguageModel(args.vocab, args.width, args.heads, args.layers, args.seq).train()
    inputs = (torch.randint(0, args.vocab, (args.batch, args.seq)), torch.randint(0, args.vocab, (args.batch, args.seq)))
    hand = LanguageModel(args.vocab, args.width, args.heads, args.layers, args.seq, checkpointed=True)
    hand.load_state_dict(model.state_dict())
    candidates: list[tuple[str, nn.Module, float]] = [("eager", model, 0.0), ("checkpoint every block", hand, 0.0)]
    for max_overhead in args.max_overheads:
        opt = memplan.optimize(model, max_overhead=max_overhead)
        step_fn(opt, inputs, train=True)()  # first call: capture and plan
        candidates.append((f"memplan (max_overhead={max_overhead:g})", opt, opt.plan.plan_seconds))
    eager_step = step_fn(model, inputs, train=True)
    eager = measure(eager_step)
    rows = []
    for label, candidate, plan_seconds in candidates:
        if label != "eager":
            assert_equivalent(model, candidate, *inputs, rtol=1e-4, atol=1e-5)
        step = step_fn(candidate, inputs, train=True)
        step()
        peak = measure(step).peak
        seconds, reference = interleaved_medians([step, eager_step], args.repeats, torch.device("cpu"))
        rows.append({"model": label, "peak": peak, "peak_ratio": eager.peak / peak,
                     "time_ratio": seconds / reference, "plan_seconds": plan_seconds})
    print(f"{'model':32s} {'peak':>11} {'x lower':>8} {'time':>6} {'plan s':>7}")
    for r in rows:
        plan = f"{r['plan_seconds']:.1f}" if r["plan_seconds"] else "-"
        print(f"{r['model']:32s} {format_bytes(r['peak']):>11} {r['peak_ratio']:>7.2f}x {r['time_ratio']:>5.2f}x {plan:>7}")
    return rows


if __name__ == "__main__":
    main()
