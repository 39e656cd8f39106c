"""What every example does once its model is built: eager's peak and memplan's, side by side, checked and reported.

The example scripts import it (``from _compare import ...``: Python puts a script's own folder on its path);
``your_model.py`` spells the same steps out, with comments, and uses the printing and reporting parts.
"""

import argparse
import pathlib
import tempfile

import memplan
from memplan.steps import step_fn
from memplan.testing import assert_equivalent


def parse_args(doc: str) -> argparse.Namespace:
    """``--small`` (tiny sizes, a few seconds) and ``--out DIR`` (where the HTML report goes)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes: runs in a few seconds")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for the HTML report")
    return parser.parse_args()


def print_peaks(eager, predicted: int, planned, optimized) -> None:
    """The table of one training step's peaks: eager's and the plan's, measured and predicted."""
    print(f"{'peak of one training step':26s}{'measured':>12s}{'predicted':>12s}")
    print(f"  {'eager PyTorch':24s}{memplan.format_bytes(eager.peak):>12s}{memplan.format_bytes(predicted):>12s}")
    print(
        f"  {'memplan':24s}{memplan.format_bytes(planned.peak):>12s}"
        f"{memplan.format_bytes(optimized.plan.planned_peak):>12s}   {eager.peak / planned.peak:.1f}x lower"
    )
    print(optimized.plan)  # what each pass changed, and the predicted peak after it


def write_report(optimized, *, title: str, name: str, out: pathlib.Path | None) -> None:
    """The plan's HTML report as ``out/NAME.html`` (``out`` None: a new temporary folder, never the repository)."""
    out = out if out is not None else pathlib.Path(tempfile.mkdtemp(prefix="memplan-example-"))
    out.mkdir(parents=True, exist_ok=True)
    path = optimized.report(title=title).save_html(out / f"{name}.html")
    print(f"report: {path}")


def compare(model, inputs, *, title: str, name: str, out: pathlib.Path | None) -> None:
    """Eager's peak for one training step (``sum(out.sum()).backward()``, gradients starting from None), predicted
    by ``memplan.analyze`` over fake tensors and measured; the same for ``memplan.optimize(model)`` (its first call
    captures and plans, the second is measured); the outputs and gradients checked against eager's (from one
    seed: random draws are eager's); the report written."""
    predicted = memplan.analyze(model, *inputs).peak
    eager_step = step_fn(model, inputs, train=True)
    eager_step()  # warm-up
    eager = memplan.measure(eager_step)

    optimized = memplan.optimize(model)
    optimized_step = step_fn(optimized, inputs, train=True)
    optimized_step()
    planned = memplan.measure(optimized_step)
    print_peaks(eager, predicted, planned, optimized)

    assert_equivalent(model, optimized, *inputs)  # raises if an output or a gradient differs
    print("outputs and gradients match the eager model")
    write_report(optimized, title=title, name=name, out=out)
