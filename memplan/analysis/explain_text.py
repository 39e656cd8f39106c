"""An :class:`~memplan.analysis.explain.Explanation` as lines of text that fit a console's width.

The groups come first (by kind, by layer, by line), then the diagnosis, then the largest tensors. Every
line fits the width: tables have few columns, a module path too long for its column loses its start
(``…layers.11.mlp.act``: the end names the layer), a source line loses its end, and prose (the
diagnosis, why a tensor is alive) wraps onto at most a few indented lines. Each line comes with a rich
style, or None, so the console and ``str`` show the same text.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator
from typing import Any

import torch

from memplan.analysis.groups import largest_modules
from memplan.measure import format_bytes

__all__ = ["render_lines", "torch_line"]

_TORCH_PARENT = os.path.dirname(os.path.dirname(torch.__file__))
# the columns right of a group's label: tensors, bytes, share
_COLUMNS = 7 + 1 + 11 + 1 + 7
_INDENT = 2
_DETAIL = 11 + 1 + 7 + 2  # where a tensor's second and later lines start


def render_lines(explanation: Any, width: int, rows: int) -> list[tuple[str, str | None]]:
    """``(text, rich style)`` per line of ``explanation``, each at most ``width`` columns; at most ``rows``
    layers and ``rows`` lines of code."""
    headline = textwrap.wrap(explanation._headline(), width, subsequent_indent=" " * _INDENT, max_lines=2,
                             placeholder=" …")
    lines: list[tuple[str, str | None]] = [(text, "bold") for text in headline]
    if explanation.peak_node is None:
        return lines
    for section in (_kinds, _modules, _code_lines):
        body = list(section(explanation, width, rows))
        if body:
            lines.append(("", None))
            lines.extend(body)
    if explanation.diagnosis:
        lines.append(("", None))
        wrapped = textwrap.wrap(f"diagnosis: {explanation.diagnosis}", width, subsequent_indent=" " * _INDENT)
        lines.extend((text, "bold") for text in wrapped)
    if explanation.tensors:
        lines.append(("", None))
        lines.extend(_tensors(explanation, width))
    return lines


def torch_line(line: Any) -> str:
    """``"torch/nn/modules/linear.py:125 (return F.linear(...))"``: a line of torch's, named by its path in
    torch (a line elsewhere by its file's name, as :class:`~memplan.capture.SourceLine` names it)."""
    filename = os.path.abspath(line.filename)
    name = os.path.relpath(filename, _TORCH_PARENT) if filename.startswith(_TORCH_PARENT + os.sep) else os.path.basename(filename)
    return f"{name}:{line.lineno} ({line.code})" if line.code else f"{name}:{line.lineno}"


def _clip(text: str, width: int) -> str:
    """``text`` cut at its end to ``width`` columns, with an ellipsis."""
    return text if len(text) <= width else text[: width - 1] + "…"


def _clip_start(text: str, width: int) -> str:
    """``text`` cut at its start to ``width`` columns, with an ellipsis (a path keeps its last names)."""
    return text if len(text) <= width else "…" + text[len(text) - width + 1 :]


def _share(nbytes: int, peak: int) -> str:
    return f"{nbytes / peak:.1%}" if peak else "-"


def _row(label: str, count: int | str, nbytes: int | str, share: str, width: int) -> str:
    """A group's row: its label in the room the columns leave (padded, never wider)."""
    room = width - _COLUMNS - 1
    size = format_bytes(nbytes) if isinstance(nbytes, int) else nbytes
    return f"{label[:room]:<{room}} {count!s:>7} {size:>11} {share:>7}"


def _kinds(explanation: Any, width: int, rows: int) -> Iterator[tuple[str, str | None]]:
    in_peak = [k for k in explanation.kinds if k.share is not None]
    beside = [k for k in explanation.kinds if k.share is None]
    if not in_peak:
        return
    yield _row("by kind", "tensors", "bytes", "share", width), "bold"
    pad = " " * _INDENT
    for kind in in_peak:
        yield _row(pad + kind.kind, kind.count, kind.nbytes, _share(kind.nbytes, explanation.peak), width), None
    if beside:
        held = ", ".join(f"{k.kind} {format_bytes(k.nbytes)} ({k.count})" for k in beside)
        yield _clip(f"{pad}held besides the peak: {held}", width), "dim"


def _modules(explanation: Any, width: int, rows: int) -> Iterator[tuple[str, str | None]]:
    named = [m for m in explanation.modules if m.path is not None]
    if not named:
        return
    shown = largest_modules(explanation.modules, rows)
    yield _row("by layer (sublayers included)", "tensors", "bytes", "share", width), "bold"
    room = width - _COLUMNS - 1
    for module in shown:
        indent = " " * (_INDENT + 2 * min(module.depth, 4))
        name = module.path or "(model)"
        yield _row(indent + _clip_start(name, room - len(indent)), module.count, module.nbytes,
                   _share(module.nbytes, explanation.peak), width), None
    outside = [m for m in explanation.modules if m.path is None]
    for module in outside:
        yield _row(" " * _INDENT + "(outside the model's modules)", module.count, module.nbytes,
                   _share(module.nbytes, explanation.peak), width), None
    hidden = len(named) - len(shown)
    if hidden:
        yield _clip(f"{' ' * _INDENT}… {hidden} smaller layers not shown", width), "dim"


def _code_lines(explanation: Any, width: int, rows: int) -> Iterator[tuple[str, str | None]]:
    if not explanation.lines:
        return
    yield _row("by line (yours; torch's beneath)", "tensors", "bytes", "share", width), "bold"
    room = width - _COLUMNS - 1
    pad = " " * _INDENT
    for line in explanation.lines[:rows]:
        label = str(line.source) if line.source is not None else "(no line of yours)"
        yield _row(pad + _clip(label, room - _INDENT), line.count, line.nbytes,
                   _share(line.nbytes, explanation.peak), width), None
        if line.library_source is not None:
            yield _clip(f"{pad * 3}{torch_line(line.library_source)}", width), "dim"
    rest = explanation.lines[rows:]
    if rest:
        nbytes = sum(line.nbytes for line in rest)
        yield _clip(f"{pad}… {len(rest)} more lines, {format_bytes(nbytes)} "
                    f"({_share(nbytes, explanation.peak)})", width), "dim"


def _tensors(explanation: Any, width: int) -> Iterator[tuple[str, str | None]]:
    yield "largest tensors", "bold"
    detail = " " * _DETAIL
    for t in explanation.tensors:
        what = f"{t.op} {list(t.shape)} {str(t.dtype).replace('torch.', '')}"
        first = f"{format_bytes(t.nbytes):>11} {_share(t.nbytes, explanation.peak):>7}  {what}"
        if t.module is not None:
            room = width - len(first) - 4
            if room >= 12:
                first += f" in {_clip_start(t.module or '(model)', room)}"
        yield _clip(first, width), None
        if t.provenance:
            for text in textwrap.wrap(t.provenance, width, initial_indent=detail, subsequent_indent=detail,
                                      max_lines=2, placeholder=" …"):
                yield text, "dim"
        if t.source is not None:
            yield _clip(f"{detail}at {t.source}", width), "dim"
        for text in textwrap.wrap(f"alive because: {t.reason}", width, initial_indent=detail,
                                  subsequent_indent=detail + "  ", max_lines=2, placeholder=" …"):
            yield text, None
    if explanation.rest_bytes:
        yield (f"{format_bytes(explanation.rest_bytes):>11} {_share(explanation.rest_bytes, explanation.peak):>7}"
               "  in smaller tensors"), None
