"""memplan as a ``torch.compile`` backend, side by side with eager and with torch.compile's own memory knob.

For each example workload (:mod:`memplan.examples`), one training step (:func:`memplan.steps.step_fn`) of:

* ``eager``: the model as written;
* ``optimize``: ``memplan.optimize(model)``, the default plan;
* ``backend``: ``torch.compile(model, backend="memplan")``, the same planner on Dynamo's graphs;
* ``aot``: ``torch.compile`` with AOTAutograd's partitioner and eager kernels (``aot_eager_decomp_partition``),
  by default and under ``activation_memory_budget`` (``--budget``, 0.5 by default), the knob the compiler
  offers for memory;
* ``inductor`` (``--inductor``): ``torch.compile`` with its defaults and under the same budget, fused C++
  kernels (compiling takes minutes on a small CPU); and ``backend, inductor``: memplan's plans of Dynamo's
  graphs compiled by Inductor (``memplan.compile.backend(inductor=True)``).

Every variant's outputs and gradients are checked against eager's (:func:`memplan.equivalence.assert_equivalent`,
same inputs, same RNG seed), and the table says where they differ. Peaks are the allocator's
(:func:`memplan.measure.allocator_peak`: compiled code runs no dispatch mode, so :func:`memplan.measure`
would see the model run eagerly instead), so eager's include what kernels allocate inside, and the
gradients a mode would make out of place are made as eager makes them; times are medians of
interleaved blocks (:func:`memplan.bench.interleaved_medians`); first calls (planning, compiling) are
reported beside them.

Run ``python benchmarks/compile_backend.py [--size small] [--workloads maxsim,seq2seq] [--inductor]``, or
``--zoo gpt2,resnet`` for models of the library zoo (``tests/zoo``) instead of the examples.
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import memplan
import memplan.compile
import memplan.examples as examples
from memplan.bench import interleaved_medians
from memplan.measure import allocator_peak, format_bytes
from memplan.steps import clear_grads, step_fn
from memplan.equivalence import assert_equivalent

__all__ = ["variants", "main"]


def variants(model: torch.nn.Module, budget: float, inductor: bool) -> dict[str, Callable[[], torch.nn.Module]]:
    """Each variant's maker: a fresh copy of ``model`` run that way."""

    def compiled(backend: Any, memory_budget: float | None) -> Callable[[], torch.nn.Module]:
        def make() -> torch.nn.Module:
            module = torch.compile(copy.deepcopy(model), backend=backend)
            if memory_budget is None:
                return module
            return _Budgeted(module, memory_budget)
        return make

    made: dict[str, Callable[[], torch.nn.Module]] = {
        "eager": lambda: model,
        "optimize": lambda: memplan.optimize(copy.deepcopy(model)),
        "backend": compiled("memplan", None),
        "aot": compiled("aot_eager_decomp_partition", None),
        f"aot, budget {budget}": compiled("aot_eager_decomp_partition", budget),
    }
    if inductor:
        made["inductor"] = compiled("inductor", None)
        made[f"inductor, budget {budget}"] = compiled("inductor", budget)
        made["backend, inductor"] = lambda: torch.compile(copy.deepcopy(model),
                                                          backend=memplan.compile.backend(inductor=True))
    return made


class _Budgeted(torch.nn.Module):
    """A compiled module whose compilations (on any call: a recompilation too) see the memory budget."""

    def __init__(self, module: torch.nn.Module, budget: float) -> None:
        super().__init__()
        self.module, self.budget = module, budget

    def forward(self, *args: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            return self.module(*args)


def _zoo(name: str) -> tuple[torch.nn.Module, tuple]:
    """A model of the library zoo (``tests/zoo``) by its factory's name, and its inputs."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "tests" / "zoo" / "test_library_models.py"
    spec = importlib.util.spec_from_file_location("memplan_zoo_models", path)
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    torch.manual_seed(0)
    model, inputs = getattr(zoo, name)()
    return model.train(), tuple(inputs)


def run(name: str, size: str, budget: float, inductor: bool, repeats: int, zoo: bool = False) -> list[dict[str, Any]]:
    model, workload_inputs = _zoo(name) if zoo else (lambda w: (w.model, w.inputs))(examples.make(name, size=size))
    rows, steps = [], []
    for label, make in variants(model, budget, inductor).items():
        torch._dynamo.reset()
        inputs = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                  for x in workload_inputs]
        module = make()
        state = copy.deepcopy(module.state_dict())  # the model's state, which the first step moves on
        step = step_fn(module, inputs, train=True)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step()
        first = time.perf_counter() - start
        check = "-"
        if label != "eager":
            module.load_state_dict(state)  # running statistics back where the model's are
            try:
                assert_equivalent(model, module, *inputs)
                check = "equal"
            except AssertionError as exc:  # reported, not hidden: a variant that computes something else
                check = "DIFFERS: " + str(exc).splitlines()[0][:100]
        clear_grads(module, inputs)
        rows.append({"workload": name, "variant": label, "peak": allocator_peak(step), "first_call": first,
                     "check": check})
        steps.append(step)
    for row, seconds in zip(rows, interleaved_medians(steps, repeats, torch.device("cpu"))):
        row["seconds"] = seconds
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", choices=["small", "default", "full"])
    parser.add_argument("--workloads", default=",".join(examples.WORKLOADS))
    parser.add_argument("--budget", type=float, default=0.5, help="activation_memory_budget for torch.compile")
    parser.add_argument("--inductor", action="store_true", help="also torch.compile's default backend")
    parser.add_argument("--zoo", default="", help="comma-separated models of tests/zoo (e.g. gpt2,resnet) instead of "
                        "the examples")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU, {args.threads} thread(s), size {args.size}; peaks: allocator_peak")
    print("| workload | variant | peak | vs eager | step time | vs eager | first call | outputs and gradients |")
    print("|---|---|---|---|---|---|---|---|")
    names = args.zoo.split(",") if args.zoo else args.workloads.split(",")
    for name in names:
        rows = run(name, args.size, args.budget, args.inductor, args.repeats, zoo=bool(args.zoo))
        eager = rows[0]
        for row in rows:
            print(f"| {name} | {row['variant']} | {format_bytes(row['peak'])} | {eager['peak'] / max(row['peak'], 1):.2f}x lower "
                  f"| {row['seconds'] * 1e3:.1f} ms | {row['seconds'] / eager['seconds']:.2f}x | {row['first_call']:.1f} s "
                  f"| {row['check']} |",
                  flush=True)


if __name__ == "__main__":
    main()
