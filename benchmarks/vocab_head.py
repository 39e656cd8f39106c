"""A language model's vocabulary head and its cross-entropy: eager, memplan and a hand-written chunked
linear cross-entropy, side by side.

The head is ``nn.Linear(hidden, vocab)`` and ``F.cross_entropy(..., ignore_index=-100)`` over ``tokens``
rows (a GPT-2-sized vocabulary by default). Variants, in one process, one training step each:

* ``eager``: the module as written (the logits, their log-softmax kept for the backward, a gradient of
  the logits' size in the backward);
* ``memplan``: ``memplan.optimize(model)``, the default pipeline and allowance (``max_overhead=0.3``).
  A head alone is all matrix products: the rewrite's one extra product is about a third more time, so
  under the default allowance the time model may leave the head to the chunk pass;
* ``memplan +50%``: the same with ``max_overhead=0.5``, which lets the head rewrite
  (``memplan.passes._rewrite.linear_ce``) in;
* ``hand``: :class:`ChunkedLinearCrossEntropy` below, the best hand-written version: Liger's fused
  linear cross-entropy (chunks of tokens, each chunk's gradients computed in the forward: three matrix
  products, no recomputation, but a backward that only scales saved gradients), with as many chunks
  as the ``memplan +50%`` plan has, so both hold chunks of logits of one size (Liger's own rule, a
  chunk no larger than ``h``, makes hundreds of chunks of a few tokens for a wide vocabulary, which a
  CPU runs slowly).

Peaks by :func:`memplan.measure` of :func:`memplan.steps.step_fn` (deterministic on CPU), times as
medians of interleaved blocks (:func:`memplan.bench.interleaved_medians`) over eager's.

``--gpt2`` adds Hugging Face's ``GPT2LMHeadModel`` (tiny: 2 layers, width 64; the full 50257-word
vocabulary, sequence 256, batch 4; its own loss on next tokens, only ``.loss`` returned): eager, memplan's
default pipeline without the head rewrite (the rewrite pass as it was before it) and with it, and the
head's share of memplan's predicted peak in each: the bytes alive at the peak made on the head's and the
loss's source lines, the weight's gradient aside (:func:`memplan.analysis.explain.explain_peak`).

Run ``python benchmarks/vocab_head.py [--size small|default] [--repeats 5] [--threads 1] [--gpt2]``.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

import memplan
import memplan.passes.rewrite as rewrite_pass
from memplan.analysis.explain import explain_peak
from memplan.bench import side_by_side
from memplan.capture import capture
from memplan.measure import format_bytes
from memplan.passes._rewrite.linear_ce import LinearCrossEntropy, find_linear_cross_entropy
from memplan.testing import assert_equivalent

__all__ = ["VocabHead", "HandWrittenHead", "ChunkedLinearCrossEntropy", "SIZES", "main"]

SIZES = {"small": dict(tokens=256, hidden=64, vocab=4000), "default": dict(tokens=1024, hidden=384, vocab=50257)}


class VocabHead(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.head = nn.Linear(hidden, vocab)

    def forward(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(h), targets, ignore_index=-100)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Liger's fused linear cross-entropy: per chunk of tokens, the logits, the loss and, already in the
    forward, the gradients of ``h``, ``W`` and ``b`` (softmax minus one-hot, over the valid tokens); the
    backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        valid = targets != -100
        count = valid.sum()
        loss = h.new_zeros(())
        grad_h, grad_w, grad_b = torch.empty_like(h), torch.zeros_like(weight), torch.zeros_like(bias)
        for start in range(0, h.shape[0], chunk):
            rows, t, ok = h[start:start + chunk], targets[start:start + chunk], valid[start:start + chunk]
            logits = torch.addmm(bias, rows, weight.t())
            lse = torch.logsumexp(logits, 1)
            safe = torch.where(ok, t, 0)
            loss += ((lse - logits.gather(1, safe[:, None])[:, 0]) * ok).sum()
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits' buffer
            grad.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
            grad.mul_((ok / count)[:, None])
            grad_h[start:start + chunk] = grad @ weight
            grad_w.addmm_(grad.t(), rows)
            grad_b += grad.sum(0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return loss / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad_h, grad_w, grad_b = ctx.saved_tensors
        return grad_h * grad, grad_w * grad, grad_b * grad, None, None


class HandWrittenHead(nn.Module):
    """``model``'s head through :class:`ChunkedLinearCrossEntropy` (the same parameters)."""

    def __init__(self, model: VocabHead, chunk: int):
        super().__init__()
        self.model, self.chunk = model, chunk

    def forward(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        head = self.model.head
        return ChunkedLinearCrossEntropy.apply(h, head.weight, head.bias, targets, self.chunk)


def build(size: str, seed: int = 0) -> tuple[VocabHead, tuple[torch.Tensor, torch.Tensor]]:
    s = SIZES[size]
    torch.manual_seed(seed)
    targets = torch.randint(0, s["vocab"], (s["tokens"],))
    targets[:: 16] = -100  # some padding
    return VocabHead(s["hidden"], s["vocab"]), (torch.randn(s["tokens"], s["hidden"], requires_grad=True), targets)


def _chunks(opt: Any) -> int | None:
    """The chunk count of the head rewrite in ``opt``'s plan (None: not rewritten)."""
    for record in opt.plan.records:
        for pattern in getattr(record.plan, "rewrites", ()):
            if isinstance(pattern, LinearCrossEntropy):
                return pattern.chunks
    return None


def _chosen(opt: Any) -> str:
    """What the plan did to the head: the rewrite's note, else the passes that changed the graph."""
    for record in opt.plan.records:
        for note in record.notes:
            if note.startswith("linear cross-entropy"):
                return note.split(": ", 1)[1]
    changed = [r.name for r in opt.plan.records if r.changed]
    return "head not rewritten; changed by " + (", ".join(changed) or "no pass")


def head_benchmark(size: str, repeats: int) -> None:
    model, inputs = build(size)
    s = SIZES[size]
    variants: dict[str, nn.Module] = {
        "eager": model,
        "memplan": memplan.optimize(model),
        "memplan +50%": memplan.optimize(model, max_overhead=0.5),
    }
    for label in ("memplan", "memplan +50%"):
        assert_equivalent(model, variants[label], *inputs)
    chunks = _chunks(variants["memplan +50%"]) or 8
    hand_chunk = -(-s["tokens"] // chunks)
    variants["hand"] = HandWrittenHead(model, chunk=hand_chunk)
    assert_equivalent(model, variants["hand"], *inputs)
    peaks, times = side_by_side(variants, inputs, repeats)
    logits = s["tokens"] * s["vocab"] * 4
    print(f"head: {s['tokens']} tokens, hidden {s['hidden']}, vocab {s['vocab']} (logits {format_bytes(logits)}), "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'variant':14s} {'peak':>11s} {'lower':>7s} {'time':>6s}  notes")
    for label in variants:
        note = ""
        if label.startswith("memplan"):
            plan = variants[label].plan
            note = (f"predicted {format_bytes(plan.planned_peak)}, +{plan.overhead:.0%} time; {_chosen(variants[label])}")
        elif label == "hand":
            note = f"{chunks} chunks of {hand_chunk} tokens"
        print(f"{label:14s} {format_bytes(peaks[label]):>11s} {peaks['eager'] / peaks[label]:6.2f}x "
              f"{times[label] / times['eager']:6.2f}  {note}", flush=True)


@contextlib.contextmanager
def without_head_rewrite() -> Iterator[None]:
    """The rewrite pass as it was before the head rewrite: its finder left out of the pass's finders."""
    finders = rewrite_pass._FINDERS
    rewrite_pass._FINDERS = tuple(f for f in finders if f is not find_linear_cross_entropy)
    try:
        yield
    finally:
        rewrite_pass._FINDERS = finders


class _Loss(nn.Module):
    """A Hugging Face causal LM on its own labels; only the loss leaves (the logits are dropped)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def head_share(graph: Any, lines: set[Any]) -> int:
    """Bytes alive at the predicted peak made on ``lines`` (the head's and the loss's), parameter
    gradients aside."""
    explanation = explain_peak(graph, top=1 << 30, groups=False)
    return sum(t.nbytes for t in explanation.tensors if t.source in lines and t.kind != "parameter gradients")


def gpt2_benchmark(repeats: int) -> None:
    try:
        import transformers
    except ImportError:
        print("gpt2: transformers is not installed; skipped")
        return
    transformers.logging.set_verbosity_error()
    vocab, seq, batch = 50257, 256, 4
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=vocab, n_positions=seq,
                                     use_cache=False, attn_implementation="sdpa")
    model = _Loss(transformers.GPT2LMHeadModel(config).train())
    ids = torch.randint(0, vocab, (batch, seq))
    graph = capture(model, ids)
    heads = find_linear_cross_entropy(graph)
    lines = {graph.sources.get(n) for h in heads for n in (h.product, h.log_softmax)} - {None}
    variants: dict[str, nn.Module] = {"eager": model}
    seconds = {}
    for label in ("memplan before", "memplan after"):
        start = time.perf_counter()
        with without_head_rewrite() if label == "memplan before" else contextlib.nullcontext():
            opt = memplan.optimize(model)
            opt(ids)
        seconds[label] = time.perf_counter() - start
        variants[label] = opt
    for label in ("memplan before", "memplan after"):
        assert_equivalent(model, variants[label], ids)
    peaks, times = side_by_side(variants, (ids,), repeats)
    print(f"\ngpt2: GPT2LMHeadModel, 2 layers, width 64, vocab {vocab}, sequence {seq}, batch {batch}; "
          f"{'found' if heads else 'no'} head pattern ({', '.join(str(h) for h in heads) or '-'})")
    print(f"{'variant':16s} {'peak':>11s} {'lower':>7s} {'time':>6s} {'predicted':>11s} {'head share':>18s}  plan s")
    for label in variants:
        if label == "eager":
            print(f"{label:16s} {format_bytes(peaks[label]):>11s} {1.0:6.2f}x {1.0:6.2f}")
            continue
        plan = variants[label].plan
        share = head_share(plan.graph, lines)
        print(f"{label:16s} {format_bytes(peaks[label]):>11s} {peaks['eager'] / peaks[label]:6.2f}x "
              f"{times[label] / times['eager']:6.2f} {format_bytes(plan.planned_peak):>11s} "
              f"{format_bytes(share):>10s} ({share / plan.planned_peak:4.0%})  {seconds[label]:5.1f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="default")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gpt2", action="store_true", help="also Hugging Face's GPT-2 (tiny, full vocabulary)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    head_benchmark(args.size, args.repeats)
    if args.gpt2:
        gpt2_benchmark(args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
