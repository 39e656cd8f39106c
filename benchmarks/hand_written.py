"""The best hand-written versions of the workloads, side by side with eager and memplan.

Each hand-written model wraps the example's own module (same parameters, same outputs and
gradients) and is what a careful user would write after reading the user report's thread:

* ``broadcast_matmul`` (report 001): ``einsum`` with the head dimension as the batch of one ``bmm``
  (the fix the report's thread arrives at).
* ``maxsim`` (report 002): a loop over chunks of ``a``'s sequences, each chunk checkpointed
  (the thread's "checkpoint before einsum, then einsum per chunk" proposal).
* ``chain_product`` (report 000): the batch split into chunks, each chunk's tree product
  checkpointed (micro-batching with recomputation).
* ``seq2seq`` (report 004): the generator and loss run over shards of time steps, each shard
  checkpointed (OpenNMT-py's ``max_generator_batches``).

Run ``python benchmarks/hand_written.py [workload ...] [--size small|full] [--repeats N]`` to print
peak bytes (``memplan.measure`` on ``memplan.steps.step_fn(model, inputs, train=True)``) and step
times of eager, hand-written and ``memplan.optimize(model, passes=...)``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import memplan
import memplan.examples as examples
from memplan.measure import format_bytes, measure
from memplan.steps import step_fn
from memplan.testing import assert_equivalent

__all__ = ["EinsumHeadMatmul", "ChunkedMaxSim", "ChunkedChainProduct", "ShardedGeneratorSeq2Seq", "hand_written", "main"]


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


_HAND: dict[str, Callable[[nn.Module], nn.Module]] = {
    "broadcast_matmul": EinsumHeadMatmul,
    "maxsim": ChunkedMaxSim,
    "chain_product": ChunkedChainProduct,
    "seq2seq": ShardedGeneratorSeq2Seq,
}


def hand_written(name: str, model: nn.Module) -> nn.Module:
    """The hand-written version of workload ``name`` around ``model`` (same parameters)."""
    return _HAND[name](model)


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def compare(name: str, *, size: str = "small", passes: str = "rewrite,chunk", repeats: int = 5, check: bool = True,
            optimize_kwargs: dict | None = None) -> dict[str, Any]:
    """Peak bytes and best step time of eager, hand-written and memplan for workload ``name``."""
    w = examples.make(name, size=size)
    variants = {"eager": w.model, "hand": hand_written(name, w.model),
                "memplan": memplan.optimize(w.model, passes=passes, **(optimize_kwargs or {}))}
    if check:
        assert_equivalent(w.model, variants["hand"], *w.inputs, rtol=1e-4, atol=1e-4)
        assert_equivalent(w.model, variants["memplan"], *w.inputs, rtol=1e-4, atol=1e-4)
    steps = {k: step_fn(v, w.inputs, train=True) for k, v in variants.items()}
    for step in steps.values():
        step()  # warm up (memplan plans on its first call)
    peaks = {k: measure(step).peak for k, step in steps.items()}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):  # interleaved, so load on the machine affects all three alike
        for k, step in steps.items():
            times[k].append(_best_time(step, 1))
    plan = variants["memplan"].plan
    return {
        "workload": name,
        "size": size,
        "peak": peaks,
        "time": {k: min(v) for k, v in times.items()},
        "median_time": {k: statistics.median(v) for k, v in times.items()},
        "planned": plan.planned_peak,
        "plan": str(plan),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", default=list(_HAND))
    parser.add_argument("--size", default="small", choices=("small", "full"))
    parser.add_argument("--passes", default="rewrite,chunk")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-overhead", type=float, default=None)
    parser.add_argument("--budget", default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable timings on a shared machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    kwargs: dict[str, Any] = {}
    if args.max_overhead is not None:
        kwargs["max_overhead"] = args.max_overhead
    if args.budget is not None:
        kwargs["budget"] = args.budget
    for name in args.workloads:
        r = compare(name, size=args.size, passes=args.passes, repeats=args.repeats, optimize_kwargs=kwargs)
        eager = r["peak"]["eager"]
        print(f"{name} ({args.size}), pipeline {args.passes!r} {kwargs or ''}")
        for k in ("eager", "hand", "memplan"):
            peak, t = r["peak"][k], r["time"][k]
            print(f"  {k:8s} peak {format_bytes(peak):>11s} ({eager / peak:6.1f}x lower)  "
                  f"step {t * 1e3:8.1f} ms ({t / r['time']['eager']:.2f}x eager)")
        print(f"  planned peak {format_bytes(r['planned'])}")
        print("  " + r["plan"].replace("\n", "\n  "))


if __name__ == "__main__":
    main()
