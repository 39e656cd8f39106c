"""The pass pipeline: one contract, a registry, verification after every pass, reproducers.

A pass is ``fn(graph: CapturedGraph, ctx: PassContext) -> PassResult``. It plans first (a frozen plan
object it can print and test), then applies; if it finds nothing it returns its input untouched with
``changed=False``. The :class:`PassManager` runs passes in order and, after each one that changed the
graph, invalidates the analyses the pass did not preserve, then verifies:

(1) ``graph.lint()``;
(2) every ``call_function`` node has a phase, and no forward node reads a backward node;
(3) alias safety: no in-place write lands on a storage that a node defined before the write still
    reads after it (a stale read), beyond those the user's own code already had. This one is checked
    after each pass when ``reproducer_dir`` is set, otherwise once on the last graph (a stale read
    there was added by a pass and survived the rest; the error names the last pass that added its
    writer or reader; rolling back, the passes run again with the check after each, to find it).

A failing pass (one that raises, breaks one of these invariants, or returns a new graph with
``changed=False``) is rolled back: the plan is made without its change, a
:class:`~memplan.errors.PassRolledBackWarning` names it, what broke, the user's line of the node
involved and a saved reproducer (graph, metadata, pipeline string), and the later passes run. Under
``on_failure="raise"`` (or inside :func:`pass_failures` ``("raise")``, as memplan's tests run) it
raises :class:`~memplan.errors.PassError` naming it and the passes before it instead, with a
reproducer saved when ``reproducer_dir`` is set. :func:`replay` runs a pipeline on a saved
reproducer, raising at the failure it saved.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import json
import pathlib
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.fx

from memplan.analysis.cost import REFERENCE_RATES, CostRates, eager_seconds, graph_cost, rates_for
from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.explain import explain_peak
from memplan.analysis.peak import PeakSimulation, step_margin
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, InputSpec, OutputSpec, Phase, SourceLine, is_user_frame
from memplan.errors import InfeasibleBudgetError, PassError, PassRolledBackWarning
from memplan.graphutil import copy_graph, create_node, is_pure_view, mutated_args, run_device
from memplan.measure import format_bytes
from memplan.policy import Policy

T = TypeVar("T")

__all__ = [
    "PassStats",
    "PassResult",
    "PassContext",
    "PassRecord",
    "PipelineResult",
    "PassManager",
    "pass_failures",
    "failure_mode",
    "register_pass",
    "registered_passes",
    "check_options",
    "pass_options",
    "parse_pipeline",
    "verify",
    "mutation_hazards",
    "save_reproducer",
    "replay",
]


@dataclasses.dataclass(frozen=True)
class PassStats:
    """What a pass did, in numbers."""

    nodes_rewritten: int = 0
    bytes_saved: int = 0  # predicted peak reduction the pass claims
    recompute_added: float = 0.0  # extra compute, as a fraction of the graph's original compute


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What a pass returns. ``analyses``: a manager the pass used to analyse its own result graph (to
    measure it), whose analyses the pipeline then takes over instead of computing them again."""

    graph: CapturedGraph
    changed: bool
    preserved: frozenset[type] = frozenset()
    stats: PassStats = PassStats()
    notes: tuple[str, ...] = ()
    plan: Any = None
    analyses: AnalysisManager | None = None


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What a pass may read: the analyses of its input graph and the policy."""

    am: AnalysisManager
    policy: Policy
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rates: CostRates = REFERENCE_RATES  # the time model's rates: every pass prices its candidates with them


PassFn = Callable[[CapturedGraph, PassContext], PassResult]
OptionsReader = Callable[[Mapping[str, Any]], Any]


@dataclasses.dataclass(frozen=True)
class _Registered:
    """What the pipeline knows of a registered pass (see :func:`register_pass`)."""

    fn: PassFn
    options: OptionsReader | None = None
    retry_before: str | None = None
    alone: Callable[[CapturedGraph, Mapping[str, Any]], bool] | None = None
    variants: Callable[[CapturedGraph, Mapping[str, Any]], Sequence[Mapping[str, Any]]] | None = None


_REGISTRY: dict[str, _Registered] = {}


def register_pass(name: str, fn: PassFn | None = None, *, options: OptionsReader | None = None,
                  retry_before: str | None = None,
                  alone: Callable[[CapturedGraph, Mapping[str, Any]], bool] | None = None,
                  variants: Callable[[CapturedGraph, Mapping[str, Any]], Sequence[Mapping[str, Any]]] | None = None
                  ) -> Any:
    """Register a pass under ``name`` (usable as a decorator). Registering a name twice is an error.

    ``options``: the pass's reader of its ``"<name>.<option>"`` options (its frozen options class filled
    by :func:`pass_options`), so that :func:`check_options` refuses a misspelt option up front, where
    the pass alone would ignore it. ``retry_before``: a pass this one may also run just before, when
    the pipeline runs it after that one: where a rung of :meth:`PassManager.ladder` misses its budget
    even with its lowest plan, the ladder plans that order too and keeps the lower plan. The order is
    the pass's to know, not the pipeline's. ``alone(graph, options)``: True when the pass would act on
    ``graph``, and should then be given each rung's budget alone, the other passes choosing as on the
    rung before, as one more plan for the rung: a pass whose plans cost less time than the others' for
    the same memory (``offload``: copies that overlap the step, where recomputation adds ops) gets the
    budget before they spend time on it. ``variants(graph, options)``: other settings of the pass's own
    options (each a mapping of ``"<name>.<option>"`` keys) with which the whole pipeline is planned too,
    where a choice of the pass changes what later passes can do and neither setting wins on every model
    (see :meth:`PassManager.run`); empty where the pass would not act, or the user set those options.
    """

    def add(f: PassFn) -> PassFn:
        if name in _REGISTRY:
            raise ValueError(f"a pass named {name!r} is already registered")
        if not name.isidentifier():
            raise ValueError(f"pass names are identifiers; {name!r} is not")
        _REGISTRY[name] = _Registered(f, options, retry_before, alone, variants)
        return f

    return add(fn) if fn is not None else add


def registered_passes() -> tuple[str, ...]:
    _load_builtin_passes()
    return tuple(_REGISTRY)


def _load_builtin_passes() -> None:
    import memplan.passes  # noqa: F401  (registers the built-in passes)


def parse_pipeline(pipeline: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"inplace,remat"`` -> ``("inplace", "remat")``; unknown names list the valid ones.

    Examples
    --------
    >>> parse_pipeline("")
    ()
    """
    _load_builtin_passes()
    if pipeline is None:
        return ()
    names = [p.strip() for p in pipeline.split(",")] if isinstance(pipeline, str) else list(pipeline)
    names = [n for n in names if n]
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"unknown pass(es) {unknown}; registered passes are {sorted(_REGISTRY)}")
    return tuple(names)


def check_options(options: Mapping[str, Any]) -> None:
    """Every pass option names a pass that takes options and one of its fields, with a value it takes
    (a misspelt key was ignored: the option silently did nothing)."""
    _load_builtin_passes()
    readers = {name: entry.options for name, entry in _REGISTRY.items() if entry.options is not None}
    for key in options:
        if not isinstance(key, str) or key.split(".", 1)[0] not in readers or "." not in key:
            raise ValueError(f"unknown pass option {key!r}: options are named '<pass>.<option>' for the passes "
                             f"{', '.join(sorted(readers))} (e.g. 'chunk.counts'); each pass's module documents its own")
    for name in sorted(readers):
        readers[name](options)  # an unknown field, or a value of the wrong type, raises naming the valid ones


