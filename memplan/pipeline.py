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
    writer or reader).

A failing pass raises :class:`~memplan.errors.PassError` naming it and the passes before it, and a
reproducer (graph, metadata, pipeline string) is saved when ``reproducer_dir`` is set;
:func:`replay` runs a pipeline on a saved reproducer.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.fx

from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.memory import MemoryAnalysis
from memplan.analysis.peak import PeakSimulation, step_margin
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, InputSpec, OutputSpec, Phase, SourceLine
from memplan.errors import InfeasibleBudgetError, PassError
from memplan.graphutil import copy_graph, is_pure_view, mutated_args
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
    "register_pass",
    "registered_passes",
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


PassFn = Callable[[CapturedGraph, PassContext], PassResult]
_REGISTRY: dict[str, PassFn] = {}


def register_pass(name: str, fn: PassFn | None = None) -> Any:
    """Register a pass under ``name`` (usable as a decorator). Registering a name twice is an error."""

    def add(f: PassFn) -> PassFn:
        if name in _REGISTRY:
            raise ValueError(f"a pass named {name!r} is already registered")
        if not name.isidentifier():
            raise ValueError(f"pass names are identifiers; {name!r} is not")
        _REGISTRY[name] = f
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
            written = element_span(target.meta.get("val"))
            for _, member in open_members:
                if member == node.name:
                    continue
                if not _overlap(written, element_span(by_name[member].meta.get("val"))):
                    continue
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


