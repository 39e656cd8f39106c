"""Hand-placed ``torch.utils.checkpoint`` per segment of time steps, against eager and memplan, on the latent GRU.

The latent GRU of user report 003 unrolls a GRU-like cell in Python; autograd keeps every step for the
backward. The usual hand fix is to wrap segments of ``k`` steps in ``torch.utils.checkpoint`` (always with
``use_reentrant=False``): only the hidden state between segments is kept, and each segment is recomputed
in the backward. :class:`memplan.baselines.CheckpointedLatentGRU` is that fix, written against the example's own module (same
parameters, same noise, same outputs and gradients). This script measures, side by side:

* eager;
* the checkpointed model for several segment lengths (``sqrt(T)`` among them);
* ``memplan.optimize(model, passes=...)`` for the recomputing pipelines, at the default policy and at a
  larger ``max_overhead``.

Peaks are ``memplan.measure`` on ``memplan.steps.step_fn(model, inputs, train=True)`` (bytes allocated
during one training step); "activations" is the peak minus what the step leaves behind (the gradients)
and minus the tensors the model returns (the stacked hidden states: alive in every variant alike until
the backward ends, they are outputs, not activations); times are medians of interleaved repeats, on one
thread by default. "plan s" is the time planning took on the first call: capture, analysis, the passes
and emitting the plan; capture alone is timed apart too.

Run ``python benchmarks/checkpoint_baselines.py [--steps 64 1000] [--batch 16] [--hidden 64]
[--input 32] [--repeats 5] [--pipelines default timesteps] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import memplan
from memplan.bench import interleaved_medians
from memplan.baselines import CheckpointedLatentGRU
from memplan.capture import capture
from memplan.examples.latent_gru import LatentGRU
from memplan.measure import format_bytes, measure
from memplan.steps import step_fn
from memplan.testing import assert_equivalent

__all__ = ["latent_gru", "main"]


def latent_gru(steps: int, batch: int, hidden: int, inputs: int, seed: int = 0) -> tuple[LatentGRU, tuple]:
    """The latent GRU of ``memplan.examples`` at any size (``make`` offers only "small" and "full")."""
    torch.manual_seed(seed)
    model = LatentGRU(inputs, hidden).train()
    return model, (torch.randn(steps, batch, inputs, requires_grad=True), torch.zeros(batch, hidden))


def _output_bytes(model: nn.Module, inputs: Sequence[torch.Tensor]) -> int:
    """Bytes of the tensors the model returns (distinct storages): they are outputs, not activations."""
    with torch.no_grad():
        outputs = model(*inputs)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in torch.utils._pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[64, 1000])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--input", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pipelines", nargs="+", default=["default", "timesteps"],
                        help='memplan pipelines ("default": the default pipeline)')
    parser.add_argument("--max-overheads", type=float, nargs="+", default=[0.3])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier step times)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    for steps in args.steps:
        model, inputs = latent_gru(steps, args.batch, args.hidden, args.input)
        start = time.perf_counter()
        capture(model, *inputs, seed="tangents")
        capture_seconds = time.perf_counter() - start
        candidates: list[tuple[str, nn.Module, float]] = [("eager", model, 0.0)]
        root = max(1, round(math.sqrt(steps)))
        for segment in sorted({root // 2 or 1, root, 2 * root}):
            candidates.append((f"checkpoint every {segment} steps", CheckpointedLatentGRU(model, segment), 0.0))
        for pipeline in args.pipelines:
            for max_overhead in args.max_overheads:
                opt = memplan.optimize(model, passes=None if pipeline == "default" else pipeline,
                                       max_overhead=max_overhead)
                step_fn(opt, inputs, train=True)()  # first call: capture and plan
                passes = opt.plan.plan_seconds
                label = f"memplan {pipeline} (max_overhead={max_overhead:g})"
                candidates.append((label, opt, passes))
        eager_step = step_fn(model, inputs, train=True)
        eager = measure(eager_step)
        outputs = _output_bytes(model, inputs)
        for label, candidate, plan_seconds in candidates:
            if label != "eager":
                # Checkpointed segments and memplan's fused accumulations (``acc.addmm_(a, b)`` for the
                # per-step weight gradients) sum the weight gradients in another order or rounding: over a
                # long sequence the float sums differ in the last digits.
                assert_equivalent(model, candidate, *inputs, rtol=1e-3, atol=1e-4)
            step = step_fn(candidate, inputs, train=True)
            step()
            m = measure(step)
            seconds, reference = interleaved_medians([step, eager_step], args.repeats, torch.device("cpu"))
            rows.append({
                "steps": steps, "model": label, "peak": m.peak, "activations": m.peak - m.after - outputs,
                "peak_ratio": eager.peak / m.peak,
                "activation_saving": 1 - (m.peak - m.after - outputs) / (eager.peak - eager.after - outputs),
                "time_ratio": seconds / reference, "plan_seconds": plan_seconds, "capture_seconds": capture_seconds,
            })
    _print(rows)
    return rows


def _print(rows: Sequence[dict[str, Any]]) -> None:
    header = (f"{'T':>5}  {'model':48s} {'peak':>11} {'x lower':>8} {'activations':>12} {'saved':>7} "
              f"{'time':>6} {'plan s':>8}")
    print(header)
    for r in rows:
        plan = f"{r['plan_seconds']:.1f}" if r["plan_seconds"] else "-"
        print(f"{r['steps']:>5}  {r['model']:48s} {format_bytes(r['peak']):>11} {r['peak_ratio']:>7.2f}x "
              f"{format_bytes(r['activations']):>12} {r['activation_saving']:>6.1%} {r['time_ratio']:>5.2f}x {plan:>8}")
    for steps in sorted({r["steps"] for r in rows}):
        capture_seconds = next(r["capture_seconds"] for r in rows if r["steps"] == steps)
        print(f"capture alone of the {steps}-step graph: {capture_seconds:.1f} s (included in 'plan s')")


if __name__ == "__main__":
    main()