def pass_options(cls: type[T], prefix: str, options: Mapping[str, Any]) -> T:
    """The frozen dataclass ``cls`` filled from the ``"<prefix>.<field>"`` keys of ``options``.

    Keys of other passes are ignored; an unknown key of this pass is an error naming the valid ones.
    Lists become tuples (the dataclasses are frozen and hashable); numbers and strings are converted to
    the type of the field's default (``"64"`` for an ``int`` field is 64); a bool field takes only a bool.

    Examples
    --------
    >>> @dataclasses.dataclass(frozen=True)
    ... class Options:
    ...     alignment: int = 64
    ...     ops: tuple = ()
    >>> pass_options(Options, "arena", {"arena.alignment": "128", "arena.ops": ["mm"], "remat.x": 1})
    Options(alignment=128, ops=('mm',))
    >>> pass_options(Options, "arena", {"arena.align": 8})
    Traceback (most recent call last):
    ...
    ValueError: unknown arena option(s) ['arena.align']; valid ones are ['arena.alignment', 'arena.ops']
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    mine = {key[len(prefix) + 1:]: value for key, value in options.items() if key.startswith(prefix + ".")}
    unknown = sorted(f"{prefix}.{name}" for name in mine if name not in fields)
    if unknown:
        valid = sorted(f"{prefix}.{name}" for name in fields)
        raise ValueError(f"unknown {prefix} option(s) {unknown}; valid ones are {valid}")
    values = {}
    for name, value in mine.items():
        default = fields[name].default
        if isinstance(value, (list, tuple)):
            value = tuple(value)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"option {prefix}.{name} takes True or False, not {value!r}")
        elif isinstance(default, (int, float, str)) and not isinstance(value, type(default)):
            value = type(default)(value)
        values[name] = value
    return cls(**values)


# ----------------------------------------------------------------------------------------------
# verification


def mutation_hazards(graph: CapturedGraph, am: AnalysisManager) -> frozenset[tuple[str, str]]:
    """``(writer, reader)`` pairs: ``reader`` reads, after ``writer`` wrote it, a storage through a node
    defined before the write. In a graph from eager code these are the user's own aliasing; a pass must
    not add any. Taking a view is not a read (``buf.select(0, i)`` made before a write to ``buf`` reads
    nothing); the view's own readers are checked, since the view is a member of the storage. A read of
    elements the write does not reach is no hazard (``buf[0]`` read after a write to ``buf[1]``).

    Per storage, a sweep in graph order: a member (a node aliasing the storage) is *open* from where it
    is defined until its last reader, and a write can only clobber the open members. So a storage
    written at every step of a long loop (a gradient accumulated in place) costs its members and writes
    once each, not their product.
    """
    tensors, liveness = am.get(Tensors), am.get(Liveness)
    position = liveness.position
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    # Step 1: the writes into each storage, in graph order.
    writes: dict[int, list[tuple[int, torch.fx.Node, torch.fx.Node]]] = {}
    for node in graph.gm.graph.nodes:
        if node.op != "call_function":
            continue
        for target in mutated_args(node):
            for sid in tensors.storages_of(target.name):
                writes.setdefault(sid, []).append((position[node.name], node, target))
    hazards = set()
    readers_of: dict[str, tuple[int, list[tuple[int, str]]]] = {}  # member -> (last read, reads)
    for sid, storage_writes in writes.items():
        # Step 2: the members by where they are defined.
        opened = sorted((position.get(member, -1), member) for member in tensors.storages[sid].members)
        # Step 3: sweep the writes in order, keeping the members defined before each write and read after.
        # A member's reads (views and the output read no data: their readers are members) are listed when
        # a write first finds it defined: most members of an unrolled loop's storages come after its last write.
        storage_writes.sort(key=lambda item: item[0])
        open_members: list[tuple[int, str]] = []  # (last read, member)
        following = 0
        for p, node, target in storage_writes:
            while following < len(opened) and opened[following][0] < p:
                start, member = opened[following]
                if member not in readers_of:
                    reads = [(position[u.name], u.name) for u in by_name[member].users
                             if u.op != "output" and not is_pure_view(u)]
                    readers_of[member] = (max((q for q, _ in reads), default=-1), reads)
                last = readers_of[member][0]
                if last > start:
                    open_members.append((last, member))
                following += 1
            open_members = [(last, member) for last, member in open_members if last > p]
            if not open_members:
                continue
            value = target.meta.get("val")
            written = element_span(value)
            for _, member in open_members:
                if member == node.name:
                    continue
                other = by_name[member].meta.get("val")
                if not _overlap(written, element_span(other)) or not elements_overlap(value, other):
                    continue  # the spans apart, or interleaved without a common element (a buffer's columns)
                for q, reader in readers_of[member][1]:
                    if q > p:
                        hazards.add((node.name, reader))
    return frozenset(hazards)


def _hazard_message(new: frozenset[tuple[str, str]]) -> str:
    writer, reader = sorted(new)[0]
    return f"in-place write by {writer} clobbers a value {reader} still reads afterwards ({len(new)} such hazard(s))"


def element_span(value: Any) -> tuple[int, int] | None:
    """``(first, last)`` element offsets in its storage that a tensor can touch; None: unknown (all).

    Examples
    --------
    >>> buf = torch.zeros(4, 3)
    >>> element_span(buf[1]), element_span(buf[:, 2]), element_span(buf.t())
    ((3, 5), (2, 11), (0, 11))
    """
    if not isinstance(value, torch.Tensor):
        return None
    if value.numel() == 0:
        return (0, -1)
    offset = int(value.storage_offset())
    return offset, offset + sum((int(n) - 1) * int(s) for n, s in zip(value.shape, value.stride()))


def elements_overlap(a: Any, b: Any, limit: int = 4096) -> bool:
    """Whether two tensors of one storage can share an element, exactly for strided views: whether
    ``offset(a) + sum(i_k * stride_k) == offset(b) + sum(j_k * stride_k')`` has a solution. True when
    unknown (not tensors, or the search takes more than ``limit`` steps).

    Both index sets are searched together, largest stride first: at each stride the difference of the
    two indices is bounded by what the smaller strides can still make up, so interleaved slices (the
    columns ``[:, 0:4]`` and ``[:, 8:12]`` of a ``(B, 12)`` buffer, whose element spans overlap) are
    told apart in a few steps.

    Examples
    --------
    >>> buf = torch.zeros(4, 12)
    >>> elements_overlap(buf[:, 0:4], buf[:, 8:12]), elements_overlap(buf[:, 0:9], buf[:, 8:12])
    (False, True)
    >>> elements_overlap(buf[1], buf[:, 3]), elements_overlap(buf[0], buf[1])
    (True, False)
    """
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return True
    if a.numel() == 0 or b.numel() == 0:
        return False
    # stride -> extent of each dimension that moves; a stride used by several dimensions of one tensor
    # (a broadcast view) falls back to the spans
    moving_a = [(int(s), int(n)) for n, s in zip(a.shape, a.stride()) if n > 1 and s != 0]
    moving_b = [(int(s), int(n)) for n, s in zip(b.shape, b.stride()) if n > 1 and s != 0]
    extent_a, extent_b = dict(moving_a), dict(moving_b)
    if len(extent_a) != len(moving_a) or len(extent_b) != len(moving_b):
        return _overlap(element_span(a), element_span(b))
    order = sorted(set(extent_a) | set(extent_b), reverse=True)
    rows = [(s, extent_a.get(s, 1), extent_b.get(s, 1)) for s in order]
    # what the dimensions from k on can still add: up to reach_a above, down to reach_b below
    reach_a = [0] * (len(rows) + 1)
    reach_b = [0] * (len(rows) + 1)
    for k in range(len(rows) - 1, -1, -1):
        s, na, nb = rows[k]
        reach_a[k] = reach_a[k + 1] + (na - 1) * s
        reach_b[k] = reach_b[k + 1] + (nb - 1) * s
    steps = [0]

    def solve(k: int, target: int) -> bool:
        # is target == sum over dimensions k.. of (i - j) * stride, i < na, j < nb?
        steps[0] += 1
        if steps[0] > limit:
            raise OverflowError
        if k == len(rows):
            return target == 0
        s, na, nb = rows[k]
        low = max(-(nb - 1), -((reach_a[k + 1] - target) // s))  # d * s >= target - reach_a[k + 1]
        high = min(na - 1, (target + reach_b[k + 1]) // s)  # d * s <= target + reach_b[k + 1]
        return any(solve(k + 1, target - d * s) for d in range(low, high + 1))

    try:
        return solve(0, int(b.storage_offset()) - int(a.storage_offset()))
    except OverflowError:
        return True


def _overlap(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    return a is None or b is None or (a[0] <= b[1] and b[0] <= a[1])


def verify(graph: CapturedGraph, am: AnalysisManager) -> None:
    """Raise ``AssertionError`` describing the first broken invariant (the pipeline wraps it).

    The graph checks are those of ``torch.fx.Graph.lint`` (nodes owned by the graph and in its lookup
    table, arguments defined before their readers, unique names, call targets callable, attribute
    targets present), made in the same walk as memplan's own (every op has a phase and a fake value, no
    forward op reads a backward value): after each pass of a long unrolled loop, fx's lint alone took
    a fifth of a second, most of it formatting a message for every argument it checked."""
    fx_graph = graph.gm.graph
    phases = graph.phases
    indexed = _lookup_keys(fx_graph)
    seen: set[torch.fx.Node] = set()
    names: set[str] = set()
    for node in fx_graph.nodes:
        if node.graph is not fx_graph:
            raise AssertionError(f"node {node.name} does not belong to this graph")
        if indexed is not None:
            key = indexed.get(node)
            if key is None or key[0] != node.op or (node.op == "call_function" and key[1] is not node.target):
                raise AssertionError(f"node {node.name} is missing from (or stale in) the graph's lookup table")
        inputs = node.all_input_nodes
        for arg in inputs:
            if arg not in seen:
                where = "belongs to another graph" if arg.graph is not fx_graph else "is used before it is defined"
                raise AssertionError(f"argument {arg.name} of node {node.name} {where}")
        seen.add(node)
        if node.name in names:
            raise AssertionError(f"node name {node.name} is defined twice")
        names.add(node.name)
        op = node.op
        if op != "call_function":
            if op not in _LEGAL_OPS:
                raise AssertionError(f"node {node.name} has unknown opcode {op}")
            if not isinstance(node.target, str):
                raise AssertionError(f"node {node.name} ({op}) has target {node.target!r}, not a name")
            if op in ("get_attr", "call_module"):
                _check_attribute(graph.gm, node)
            continue
        if not callable(node.target):
            raise AssertionError(f"node {node.name} calls {node.target!r}, which is not callable")
        phase = phases.get(node.name)
        if phase is None:
            raise AssertionError(f"node {node.format_node()} has no forward/backward phase")
        if phase is Phase.FORWARD:
            for arg in inputs:
                if phases.get(arg.name) is Phase.BACKWARD:
                    raise AssertionError(f"forward node {node.name} reads backward node {arg.name}")
        if "val" not in node.meta:
            raise AssertionError(f"node {node.format_node()} has no fake value (shape information)")


_LEGAL_OPS = frozenset({"placeholder", "call_method", "call_module", "call_function", "get_attr", "output"})


def _lookup_keys(fx_graph: torch.fx.Graph) -> dict[torch.fx.Node, tuple] | None:
    """Each node of fx's lookup table (``graph.find_nodes``) with the key it is filed under; None when
    this fx keeps no such table."""
    table = getattr(getattr(fx_graph, "_find_nodes_lookup_table", None), "table", None)
    if table is None:
        return None
    return {node: key for key, group in table.items() for node in group}


def _check_attribute(gm: torch.nn.Module, node: torch.fx.Node) -> None:
    owner: Any = gm
    for atom in node.target.split("."):
        owner = getattr(owner, atom, None)
        if owner is None:
            raise AssertionError(f"node {node.name} reads attribute {node.target}, which the module lacks")
    if node.op == "call_module" and not isinstance(owner, torch.nn.Module):
        raise AssertionError(f"node {node.name} calls {node.target}, which is not a module")


# ----------------------------------------------------------------------------------------------
# the manager


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """One pass's run: what it did and the predicted peak (graph lifetimes) before and after."""

    name: str
    changed: bool
    stats: PassStats
    notes: tuple[str, ...]
    seconds: float
    peak_before: int
    peak_after: int
    plan: Any = None
    rolled_back: str | None = None  # what the pass did wrong, when its change was rolled back
    time_before: float = 0.0  # predicted seconds of the plan's step before and after the pass (the time model)
    time_after: float = 0.0


