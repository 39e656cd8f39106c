"""Attention written out by hand, against eager and the best hand-written version, ``F.scaled_dot_product_attention``.

Two attention blocks as models write them, none of them one of memplan's examples:

* ``gpt2``: one projection split into heads by ``view``/``transpose``, ``matmul`` products, a division
  by ``sqrt(d)``, a causal ``-inf`` mask built from constants, the heads merged and projected;
* ``einsum``: a research-code block with separate projections, the scale on ``q``, ``einsum``
  products and an additive padding mask given with the input;
* ``gpt2_dropout``: ``gpt2`` with dropout 0.1 on the attention probabilities (``F.dropout``, as GPT-2's
  ``attn_dropout``), in training.

For each: eager, ``memplan.optimize(model)`` (the default pipeline, ``max_overhead=0.3``), and the same
module with its scores, mask and softmax replaced by one ``F.scaled_dot_product_attention`` call (the
same parameters; ``is_causal=True`` for ``gpt2``, the mask as ``attn_mask`` for ``einsum``, ``dropout_p``
for ``gpt2_dropout``), checked equivalent first (not ``gpt2_dropout``'s: the fused kernel draws other
noise than ``F.dropout``; memplan's plan is checked against eager's draw). One training step each (:func:`memplan.steps.step_fn`): peaks by
:func:`memplan.measure` (deterministic on CPU; the fused kernel's per-thread block workspaces are not
counted), times as medians of interleaved blocks (:func:`memplan.bench.interleaved_medians`), one
thread by default.

Run ``python benchmarks/attention.py [--size small|default] [--repeats 10] [--threads 1] [--models gpt2 ...]``.
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import memplan
from memplan.bench import side_by_side
from memplan.measure import format_bytes
from memplan.testing import assert_equivalent

__all__ = ["MODELS", "SIZES", "GPT2Block", "EinsumBlock", "build", "main"]

SIZES = {
    "small": {"batch": 2, "tokens": 256, "width": 128, "heads": 4},
    "default": {"batch": 4, "tokens": 1024, "width": 256, "heads": 4},
}


class GPT2Block(nn.Module):
    """GPT-2's attention as written out; ``fused=True`` calls ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int, heads: int, fused: bool = False, dropout: float = 0.0):
        super().__init__()
        self.heads, self.fused, self.dropout = heads, fused, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(b, n, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.fused:
            p = self.dropout if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(width // self.heads)
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            probs = F.softmax(scores, dim=-1)
            if self.dropout:
                probs = F.dropout(probs, self.dropout, training=self.training)
            out = torch.matmul(probs, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, width))


class EinsumBlock(nn.Module):
    """Research-code attention: separate projections, the scale on ``q``, ``einsum``, an additive
    padding mask ``(B, 1, 1, n)``; ``fused=True`` calls ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int, heads: int, fused: bool = False):
        super().__init__()
        self.heads, self.fused = heads, fused
        self.q, self.k, self.v, self.out = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, width = x.shape
        q, k, v = (p(x).reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for p in (self.q, self.k, self.v))
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            q = q * q.shape[-1] ** -0.5
            scores = torch.einsum("bhnd,bhmd->bhnm", q, k) + mask
            out = torch.einsum("bhnm,bhmd->bhnd", scores.softmax(-1), v)
        return self.out(out.permute(0, 2, 1, 3).reshape(b, n, width))


MODELS = ("gpt2", "einsum", "gpt2_dropout")


def build(name: str, size: str, fused: bool = False, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model ``name`` (hand-written, or with ``fused`` attention) and its inputs, seeded."""
    s = SIZES[size]
    torch.manual_seed(seed)
    x = torch.randn(s["batch"], s["tokens"], s["width"], requires_grad=True)
    if name in ("gpt2", "gpt2_dropout"):
        return GPT2Block(s["width"], s["heads"], fused, dropout=0.1 if name == "gpt2_dropout" else 0.0), (x,)
    if name == "einsum":
        mask = torch.zeros(s["batch"], 1, 1, s["tokens"])
        mask[0, ..., s["tokens"] * 3 // 4:] = torch.finfo(torch.float32).min  # the first sequence is padded
        return EinsumBlock(s["width"], s["heads"], fused), (x, mask)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="default")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    print(f"{'model':8s} {'variant':8s} {'peak':>10s} {'lower':>7s} {'time':>9s} {'x eager':>8s} {'plan s':>7s}")
    for name in args.models:
        model, inputs = build(name, args.size)
        fused, _ = build(name, args.size, fused=True)
        fused.load_state_dict(model.state_dict())
        opt = memplan.optimize(model)
        if name != "gpt2_dropout":
            assert_equivalent(model, fused, *inputs)
        assert_equivalent(model, opt, *inputs)  # (plans on its first call)
        variants = {"eager": model, "memplan": opt, "sdpa": fused}
        peaks, times = side_by_side(variants, inputs, args.repeats)
        for label in variants:
            plan = f"{opt.plan.plan_seconds:7.1f}" if label == "memplan" else ""
            print(f"{name:8s} {label:8s} {format_bytes(peaks[label]):>10s} {peaks['eager'] / peaks[label]:6.2f}x "
                  f"{times[label] * 1e3:7.1f}ms {times[label] / times['eager']:7.2f}x {plan}", flush=True)
        print(f"{'':8s} memplan: {'; '.join(str(opt.plan).splitlines()[:3])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