@dataclasses.dataclass(frozen=True)
class PipelineResult:
    """The last graph, a record per pass, and the analyses of the last graph (computed on demand)."""

    graph: CapturedGraph
    records: tuple[PassRecord, ...]
    analyses: AnalysisManager | None = None

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
        Where to save a reproducer when a pass fails.
    before_pass, after_pass : callables ``(name, graph)``, optional
        Instrumentation hooks.
    """

    def __init__(
        self,
        pipeline: str | Sequence[str] | None,
        policy: Policy | None = None,
        *,
        options: Mapping[str, Any] | None = None,
        reproducer_dir: str | pathlib.Path | None = None,
        before_pass: Instrument | None = None,
        after_pass: Instrument | None = None,
    ):
        self.passes = parse_pipeline(pipeline)
        self.policy = policy or Policy()
        self.options = dict(options or {})
        self.reproducer_dir = pathlib.Path(reproducer_dir) if reproducer_dir is not None else None
        self.before_pass = before_pass
        self.after_pass = after_pass

    @property
    def pipeline(self) -> str:
        return ",".join(self.passes)

    def run(self, graph: CapturedGraph, known: Mapping[type, Any] | None = None) -> PipelineResult:
        """Run the passes on ``graph`` and return the last graph with a record per pass.

        ``known``: analyses of ``graph`` the caller already has, by class, that do not read
        ``graph.lifetimes`` (the pipeline plans with graph lifetimes), e.g. the :class:`Tensors` of the
        graph ``graph`` was copied from: a copy has the same nodes, order and fake values.

        Without a budget (or with one and ``when_over`` other than ``"raise"``), the passes run once,
        editing ``graph`` in place, each choosing under the policy.

        With a budget, the plan is the first rung of a fixed ladder of plans that fits it
        (:meth:`ladder`); ``graph`` is left as it is. The ladder does not depend on the budget and its
        peaks only fall from rung to rung, so the chosen peak never rises as the budget falls, which a
        budget handed to every pass does not promise (a pass that reaches a tighter budget alone can
        leave a later pass less to gain). When no rung fits,
        :class:`~memplan.errors.InfeasibleBudgetError` names the smallest peak of the ladder.
        """
        budget = self.policy.budget
        if budget is None or self.policy.when_over != "raise":
            return self._run(graph, self.policy, known)
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
                   and getattr(_REGISTRY[name], "__module__", "").startswith("memplan.passes.")]
        raise InfeasibleBudgetError(
            f"no plan of the pipeline {','.join(self.passes) or '(empty)'} fits the budget of "
            f"{format_bytes(budget)}: the smallest peak its plans reach is {format_bytes(smallest)}"
            + (f" (a whole training step as memplan.measure counts it: the plan's {format_bytes(smallest - margin)} "
               f"and {format_bytes(margin)} of the step's loss and its gradient)" if margin else "")
            + (f", held there by {'; '.join(holders)}" if holders else "") + ". Fix: raise the budget, "
            "lower the batch size" + (f", or add the passes {', '.join(missing)}" if missing else "") + ".",
            smallest=smallest,
            holders=holders,
        )

    def ladder(self, graph: CapturedGraph, known: Mapping[type, Any] | None = None) -> Iterator[tuple[PipelineResult, int]]:
        """Plans of ``graph`` from the least extra compute to the lowest peak, with their step peaks.

        The first rung is the plan with no extra compute (``max_overhead=0``). Each later rung is the
        plan for a budget of :data:`LADDER_STEP` times the lowest peak so far: its passes first choose
        with ``when_over="overhead"`` (a later pass may reach the budget), then, if the pipeline misses
        it, with ``when_over="lowest"``, and if that misses it too, with ``timesteps`` run before
        ``remat`` (the lower of the two is the rung): remat's lowest plan on its own may recompute an
        unrolled loop's states all at once, which leaves timesteps no saved step to checkpoint
        (``nn.LSTMCell`` unrolled). The ladder ends at a rung that misses its budget (kept when it
        is still lower than every rung before it). Nothing here reads the policy's budget, so for any
        budget the first rung that fits is the same walk cut short. The price: a budget just below a
        rung gets the next one, whose peak (and compute) may be lower than the budget needs. Rungs are
        built lazily, one pipeline run or two each, from copies of ``graph``. After the last rung comes the
        plan without a budget (at the policy's ``max_overhead``) when its peak is lower still, so a budget
        that the unbudgeted plan meets is never refused. ``known``: as for :meth:`run`.
        """
        result = self._run(copy_graph(graph), dataclasses.replace(self.policy, budget=None, max_overhead=0.0), known)
        lowest = _step_peak(result)
        yield result, lowest
        loops_first = self._loops_first()
        while True:
            target = int(lowest * LADDER_STEP)
            result = self._run(copy_graph(graph), dataclasses.replace(self.policy, budget=target, when_over="overhead"), known)
            peak = _step_peak(result)
            if peak > target:
                lowest_policy = dataclasses.replace(self.policy, budget=target, when_over="lowest")
                result = self._run(copy_graph(graph), lowest_policy, known)
                peak = _step_peak(result)
                if peak > target and loops_first is not None:
                    # Recomputing an unrolled loop's states all at once (remat's lowest plan on its own)
                    # leaves timesteps no saved step to checkpoint; the loops checkpointed first may go lower.
                    other = self._run(copy_graph(graph), lowest_policy, known, passes=loops_first)
                    other_peak = _step_peak(other)
                    if other_peak < peak:
                        result, peak = other, other_peak
            if peak >= lowest:
                break
            lowest = peak
            yield result, peak
            if peak > target:
                break  # the lowest plan for a budget it misses: no later rung gets lower
        # Last, the plan without a budget, when it is lower: each pass choosing under max_overhead alone can
        # end lower than the rungs, whose early passes took what met the rung's budget on their own and
        # left the later passes less to gain (chunk loops that remat can neither save nor recompute).
        result = self._run(copy_graph(graph), dataclasses.replace(self.policy, budget=None), known)
        peak = _step_peak(result)
        if peak < lowest:
            yield result, peak

    def _loops_first(self) -> tuple[str, ...] | None:
        """The pipeline with ``timesteps`` moved just before ``remat`` (None when it does not run after it)."""
        if "remat" not in self.passes or "timesteps" not in self.passes:
            return None
        if self.passes.index("timesteps") < self.passes.index("remat"):
            return None
        order = [name for name in self.passes if name != "timesteps"]
        order.insert(order.index("remat"), "timesteps")
        return tuple(order)

    def _run(self, graph: CapturedGraph, policy: Policy, known: Mapping[type, Any] | None = None,
             passes: Sequence[str] | None = None) -> PipelineResult:
        passes = self.passes if passes is None else tuple(passes)
        graph = dataclasses.replace(graph, lifetimes="graph")
        am = AnalysisManager(graph, known)
        baseline_hazards = mutation_hazards(graph, am)
        # In-place hazards are checked after every pass when a failure would save a reproducer (the
        # graph before the failing pass); otherwise once, on the last graph: a hazard there that the
        # first graph lacks was added by some pass and survived the later ones, which the check after
        # every pass would have caught too. On a long unrolled loop each check costs about half a second.
        stepwise = self.reproducer_dir is not None
        names = None if stepwise else {(n.name, n.target) for n in graph.gm.graph.nodes}
        created: list[tuple[int, str, set[str]]] = []  # (index, pass, names of the nodes it added or retargeted)
        records = []
        for i, name in enumerate(passes):
            if self.before_pass is not None:
                self.before_pass(name, graph)
            peak_before = am.get(PeakSimulation).peak
            ctx = PassContext(am=am, policy=policy, options=self.options)
            start = time.perf_counter()
            try:
                result = _REGISTRY[name](graph, ctx)
            except Exception as exc:
                raise self._failure(name, i, graph, f"raised {type(exc).__name__}: {exc}", passes) from exc
            seconds = time.perf_counter() - start
            if result.changed:
                am.update(result.graph, result.preserved, computed=result.analyses)
                try:
                    verify(result.graph, am)
                    if stepwise:
                        hazards = mutation_hazards(result.graph, am)
                        if hazards - baseline_hazards:
                            raise AssertionError(_hazard_message(hazards - baseline_hazards))
                        baseline_hazards = hazards
                except AssertionError as exc:
                    raise self._failure(name, i, graph, f"broke an invariant: {exc}", passes) from exc
                if not stepwise:
                    now = {(n.name, n.target) for n in result.graph.gm.graph.nodes}
                    created.append((i, name, {node for node, _ in now - names}))
                    names = now
                graph = result.graph
            elif result.graph is not graph:
                raise self._failure(name, i, graph, "returned a new graph but reported changed=False", passes)
            peak_after = am.get(PeakSimulation).peak
            records.append(
                PassRecord(name, result.changed, result.stats, result.notes, seconds, peak_before, peak_after, result.plan)
            )
            if self.after_pass is not None:
                self.after_pass(name, graph)
        if created:
            new = mutation_hazards(graph, am) - baseline_hazards
            if new:
                # the pass named: the last one that added (or retargeted) the writer or the reader (the
                # last pass that changed the graph when neither was, the hazard coming from a new order)
                involved = set(sorted(new)[0])
                i, name, _ = next((c for c in reversed(created) if c[2] & involved), created[-1])
                what = f"broke an invariant: {_hazard_message(new)} (checked after the last pass; a reproducer_dir checks after each)"
                raise self._failure(name, i, graph, what, passes)
        return PipelineResult(graph, tuple(records), am)

    def _failure(self, name: str, index: int, graph: CapturedGraph, what: str, passes: Sequence[str]) -> PassError:
        before = ",".join(passes[:index]) or "(none)"
        message = f"pass {name!r} {what}. Passes run before it: {before}."
        if self.reproducer_dir is not None:
            path = save_reproducer(graph, ",".join(passes[index:]), self.reproducer_dir / f"memplan-repro-{name}")
            message += f" Reproducer saved to {path}; replay it with memplan.pipeline.replay({str(path)!r})."
        else:
            message += " Pass reproducer_dir= to save a reproducer."
        return PassError(message)


def _holders(result: PipelineResult | None, top: int = 3) -> tuple[str, ...]:
    """The largest tensors alive at the peak of ``result``'s plan, each with why it is alive and the
    user's line: what keeps the smallest reachable peak where it is."""
    if result is None:
        return ()
    explanation = MemoryAnalysis.from_graph(result.graph, result.graph_analyses()).explain(top=top)
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


def save_reproducer(graph: CapturedGraph, pipeline: str, path: str | pathlib.Path) -> pathlib.Path:
    """Save ``graph`` (code, constants, metadata, input shapes) and the pipeline to replay on it."""
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
        "seq_nr": dict(graph.seq_nr),
        "inputs": [dataclasses.asdict(s) for s in graph.inputs],
        "outputs": [dataclasses.asdict(s) for s in graph.outputs],
        "input_tensors": inputs_meta,
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
        seq_nr=meta["seq_nr"],
        inputs=tuple(InputSpec(**s) for s in meta["inputs"]),
        outputs=tuple(OutputSpec(**s) for s in meta["outputs"]),
        in_spec=pytree.tree_flatten(((), {}))[1],
        out_spec=pytree.tree_flatten(None)[1],
        seed=meta["seed"],
        lifetimes=meta["lifetimes"],
    )
    return graph, meta["pipeline"]


def replay(path: str | pathlib.Path, policy: Policy | None = None) -> PipelineResult:
    """Run a saved reproducer's pipeline on its graph (raises the same :class:`PassError` if it still fails)."""
    graph, pipeline = load_reproducer(path)
    return PassManager(pipeline, policy).run(graph)