@dataclasses.dataclass(frozen=True)
class PipelineResult:
    """The last graph, a record per pass, and the analyses of the last graph (computed on demand)."""

    graph: CapturedGraph
    records: tuple[PassRecord, ...]
    analyses: AnalysisManager | None = None
    eager_time: float = 0.0  # predicted seconds of eager's step (see memplan.analysis.cost.eager_seconds)
    plan_time: float = 0.0  # predicted seconds of the last graph's step

    @property
    def overhead(self) -> float:
        """The plan's predicted step time over eager's, minus one (what ``max_overhead`` bounds)."""
        return self.plan_time / self.eager_time - 1.0 if self.eager_time > 0 else 0.0

    @property
    def rolled_back(self) -> tuple[str, ...]:
        """The passes whose change was rolled back (their records say why)."""
        return tuple(r.name for r in self.records if r.rolled_back is not None)

    def graph_analyses(self) -> AnalysisManager:
        """The run's analyses when they are of its last graph (computing them again takes seconds on an
        unrolled loop), else a new manager of that graph."""
        if self.analyses is not None and self.analyses.graph is self.graph:
            return self.analyses
        return AnalysisManager(self.graph)


Instrument = Callable[[str, CapturedGraph], None]

#: Each budgeted rung of :meth:`PassManager.ladder` aims this fraction of the lowest peak before it.
LADDER_STEP = 0.85


