"""What holds the peak, in groups: by kind, by layer (module) and by source line, and what would lower it.

A user's first question about a peak is which part of the model holds it, not which of a thousand
tensors: ten GELU outputs of ten blocks are one layer type's share, and the blocks together are the
model's. This module sums the storages alive at the peak (exactly the bytes of the peak, each storage
once) three ways, and derives a one-line diagnosis from the shares.

Stages
------
(1) Attribute each storage alive at the peak (:attr:`PeakSimulation.live_at_peak`):
    - its *kind*: a parameter's gradient, an input's gradient or a model output (the graph returns
      it), else a saved activation (a forward storage the backward reads, :class:`SavedForBackward`),
      else a temporary;
    - its *module*: the module path of the op that created it (:attr:`CapturedGraph.modules`; backward
      ops inherit the path of their forward op), or, for a parameter's gradient, the module that owns
      the parameter;
    - its *lines*: the user's line of the op that created it and the line of torch's beneath it.
(2) Sum per kind, per module path (each storage counts in its module and in every ancestor, so a
    layer's bytes include its sublayers'), and per pair of lines. Parameters and inputs are not part
    of the peak (they exist before the call, see :func:`memplan.analyze`); they are summed beside it.
(3) Diagnose from the largest kind: gradients and outputs are what the step returns, which no plan
    lowers; saved activations are what recomputation lowers, and where one family of repeated
    blocks (``encoder.layers.0``, ``encoder.layers.1``, ...) holds most of them that family is named;
    temporaries are what memplan's other passes free early, reuse or split.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from memplan.analysis.autograd import SavedForBackward
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, SourceLine

__all__ = [
    "KINDS",
    "KindShare",
    "ModuleShare",
    "LineShare",
    "PeakGroups",
    "StorageOrigin",
    "group_peak",
    "storage_origins",
    "largest_modules",
]

#: Kinds of the storages alive at the peak, then the kinds held beside it (not counted in the peak).
KINDS = ("saved activations", "parameter gradients", "input gradients", "temporaries", "outputs")
BESIDE_PEAK = ("parameters", "inputs")


@dataclasses.dataclass(frozen=True)
class KindShare:
    """The storages of one kind: how many, their bytes and their share of the peak (None for a kind held
    beside the peak: parameters, buffers and inputs exist before the call)."""

    kind: str
    count: int
    nbytes: int
    share: float | None


@dataclasses.dataclass(frozen=True)
class ModuleShare:
    """One module's part of the peak, its sublayers' included. ``path`` is its qualified name (``""`` for
    the model itself), None for storages made outside the model's modules (the loss, autograd's sums of
    gradients, ops passes add); ``depth`` is its depth in the module tree (the model's is 0)."""

    path: str | None
    depth: int
    count: int
    nbytes: int
    own_bytes: int  # bytes made by the module's own code, not by a sublayer's
    share: float


@dataclasses.dataclass(frozen=True)
class LineShare:
    """The storages made by one line of the user's code (None: no line is known), and by one line of
    torch's beneath it (None: the op ran in the user's line itself)."""

    source: SourceLine | None
    library_source: SourceLine | None
    count: int
    nbytes: int
    share: float


@dataclasses.dataclass(frozen=True)
class PeakGroups:
    """The storages alive at the peak, summed by kind, by module and by line, and a diagnosis.

    ``kinds``: the kinds in the peak, largest first, then those beside it. ``modules``: every module that
    holds part of the peak, in tree order (a parent before its sublayers, sublayers largest first), then
    the part outside the modules. ``lines``: largest first.
    """

    kinds: tuple[KindShare, ...] = ()
    modules: tuple[ModuleShare, ...] = ()
    lines: tuple[LineShare, ...] = ()
    diagnosis: str | None = None


@dataclasses.dataclass(frozen=True)
class StorageOrigin:
    """Where a storage alive at the peak comes from: its kind, module and lines (see the module docstring)."""

    kind: str
    module: str | None
    source: SourceLine | None
    library_source: SourceLine | None


def storage_origins(graph: CapturedGraph, am: AnalysisManager, storages: tuple[int, ...]) -> dict[int, StorageOrigin]:
    """Stage (1): the origin of each storage id in ``storages``."""
    tensors = am.get(Tensors)
    saved = am.get(SavedForBackward).saved
    parameters = {spec.path for spec in graph.inputs if spec.kind == "parameter"}
    returned: dict[int, tuple[str, str | None]] = {}  # storage -> (kind, owning module of a parameter's gradient)
    for spec in graph.outputs:
        if spec.node is None:
            continue
        if spec.kind == "grad" and spec.path in parameters:
            found = ("parameter gradients", spec.path.rpartition(".")[0])
        elif spec.kind == "grad":
            found = ("input gradients", None)
        else:
            found = ("outputs", None)
        for sid in tensors.storages_of(spec.node):
            returned.setdefault(sid, found)
    origins = {}
    for sid in storages:
        creator = tensors.storages[sid].creator
        module = graph.modules.get(creator)
        if sid in returned:
            kind, owner = returned[sid]
            if owner is not None and graph.modules:  # the layer that owns the parameter
                module = owner
        elif sid in saved:
            kind = "saved activations"
        else:
            kind = "temporaries"
        origins[sid] = StorageOrigin(kind, module, graph.sources.get(creator), graph.library_sources.get(creator))
    return origins


def group_peak(graph: CapturedGraph, am: AnalysisManager | None = None) -> PeakGroups:
    """The storages alive at the peak of ``graph`` summed by kind, module and line, with a diagnosis.

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
    >>> groups = group_peak(capture(model, torch.randn(32, 64), train=False))
    >>> [(m.path, m.nbytes) for m in groups.modules]
    [('', 16384), ('0', 8192), ('1', 8192)]
    >>> [(k.kind, k.count) for k in groups.kinds]
    [('temporaries', 1), ('outputs', 1), ('parameters', 2), ('inputs', 1)]
    """
    am = am or AnalysisManager(graph)
    sim = am.get(PeakSimulation)
    if sim.peak_index < 0:
        return PeakGroups()
    storages = am.get(Tensors).storages
    live = sim.live_at_peak
    origins = storage_origins(graph, am, live)
    peak = sim.peak
    # Step 2: sum per kind, module and line.
    kinds: dict[str, list[int]] = {}
    total: dict[str, list[int]] = {}  # module path -> [count, bytes], sublayers included
    own: dict[str, int] = {}
    outside = [0, 0]
    lines: dict[tuple[SourceLine | None, SourceLine | None], list[int]] = {}
    ancestors: dict[str, tuple[str, ...]] = {}
    for sid in live:
        nbytes = storages[sid].nbytes
        origin = origins[sid]
        _add(kinds, origin.kind, nbytes)
        _add(lines, (origin.source, origin.library_source), nbytes)
        if origin.module is None:
            outside[0] += 1
            outside[1] += nbytes
            continue
        own[origin.module] = own.get(origin.module, 0) + nbytes
        chain = ancestors.get(origin.module)
        if chain is None:
            chain = ancestors[origin.module] = _ancestors(origin.module)
        for path in chain:
            _add(total, path, nbytes)
    kind_rows = [KindShare(k, c, b, b / peak) for k, (c, b) in sorted(kinds.items(), key=lambda kv: (-kv[1][1], KINDS.index(kv[0])))]
    kind_rows += _beside_peak(graph, am)
    module_rows = [
        ModuleShare(path, _depth(path), total[path][0], total[path][1], own.get(path, 0), total[path][1] / peak)
        for path in _tree_order(total)
    ]
    if outside[0]:
        module_rows.append(ModuleShare(None, 0, outside[0], outside[1], outside[1], outside[1] / peak))
    line_rows = sorted(
        (LineShare(source, library, c, b, b / peak) for (source, library), (c, b) in lines.items()),
        key=lambda row: (-row.nbytes, _line_key(row.source), _line_key(row.library_source)),
    )
    # Step 3: the diagnosis.
    diagnosis = _diagnose(peak, kinds, origins, {sid: storages[sid].nbytes for sid in live})
    return PeakGroups(tuple(kind_rows), tuple(module_rows), tuple(line_rows), diagnosis)


def largest_modules(modules: tuple[ModuleShare, ...], rows: int) -> tuple[ModuleShare, ...]:
    """The ``rows`` modules of ``modules`` (tree order, as :class:`PeakGroups` has them) that hold the most
    bytes, still in tree order. Each one's parent is among them: a parent holds at least its sublayers'
    bytes, and comes first on a tie, being shallower. The part outside the modules is left out."""
    named = [m for m in modules if m.path is not None]
    shown = {m.path for m in sorted(named, key=lambda m: (-m.nbytes, m.depth, m.path))[:rows]}
    return tuple(m for m in named if m.path in shown)


def _add(sums: dict, key: object, nbytes: int) -> None:
    found = sums.get(key)
    if found is None:
        sums[key] = [1, nbytes]
    else:
        found[0] += 1
        found[1] += nbytes


def _ancestors(path: str) -> tuple[str, ...]:
    """``"a.b.c"`` -> ``("", "a", "a.b", "a.b.c")``: the module and every module above it."""
    if not path:
        return ("",)
    parts = path.split(".")
    return ("",) + tuple(".".join(parts[: i + 1]) for i in range(len(parts)))


def _depth(path: str) -> int:
    return 0 if not path else path.count(".") + 1


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _tree_order(total: Mapping[str, list[int]]) -> list[str]:
    """The module paths depth first from the model's, each module's sublayers largest first (then by name)."""
    children: dict[str, list[str]] = {}
    for path in total:
        if path:
            children.setdefault(_parent(path), []).append(path)
    order: list[str] = []
    stack = [""] if "" in total else []
    while stack:
        path = stack.pop()
        order.append(path)
        below = sorted(children.get(path, ()), key=lambda p: (-total[p][1], p))
        stack.extend(reversed(below))
    return order


def _line_key(line: SourceLine | None) -> tuple:
    return ("", 0) if line is None else (line.filename, line.lineno)


def _beside_peak(graph: CapturedGraph, am: AnalysisManager) -> list[KindShare]:
    """Parameters (with buffers) and inputs (with tangents): held before the call, not part of its peak."""
    tensors = am.get(Tensors)
    rows = []
    for kind, spec_kinds in (("parameters", ("parameter", "buffer")), ("inputs", ("input", "tangent"))):
        seen: set[int] = set()
        count = nbytes = 0
        for spec in graph.inputs:
            if spec.kind not in spec_kinds:
                continue
            count += 1
            for sid in tensors.storages_of(spec.node):
                if sid not in seen:
                    seen.add(sid)
                    nbytes += tensors.storages[sid].nbytes
        if count:
            rows.append(KindShare(kind, count, nbytes, None))
    return rows


# ----------------------------------------------------------------------------------------------
# the diagnosis

# What lowers each kind, or why nothing does.
_CANNOT = {
    "parameter gradients": "memplan cannot lower these (they are what the step returns)",
    "input gradients": "memplan cannot lower these (they are what the step returns)",
    "outputs": "memplan cannot lower these (the call returns them)",
}
# Most of a kind is "in" a module or a family when it holds at least this share of the kind's bytes.
MOST = 0.5


def _diagnose(peak: int, kinds: Mapping[str, list[int]], origins: Mapping[int, StorageOrigin],
              nbytes: Mapping[int, int]) -> str | None:
    """One line on what would lower the peak, from the largest kind's share (see the module docstring)."""
    if not kinds or peak <= 0:
        return None
    kind = max(kinds, key=lambda k: (kinds[k][1], -KINDS.index(k)))
    share = kinds[kind][1] / peak
    head = f"{share:.0%} is {kind}"
    if kind in _CANNOT:
        return f"{head}: {_CANNOT[kind]}"
    by_module: dict[str, int] = {}
    for sid, origin in origins.items():
        if origin.kind == kind and origin.module is not None:
            for path in _ancestors(origin.module):
                by_module[path] = by_module.get(path, 0) + nbytes[sid]
    where = _where(by_module, kinds[kind][1])
    if kind == "saved activations":
        held = f"saved by {where}" if where else "saved for backward"
        return (f"{share:.0%} is activations {held}: try memplan.optimize(model) or "
                f"budget={suggested_budget(share)}")
    return f"{head}{f' in {where}' if where else ''}: try memplan.optimize(model) (it frees, reuses or splits them)"


def _where(by_module: Mapping[str, int], kind_bytes: int) -> str | None:
    """Where most (:data:`MOST`) of a kind's bytes are: a family of repeated blocks (``"12 repeated blocks
    (encoder.layers.*)"``), else the deepest module holding most of them, else None."""
    families: dict[str, list[int]] = {}  # parent -> [blocks, bytes] over its numbered sublayers
    for path, held in by_module.items():
        parent, _, last = path.rpartition(".")
        if path and last.isdigit():
            _add(families, parent, held)
    repeated = [(parent, found) for parent, found in families.items() if found[0] >= 2]
    best = max(repeated, key=lambda kv: (kv[1][1], -_depth(kv[0]), kv[0]), default=None)
    if best is not None and best[1][1] >= MOST * kind_bytes:
        parent, (blocks, _) = best
        return f"{blocks} repeated blocks ({parent + '.' if parent else ''}*)"
    deepest = None
    for path, held in by_module.items():
        if path and held >= MOST * kind_bytes and (deepest is None or _depth(path) > _depth(deepest)):
            deepest = path
    return deepest


def suggested_budget(saved_share: float) -> float:
    """A first budget to try when saved activations are ``saved_share`` of the peak: the peak with half of
    them recomputed instead, rounded down to a tenth (at least 0.1). Half, because recomputation keeps
    some activations at the boundaries it recomputes from; the budget ladder tells how far it goes.

    Examples
    --------
    >>> suggested_budget(0.62), suggested_budget(0.2), suggested_budget(1.0)
    (0.6, 0.9, 0.5)
    """
    return max(0.1, math.floor((1 - saved_share / 2) * 10 + 1e-9) / 10)
