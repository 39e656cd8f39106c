"""Draw the pictures of docs/concepts.md from memplan's own report (``python docs/make_figures.py``).

Each picture is a report timeline (stacked by category) of an example's training step, as written
and with a memplan pipeline; the SVGs land in docs/img/.
"""

import pathlib

import memplan
import memplan.examples as examples
from memplan.report.data import CATEGORIES
from memplan.report.html import COLOURS, _timeline_svg
from memplan.steps import step_fn

OUT = pathlib.Path(__file__).parent / "img"
FIGURES = [
    ("chain_product", "", "lifetimes"),  # the empty pipeline: graph lifetimes only
    ("latent_gru", "remat,timesteps", "timesteps"),
    ("maxsim", "rewrite,chunk", "chunk"),
]


def legend() -> str:
    items = "".join(
        f"<rect x='{10 + i * 170}' y='4' width='12' height='12' fill='{COLOURS[c]}'/>"
        f"<text x='{26 + i * 170}' y='15' font-size='12'>{c}</text>"
        for i, c in enumerate(CATEGORIES)
    )
    return f"<svg xmlns='http://www.w3.org/2000/svg' width='880' height='20'>{items}</svg>"


def main() -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / "legend.svg").write_text(legend())
    for name, passes, stem in FIGURES:
        w = examples.make(name)
        opt = memplan.optimize(w.model, passes=passes)
        step_fn(opt, w.inputs, train=True)()
        report = opt.report()
        scale = max(report.before.peak, report.after.peak) + report.parameter_bytes
        for label, timeline in (("before", report.before), ("after", report.after)):
            svg = _timeline_svg(timeline, scale, width=880, height=220)
            svg = svg.replace("<svg ", "<svg xmlns='http://www.w3.org/2000/svg' ", 1)
            (OUT / f"{stem}-{label}.svg").write_text(svg)


if __name__ == "__main__":
    main()