class PassManager:
    """Runs a pipeline of registered passes with verification after each change.

    Parameters
    ----------
    pipeline : str or sequence of str
        Pass names, e.g. ``"inplace,schedule"``.
    policy : Policy
    reproducer_dir : path, optional
        Where to save a reproducer when a pass fails (when rolling back without it, a folder
        ``memplan-repro-<pass>-<hash>`` of the temporary directory).
    on_failure : {"rollback", "raise"}, optional
        What happens when a pass raises, breaks an invariant or lies about ``changed``: the plan is
        made without that pass's change and a :class:`~memplan.errors.PassRolledBackWarning` names the
        pass, what broke, the user's line of the node involved and the saved reproducer
        (``"rollback"``); or :class:`~memplan.errors.PassError` is raised (``"raise"``: for tests, and
        for people writing passes). None (the default): the mode of the enclosing
        :func:`pass_failures` block, ``"rollback"`` outside any. An
        :class:`~memplan.errors.InfeasibleBudgetError` or out-of-memory error raised inside a pass is
        never rolled back (it raises :class:`~memplan.errors.PassError`, as under ``"raise"``).
    before_pass, after_pass : callables ``(name, graph)``, optional
        Instrumentation hooks (called again for the passes before a failing one, which run again).
    rates : CostRates or {"reference", "calibrated"}, optional
        The time model's rates (see :func:`memplan.analysis.cost.rates_for`; None: as it says).

    Time
    ----
    ``max_overhead`` bounds the whole plan, by one time model (:mod:`memplan.analysis.cost`): after each
    pass the plan's predicted step time is at most ``1 + max_overhead`` times the fastest plan the
    pipeline has had so far (the capture, or faster once a pass saved time), plus the room eager's own
    autograd bookkeeping leaves (eager's predicted step less the capture's). So the whole plan stays
    within ``max_overhead`` of eager's predicted step, the passes share one allowance instead of each
    taking it again, and time a pass saves (a broadcast matmul rewritten ten times faster) is kept, not
    spent by a later pass on a few percent of memory. Each pass runs under the policy with
    ``max_overhead`` set to what is left, as a share of the predicted time of the graph it is given (the
    share its own candidates' overheads are counted in).

    Rollback
    --------
    A pass may edit the graph it is given, so the manager keeps a copy of the first graph when a
    failure may need it. When pass *i* fails: (1) the graph it was given is made again (the copy, run
    through the passes before *i*) and saved as the reproducer; (2) the passes run again from the copy
    without *i*, whose record says ``rolled_back``. When the in-place hazard check on the last graph
    fails (see the module docstring), the passes run again from the copy with the check after each,
    which names the pass that added the hazard; that pass is then rolled back as above. A failure
    costs a few runs of the pipeline; a run without one costs nothing when the caller hands over the
    unedited graph it copied (``pristine=``, as ``memplan.optimize`` and the ladder do), else one copy.
    """

    def __init__(
        self,
        pipeline: str | Sequence[str] | None,
        policy: Policy | None = None,
        *,
        options: Mapping[str, Any] | None = None,
        reproducer_dir: str | pathlib.Path | None = None,
        on_failure: str | None = None,
        before_pass: Instrument | None = None,
        after_pass: Instrument | None = None,
        rates: CostRates | str | None = None,
    ):
        self.passes = parse_pipeline(pipeline)
        self.rates = rates
        self.policy = policy or Policy()
        self.options = dict(options or {})
        self.reproducer_dir = pathlib.Path(reproducer_dir) if reproducer_dir is not None else None
        self.on_failure = _check_mode(on_failure) if on_failure is not None else None
        self.before_pass = before_pass
        self.after_pass = after_pass
        # The ladder plans one graph many times, and a pass that fails on one plan fails on the others
        # alike: one reproducer per (pass, what it did wrong), and one warning.
        self._rolled_back: dict[tuple[str, str], pathlib.Path | None] = {}
        # (pass, what it did wrong) -> why its reproducer could not be written: a failure to save must
        # never hide the pass's own failure, nor turn a rolled-back pass into a failed plan
        self._unsaved: dict[tuple[str, str], str] = {}
        self._warned: set[tuple[str, str]] = set()

    @property
    def pipeline(self) -> str:
        return ",".join(self.passes)

    def run(self, graph: CapturedGraph, known: Mapping[type, Any] | None = None,
            pristine: CapturedGraph | None = None) -> PipelineResult:
        """Run the passes on ``graph`` and return the last graph with a record per pass.

        ``known``: analyses of ``graph`` the caller already has, by class, that do not read
        ``graph.lifetimes`` (the pipeline plans with graph lifetimes), e.g. the :class:`Tensors` of the
        graph ``graph`` was copied from: a copy has the same nodes, order and fake values.

        ``pristine``: the graph ``graph`` was copied from, when the caller keeps it unedited: a rollback
        starts again from a copy of it, which saves copying ``graph`` before the first pass.

        Without a budget (or with one and ``when_over`` other than ``"raise"``), the passes run once,
        editing ``graph`` in place, each choosing under the policy.

        With a budget, the plan is the first rung of a fixed ladder of plans that fits it
        (:meth:`ladder`); ``graph`` is left as it is. The ladder does not depend on the budget and its
        peaks only fall from rung to rung, so the chosen peak never rises as the budget falls, which a
        budget handed to every pass does not promise (a pass that reaches a tighter budget alone can
        leave a later pass less to gain). When no rung fits,
        :class:`~memplan.errors.InfeasibleBudgetError` names the smallest peak of the ladder.
        """
        fraction = self.policy.fraction
        if fraction is not None:  # a share of the peak of the model as written, as a step counts it
            eager = AnalysisManager(dataclasses.replace(graph, lifetimes="eager"), known=known).get(PeakSimulation).peak
            self.policy = self.policy.in_bytes(eager + (step_margin(graph) if graph.training else 0))
        try:
            return self._run_with_budget(graph, known, pristine, fraction)
        finally:
            if fraction is not None:
                self.policy = dataclasses.replace(self.policy, budget=None, fraction=fraction)

    def _run_with_budget(self, graph: CapturedGraph, known: Mapping[type, Any] | None,
                         pristine: CapturedGraph | None, fraction: float | None) -> PipelineResult:
        budget = self.policy.budget
        if budget is None or self.policy.when_over != "raise":
            return self._with_variants(graph, known, pristine)
        smallest = lowest = None
        for result, peak in self.ladder(graph, known):
            smallest, lowest = peak, result
            if peak <= budget:
                return result
        holders = _holders(lowest)
        margin = step_margin(graph) if graph.training else 0
        # memplan's own passes that could lower a peak and are not in the pipeline (arena only places
        # what is live)
        missing = [name for name in sorted(_REGISTRY) if name not in self.passes and name != "arena"
                   and getattr(_REGISTRY[name].fn, "__module__", "").startswith("memplan.passes.")]
        raise InfeasibleBudgetError(
            f"no plan of the pipeline {','.join(self.passes) or '(empty)'} fits the budget of "
            f"{format_bytes(budget)}" + (f" ({fraction:.0%} of the model's own peak)" if fraction is not None else "")
            + f": the smallest peak its plans reach is {format_bytes(smallest)}"
            + (f" (a whole training step as memplan.measure counts it: the plan's {format_bytes(smallest - margin)} "
               f"and {format_bytes(margin)} of the step's loss and its gradient)" if margin else "")
            + (f", held there by {'; '.join(holders)}" if holders else "") + ". Fix: raise the budget, "
            "lower the batch size" + (f", or add the passes {', '.join(missing)}" if missing else "") + ".",
            smallest=smallest,
            holders=holders,
        )

    def _with_variants(self, graph: CapturedGraph, known: Mapping[type, Any] | None,
                       pristine: CapturedGraph | None) -> PipelineResult:
        """The passes run once under the policy, and again with each setting a pass registered as a
        variant (``register_pass(variants=)``) for ``graph``: the plan with the lowest step peak whose
        predicted step time is within the whole pipeline's allowance (eager's time plus ``max_overhead``
        of the plan's before any pass), or no slower than the first plan.

        A pass's choice can close doors a later pass would open: ``rewrite``'s batch norm output made
        again (j) took the zoo's small ResNet from 147 to 137 KiB, after which remat found nothing, where
        remat alone reaches 105 KiB; on MobileViT the first is lower. Variants run from copies of the
        graph before any pass, only where the pass would act.
        """
        variants = [(name, variant) for name in dict.fromkeys(self.passes)
                    if _REGISTRY[name].variants is not None
                    for variant in _REGISTRY[name].variants(graph, self.options)]
        if not variants:
            return self._run(graph, self.policy, known, pristine=pristine)
        source = pristine if pristine is not None else _snapshot(graph)
        start = graph_cost(source, rates_for(self.rates, run_device(source)))
        result = self._run(graph, self.policy, known, pristine=pristine)
        allowed = max(result.plan_time, result.eager_time + self.policy.max_overhead * start)
        best, best_peak, why = result, _step_peak(result), None
        options = self.options
        for name, variant in variants:
            self.options = {**options, **variant}
            try:
                planned = self._run(copy_graph(source), self.policy, known, pristine=source)
            finally:
                self.options = options
            peak = _step_peak(planned)
            if planned.plan_time <= allowed and (peak, planned.plan_time) < (best_peak, best.plan_time):
                setting = ", ".join(f"{k}={v!r}" for k, v in variant.items())
                why = (name, f"the pipeline planned again with {setting}: a lower peak ({format_bytes(peak)} "
                             f"against {format_bytes(_step_peak(result))})")
                best, best_peak = planned, peak
        if why is None:
            return best
        records = tuple(dataclasses.replace(r, notes=r.notes + (why[1],)) if r.name == why[0] else r
                        for r in best.records)
        return dataclasses.replace(best, records=records)

    def ladder(self, graph: CapturedGraph, known: Mapping[type, Any] | None = None) -> Iterator[tuple[PipelineResult, int]]:
        """Plans of ``graph`` from the least extra compute to the lowest peak, with their step peaks.

        The first rung is the plan with no extra compute (``max_overhead=0``). Each later rung is the
        plan for a budget of :data:`LADDER_STEP` times the lowest peak so far: its passes first choose
        with ``when_over="overhead"`` (a later pass may reach the budget), then, if the pipeline misses
        it, with ``when_over="lowest"``, and if that misses it too, with each pass run just before the
        one it registered ``retry_before=`` (the lower of the two is the rung): ``timesteps`` before
        ``remat``, since remat's lowest plan on its own may recompute an unrolled loop's states all at
        once, which leaves timesteps no saved step to checkpoint (``nn.LSTMCell`` unrolled). The ladder
        ends at a rung that misses its budget (kept when it is still lower than every rung before it).
        Where a pass registered ``alone=`` and would act on the graph (``offload`` with a host tier and
        something to move), each rung is also planned with the budget given to that pass alone on top of the
        rung before, and that plan is the rung's when it fits at a lower predicted time (or the other misses). A rung predicted beyond ``max_overhead`` is
        replaced by the plan without a budget when that plan fits the rung's budget at no more time (a
        deep MLP planned for CUDA had a 1.81 GiB rung at 1.36x eager's time beside a 1.38 GiB plan at 1.20x).
        Nothing here reads the policy's budget, so for any budget the first rung that fits is the same
        walk cut short. The price: a budget just below a rung gets the next one, whose peak (and compute)
        may be lower than the budget needs. Rungs are built lazily, one pipeline run or two each, from
        copies of ``graph``. After the last rung comes the plan without a budget (at the policy's
        ``max_overhead``) when its peak is lower still, so a budget that the unbudgeted plan meets is never
        refused. ``known``: as for :meth:`run`.
        """
        first = dataclasses.replace(self.policy, budget=None, max_overhead=0.0)
        result = self._run(copy_graph(graph), first, known, pristine=graph)
        lowest = _step_peak(result)
        yield result, lowest
        retry_order = self._retry_order()
        alone = [name for name in self.passes
                 if _REGISTRY[name].alone is not None and _REGISTRY[name].alone(graph, self.options)]
        previous: tuple[Policy, Mapping[str, Policy] | None] = (first, None)  # how the rung before was planned
        within = dataclasses.replace(self.policy, budget=None)
        unbudgeted: PipelineResult | None = None  # the plan within max_overhead, made when first needed
        while True:
            target = int(lowest * LADDER_STEP)
            budgeted = dataclasses.replace(self.policy, budget=target, when_over="overhead")
            result = self._run(copy_graph(graph), budgeted, known, pristine=graph)
            peak = _step_peak(result)
            chosen: tuple[Policy, Mapping[str, Policy] | None] = (budgeted, None)
            fitting: list[tuple[PipelineResult, int, tuple[Policy, Mapping[str, Policy] | None]]] = []

            def consider(plan: PipelineResult, how: tuple[Policy, Mapping[str, Policy] | None]) -> None:
                plan_peak = _step_peak(plan)
                if plan_peak <= target:
                    fitting.append((plan, plan_peak, how))

            consider(result, chosen)
            # The passes that asked for a rung's budget alone (see register_pass) get it on top of the
            # rung before, the others choosing as they did there.
            if alone:
                base, overrides = previous[0], {**(previous[1] or {}), **{n: budgeted for n in alone}}
                consider(self._run(copy_graph(graph), base, known, pristine=graph, overrides=overrides), (base, overrides))
            # A rung beyond the time allowance may be beaten on both counts by the plan within it (its passes
            # choosing the lowest peak each, where the rung's took what met the budget first).
            if peak <= target and result.plan_time > (1.0 + self.policy.max_overhead) * result.eager_time:
                if unbudgeted is None:
                    unbudgeted = self._run(copy_graph(graph), within, known, pristine=graph)
                consider(unbudgeted, (within, None))
            if fitting:  # the rung: the fastest plan that fits it, the lower peak among equals
                result, peak, chosen = min(fitting, key=lambda item: (item[0].plan_time, item[1]))
            else:
                lowest_policy = dataclasses.replace(self.policy, budget=target, when_over="lowest")
                result = self._run(copy_graph(graph), lowest_policy, known, pristine=graph)
                peak = _step_peak(result)
                chosen = (lowest_policy, None)
                if peak > target and retry_order is not None:
                    # A pass run after the one it registered retry_before= may find less to gain there
                    # (remat's lowest plan leaves timesteps no saved step to checkpoint): before it may go lower.
                    other = self._run(copy_graph(graph), lowest_policy, known, passes=retry_order, pristine=graph)
                    other_peak = _step_peak(other)
                    if other_peak < peak:
                        result, peak = other, other_peak
            if peak >= lowest:
                break
            lowest = peak
            previous = chosen
            yield result, peak
            if peak > target:
                break  # the lowest plan for a budget it misses: no later rung gets lower
        # Last, the plan without a budget, when it is lower: each pass choosing under max_overhead alone can
        # end lower than the rungs, whose early passes took what met the rung's budget on their own and
        # left the later passes less to gain (chunk loops that remat can neither save nor recompute).
        result = unbudgeted if unbudgeted is not None else self._run(copy_graph(graph), within, known, pristine=graph)
        peak = _step_peak(result)
        if peak < lowest:
            yield result, peak

    def _retry_order(self) -> tuple[str, ...] | None:
        """The pipeline with each pass that runs after the pass it registered ``retry_before=`` moved just
        before that pass (None when no pass does)."""
        order = list(self.passes)
        for name in dict.fromkeys(self.passes):
            other = _REGISTRY[name].retry_before
            if other is None or other not in order or order.index(name) < order.index(other):
                continue
            order = [n for n in order if n != name]
            order.insert(order.index(other), name)
        return tuple(order) if order != list(self.passes) else None

    def _run(self, graph: CapturedGraph, policy: Policy, known: Mapping[type, Any] | None = None,
             passes: Sequence[str] | None = None, pristine: CapturedGraph | None = None,
             overrides: Mapping[str, Policy] | None = None) -> PipelineResult:
        """Run ``passes`` on ``graph``, rolling back or raising at a failing pass (see the class).
        ``pristine``: a graph equal to ``graph`` that nothing edits (the caller's, the ladder's), else a
        copy of ``graph`` is kept when a failure may need one. ``overrides``: the policy of some passes,
        by name, in place of ``policy`` (see :meth:`ladder`)."""
        passes = self.passes if passes is None else tuple(passes)
        graph = dataclasses.replace(graph, lifetimes="graph")
        rollback = self._mode() == "rollback"
        # In-place hazards are checked after every pass when a failure would save a reproducer (the
        # graph before the failing pass); otherwise once, on the last graph: a hazard there that the
        # first graph lacks was added by some pass and survived the later ones, which the check after
        # every pass would have caught too. On a long unrolled loop each check costs about half a second.
        # Rolling back, a failed last check runs the passes again with the check after each, which
        # names the pass to roll back: the cost falls on the run that found a broken pass.
        stepwise = self.reproducer_dir is not None
        rates = rates_for(self.rates, run_device(graph))
        timing = (rates, eager_seconds(pristine if pristine is not None else graph, rates))
        source = None
        if rollback or stepwise:
            source = dataclasses.replace(_snapshot(graph) if pristine is None else pristine, lifetimes="graph")
        baseline = None  # the hazards of the first graph, which every attempt starts from a copy of
        skipped: dict[int, str] = {}  # pass index -> what it did wrong (rolled back)
        while True:
            am = AnalysisManager(graph, known)
            if baseline is None:
                baseline = mutation_hazards(graph, am)
            try:
                return self._attempt(graph, am, policy, passes, baseline, stepwise, skipped, timing, overrides=overrides)
            except _PassFailed as failure:
                if rollback and failure.final and not stepwise:
                    stepwise = True  # again, checking after each pass, to find the pass that added it
                else:
                    path = self._save(failure, source, policy, known, passes, skipped, timing, overrides)
                    if not rollback or failure.fatal:
                        raise self._error(failure, passes, skipped, path) from failure.cause
                    skipped[failure.index] = failure.what
                    self._warn(failure, passes, skipped, path)
            graph = _snapshot(source)

    def _mode(self) -> str:
        return self.on_failure if self.on_failure is not None else failure_mode()

    def _attempt(self, graph: CapturedGraph, am: AnalysisManager, policy: Policy, passes: Sequence[str],
                 baseline: frozenset[tuple[str, str]], stepwise: bool, skipped: Mapping[int, str],
                 timing: tuple[CostRates, float], stop: int | None = None,
                 overrides: Mapping[str, Policy] | None = None) -> PipelineResult:
        """One run of ``passes`` on ``graph``, leaving out those in ``skipped`` (recorded as rolled back);
        raises :class:`_PassFailed` at the first failure. ``timing``: the rates and eager's predicted
        step time. ``stop``: return before that pass, without calling the hooks (the graph a failing pass
        was given, made again for its reproducer)."""
        hooks = stop is None
        names = None if stepwise else {(n.name, n.target) for n in graph.gm.graph.nodes}
        created: list[tuple[int, str, set[str]]] = []  # (index, pass, names of the nodes it added or retargeted)
        records = []
        rates, eager = timing
        predicted = graph_cost(graph, rates)  # predicted seconds of the plan so far
        room = max(0.0, eager - predicted)  # what eager's autograd costs and a plan does not
        fastest = predicted  # the fastest plan so far
        for i, name in enumerate(passes):
            if i == stop:
                break
            if i in skipped:
                peak = am.get(PeakSimulation).peak
                records.append(PassRecord(name, False, PassStats(), (f"rolled back: {skipped[i]}",), 0.0, peak, peak,
                                          rolled_back=skipped[i], time_before=predicted, time_after=predicted))
                continue
            if hooks and self.before_pass is not None:
                self.before_pass(name, graph)
            peak_before = am.get(PeakSimulation).peak
            own = overrides.get(name, policy) if overrides else policy
            ctx = PassContext(am=am, policy=_pass_policy(own, (1.0 + own.max_overhead) * fastest + room - predicted, predicted), options=self.options, rates=rates)
            start = time.perf_counter()
            try:
                result = _REGISTRY[name].fn(graph, ctx)
            except Exception as exc:
                what = f"raised {type(exc).__name__}" + (f": {exc}" if str(exc) else "")
                # a budget no plan meets, or memory running out, is not the pass's bug to leave out
                fatal = isinstance(exc, (InfeasibleBudgetError, MemoryError, torch.OutOfMemoryError))
                raise _PassFailed(i, name, what, graph, cause=exc, fatal=fatal) from exc
            seconds = time.perf_counter() - start
            if result.changed:
                new: frozenset[tuple[str, str]] = frozenset()
                try:
                    am.update(result.graph, result.preserved, computed=result.analyses)
                    verify(result.graph, am)
                    if stepwise:
                        hazards = mutation_hazards(result.graph, am)
                        new = hazards - baseline
                        baseline = hazards
                    am.get(PeakSimulation)
                except AssertionError as exc:
                    raise _PassFailed(i, name, f"broke an invariant: {exc}", result.graph, cause=exc) from exc
                except Exception as exc:  # an analysis failing on the pass's graph: the pass's fault too
                    what = f"left a graph memplan's analyses fail on ({type(exc).__name__}: {exc})"
                    raise _PassFailed(i, name, what, result.graph, cause=exc) from exc
                if new:
                    raise _PassFailed(i, name, f"broke an invariant: {_hazard_message(new)}", result.graph,
                                      nodes=sorted(new)[0])
                if not stepwise:
                    now = {(n.name, n.target) for n in result.graph.gm.graph.nodes}
                    created.append((i, name, {node for node, _ in now - names}))
                    names = now
                graph = result.graph
                later = graph_cost(graph, rates)
            elif result.graph is not graph:
                raise _PassFailed(i, name, "returned a new graph but reported changed=False", graph)
            peak_after = am.get(PeakSimulation).peak
            before, predicted = predicted, later if result.changed else predicted
            fastest = min(fastest, predicted)
            records.append(PassRecord(name, result.changed, result.stats, result.notes, seconds, peak_before, peak_after,
                                      result.plan, time_before=before, time_after=predicted))
            if hooks and self.after_pass is not None:
                self.after_pass(name, graph)
        if created and stop is None:
            new = mutation_hazards(graph, am) - baseline
            if new:
                # the pass named: the last one that added (or retargeted) the writer or the reader (the
                # last pass that changed the graph when neither was, the hazard coming from a new order)
                involved = set(sorted(new)[0])
                i, name, _ = next((c for c in reversed(created) if c[2] & involved), created[-1])
                what = f"broke an invariant: {_hazard_message(new)} (checked after the last pass; a reproducer_dir checks after each)"
                raise _PassFailed(i, name, what, graph, nodes=sorted(new)[0], final=True)
        return PipelineResult(graph, tuple(records), am, eager_time=eager, plan_time=predicted)

    def _save(self, failure: "_PassFailed", source: CapturedGraph | None, policy: Policy,
              known: Mapping[type, Any] | None, passes: Sequence[str],
              skipped: Mapping[int, str], timing: tuple[CostRates, float],
              overrides: Mapping[str, Policy] | None = None) -> pathlib.Path | None:
        """Save the failing pass's reproducer: the graph it was given (made again from ``source``, as the
        pass may have edited the one it had) and the pipeline from it on. None: nothing to save from."""
        key = (failure.name, failure.what)
        if key in self._rolled_back:
            return self._rolled_back[key]
        if source is None:
            return None
        rest = ",".join(p for j, p in enumerate(passes) if j >= failure.index and j not in skipped)
        before = _snapshot(source)
        try:
            am = AnalysisManager(before, known)
            before = self._attempt(before, am, policy, passes, mutation_hazards(before, am), False, skipped,
                                   timing, stop=failure.index, overrides=overrides).graph
        except _PassFailed:  # the passes before it failed this time: replay all of them from the first graph
            before = source
            rest = ",".join(p for j, p in enumerate(passes) if j not in skipped)
        where = self.reproducer_dir / f"memplan-repro-{failure.name}" if self.reproducer_dir is not None else None
        everything = ",".join(p for j, p in enumerate(passes) if j not in skipped)
        # the graph the failing pass was given; else (a pass's modules holding what torch.save cannot pickle,
        # such as a chunk loop's decomposed ops) the first graph, with every pass to replay from it
        attempts = [(before, rest)] + ([(source, everything)] if before is not source else [])
        path = None
        for graph_to_save, pipeline in attempts:
            try:
                path = save_reproducer(graph_to_save, pipeline, where, name=failure.name)
                break
            except Exception as exc:  # noqa: BLE001 - reported with the failure, never in its place
                self._unsaved[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        if path is not None:
            self._unsaved.pop(key, None)
        self._rolled_back[key] = path
        return path

    def _error(self, failure: "_PassFailed", passes: Sequence[str], skipped: Mapping[int, str],
               path: pathlib.Path | None) -> PassError:
        before = _ran_before(failure, passes, skipped)
        message = f"pass {failure.name!r} {failure.what}{_where(failure)}. Passes run before it: {before}."
        if path is not None:
            message += f" Reproducer saved to {path}; replay it with memplan.pipeline.replay({str(path)!r})."
        elif (failure.name, failure.what) in self._unsaved:
            message += f" Its reproducer could not be saved ({self._unsaved[failure.name, failure.what]})."
        else:
            message += " Pass reproducer_dir= to save a reproducer."
        return PassError(message)

    def _warn(self, failure: "_PassFailed", passes: Sequence[str], skipped: Mapping[int, str],
              path: pathlib.Path | None) -> None:
        if failure.warned_key() in self._warned:
            return
        self._warned.add(failure.warned_key())
        source = _user_source(failure)
        message = (
            f"memplan rolled back pass {failure.name!r}, which {failure.what}{_where(failure)}: the plan is made "
            f"without that pass's change, so it may use more memory than it would with it (passes run before "
            f"it: {_ran_before(failure, passes, skipped)}). "
            + (f"Reproducer saved to {path}; replay it with memplan.pipeline.replay({str(path)!r}). " if path else "")
            + (f"Its reproducer could not be saved ({self._unsaved[failure.name, failure.what]}). "
               if (failure.name, failure.what) in self._unsaved else "")
            + "This is a bug in the pass: please report it with the reproducer."
        )
        warnings.warn(
            PassRolledBackWarning(message, pass_name=failure.name, reason=failure.what,
                                  source=None if source is None else str(source[1]),
                                  reproducer=None if path is None else str(path)),
            stacklevel=user_stacklevel(),
        )


def _pass_policy(policy: Policy, left: float, now: float) -> Policy:
    """The policy a pass runs under when ``left`` seconds of the whole plan's allowance are left and the
    plan so far is predicted at ``now`` seconds: ``max_overhead`` becomes ``left`` as a share of ``now``,
    the share the pass counts its candidates' overheads in.

    >>> _pass_policy(Policy(max_overhead=0.3), left=2.0, now=8.0).max_overhead
    0.25
    >>> _pass_policy(Policy(max_overhead=0.3), left=-1.0, now=8.0).max_overhead
    0.0
    """
    if now <= 0:
        return policy
    return dataclasses.replace(policy, max_overhead=max(0.0, left) / now)


class _PassFailed(Exception):
    """A pass failed inside :meth:`PassManager._attempt`: which, what it did, and on which graph (the
    pass's result, or the graph it was given when it raised)."""

    def __init__(self, index: int, name: str, what: str, graph: CapturedGraph, *, cause: BaseException | None = None,
                 nodes: Sequence[str] = (), final: bool = False, fatal: bool = False):
        super().__init__(what)
        self.index, self.name, self.what, self.graph = index, name, what, graph
        self.cause, self.nodes, self.final, self.fatal = cause, tuple(nodes), final, fatal

    def warned_key(self) -> tuple[str, str]:
        return (self.name, self.what)


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _user_source(failure: _PassFailed) -> tuple[str, SourceLine] | None:
    """The first node the failure names (its writer and reader, else a node named in its message) that
    has a user's line, with that line."""
    sources = failure.graph.sources
    for name in (*failure.nodes, *_NAME.findall(failure.what)):
        source = sources.get(name)
        if source is not None:
            return name, source
    return None


def _where(failure: _PassFailed) -> str:
    found = _user_source(failure)
    return "" if found is None else f" (node {found[0]}, from the user's line {found[1]})"


def _ran_before(failure: _PassFailed, passes: Sequence[str], skipped: Mapping[int, str]) -> str:
    return ",".join(p for j, p in enumerate(passes[: failure.index]) if j not in skipped) or "(none)"


def _snapshot(graph: CapturedGraph) -> CapturedGraph:
    """A copy of ``graph`` that no pass run on another copy can change: its own nodes, and its own
    name-keyed mappings (a pass is to replace them, but one that edits them in place must not reach
    the graph the pipeline rolls back to)."""
    copied = copy_graph(graph)
    return dataclasses.replace(copied, phases=dict(graph.phases), sources=dict(graph.sources),
                               library_sources=dict(graph.library_sources), modules=dict(graph.modules),
                               seq_nr=dict(graph.seq_nr), released_after=dict(graph.released_after))


_ON_FAILURE: contextvars.ContextVar[str] = contextvars.ContextVar("memplan_pass_failures", default="rollback")


def _check_mode(mode: str) -> str:
    if mode not in ("raise", "rollback"):
        raise ValueError(f'on_failure must be "raise" or "rollback", not {mode!r}')
    return mode


@contextlib.contextmanager
def pass_failures(mode: str) -> Iterator[None]:
    """Within the block, a :class:`PassManager` made without ``on_failure=`` (``memplan.optimize``'s
    included, and its ``verify=True`` check) handles a failing pass as ``mode`` says: ``"raise"`` a
    :class:`~memplan.errors.PassError`, or ``"rollback"`` (the default outside any block). memplan's own
    tests run under ``"raise"``, so that a broken pass fails them rather than warn.

    Examples
    --------
    >>> with pass_failures("raise"):
    ...     PassManager("")._mode()
    'raise'
    >>> PassManager("")._mode()
    'rollback'
    """
    token = _ON_FAILURE.set(_check_mode(mode))
    try:
        yield
    finally:
        _ON_FAILURE.reset(token)


def failure_mode() -> str:
    """How failing passes are handled here: ``"raise"`` inside :func:`pass_failures` ``("raise")``,
    else ``"rollback"`` (what a :class:`PassManager` made without ``on_failure=`` does)."""
    return _ON_FAILURE.get()


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the user's line: the first frame, counted from
    the one calling ``warnings.warn``, outside memplan and torch (1 when there is none)."""
    frame, level = sys._getframe(2), 2
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith("<") or is_user_frame(filename):  # a file of the user's, or a REPL cell
            return level
        frame, level = frame.f_back, level + 1
    return 1


def _holders(result: PipelineResult | None, top: int = 3) -> tuple[str, ...]:
    """The largest tensors alive at the peak of ``result``'s plan, each with why it is alive and the
    user's line: what keeps the smallest reachable peak where it is."""
    if result is None:
        return ()
    explanation = explain_peak(result.graph, result.graph_analyses(), top=top, groups=False)
    return tuple(
        f"{format_bytes(row.nbytes)} of `{row.op}` ({row.reason}" + (f", {row.source}" if row.source else "") + ")"
        for row in explanation.tensors
    )


def _step_peak(result: PipelineResult) -> int:
    """The predicted peak of a step running ``result``'s graph, as budgets count it (with the step's loss
    scalars), from the analyses the run already made of that graph."""
    graph = result.graph
    return result.graph_analyses().get(PeakSimulation).peak + (step_margin(graph) if graph.training else 0)


# ----------------------------------------------------------------------------------------------
# reproducers


def save_reproducer(graph: CapturedGraph, pipeline: str, path: str | pathlib.Path | None = None, *,
                    name: str = "pipeline") -> pathlib.Path:
    """Save ``graph`` (code, constants, metadata, input shapes) and the pipeline to replay on it.

    ``path`` None: the folder ``memplan-repro-<name>-<hash>`` of the temporary directory, the hash
    that of the graph's code and the pipeline (the same failure is saved to the same folder)."""
    if path is None:
        digest = hashlib.sha1(f"{pipeline}\n{graph.gm.code}".encode()).hexdigest()[:12]
        path = pathlib.Path(tempfile.gettempdir()) / f"memplan-repro-{name}-{digest}"
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    inputs_meta = []
    for node in placeholders:
        val = node.meta["val"]
        inputs_meta.append(
            {"shape": list(val.shape), "stride": list(val.stride()), "dtype": str(val.dtype).replace("torch.", ""),
             "device": str(val.device), "requires_grad": bool(val.requires_grad)}
        )
    meta = {
        "pipeline": pipeline,
        "training": graph.training,
        "seed": graph.seed,
        "lifetimes": graph.lifetimes,
        "phases": {k: v.value for k, v in graph.phases.items()},
        "sources": {k: dataclasses.asdict(v) for k, v in graph.sources.items()},
        "library_sources": {k: dataclasses.asdict(v) for k, v in graph.library_sources.items()},
        "modules": dict(graph.modules),
        "seq_nr": dict(graph.seq_nr),
        "inputs": [dataclasses.asdict(s) for s in graph.inputs],
        "outputs": [dataclasses.asdict(s) for s in graph.outputs],
        "input_tensors": inputs_meta,
        "nodes": [n.name for n in graph.gm.graph.nodes],
    }
    (path / "meta.json").write_text(json.dumps(meta, indent=1))
    (path / "graph.py").write_text(graph.gm.code)
    torch.save(graph.gm, path / "graph.pt")
    (path / "pipeline.txt").write_text(pipeline + "\n")
    return path


def load_reproducer(path: str | pathlib.Path) -> tuple[CapturedGraph, str]:
    """A saved graph with its fake values restored (by fake-tensor propagation), and its pipeline."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    import torch.utils._pytree as pytree

    path = pathlib.Path(path)
    meta = json.loads((path / "meta.json").read_text())
    gm = torch.load(path / "graph.pt", weights_only=False)
    _restore_names(gm, meta.get("nodes"))
    mode = FakeTensorMode()
    fake_inputs = []
    for spec in meta["input_tensors"]:
        with mode:
            t = torch.empty_strided(spec["shape"], spec["stride"], dtype=getattr(torch, spec["dtype"]), device=spec["device"])
        fake_inputs.append(t.requires_grad_(spec["requires_grad"]) if t.is_floating_point() else t)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fake_inputs)
    graph = CapturedGraph(
        gm=gm,
        training=meta["training"],
        phases={k: Phase(v) for k, v in meta["phases"].items()},
        sources={k: SourceLine(**v) for k, v in meta["sources"].items()},
        library_sources={k: SourceLine(**v) for k, v in meta.get("library_sources", {}).items()},
        modules=dict(meta.get("modules", {})),
        seq_nr=meta["seq_nr"],
        inputs=tuple(InputSpec(**s) for s in meta["inputs"]),
        outputs=tuple(OutputSpec(**s) for s in meta["outputs"]),
        in_spec=pytree.tree_flatten(((), {}))[1],
        out_spec=pytree.tree_flatten(None)[1],
        seed=meta["seed"],
        lifetimes=meta["lifetimes"],
    )
    return graph, meta["pipeline"]


def _restore_names(gm: torch.fx.GraphModule, names: Sequence[str] | None) -> None:
    """Give a loaded graph's nodes their saved names: loading traces the saved code again, which names
    each node after its op (``exp_default`` for ``exp``), while the graph's phases, sources and
    sequence numbers are keyed by the names it had."""
    if names is None:
        return
    nodes = list(gm.graph.nodes)
    if len(nodes) != len(names):
        raise ValueError(f"the reproducer's graph has {len(nodes)} nodes where {len(names)} were saved")
    renamed = torch.fx.Graph()
    value_map: dict[torch.fx.Node, torch.fx.Node] = {}
    for node, name in zip(nodes, names):
        args, kwargs = torch.fx.map_arg((node.args, node.kwargs), value_map.__getitem__)
        if node.op == "output":
            renamed.output(args[0])
            continue
        copied = create_node(renamed, node.op, node.target, args, kwargs, name, node.type)
        if copied.name != name:
            raise ValueError(f"could not give the loaded node {node.name} its saved name {name}")
        copied.meta = node.meta
        value_map[node] = copied
    gm.graph = renamed
    gm.recompile()


def replay(path: str | pathlib.Path, policy: Policy | None = None) -> PipelineResult:
    """Run a saved reproducer's pipeline on its graph (raises the same :class:`PassError` if it still fails)."""
    graph, pipeline = load_reproducer(path)
    return PassManager(pipeline, policy, on_failure="raise").run(graph)
