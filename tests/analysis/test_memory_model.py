"""The what-if memory model: its base timeline is the simulated peak, and each what-if is the base
timeline of the graph actually changed that way.

On the examples (training and inference), the zoo and random programs: the base timeline against a
plain walk of the storages (the oracle); ``with_sizes`` against the graph whose fake storage is resized;
``with_order`` against the graph put in that order; ``with_recompute`` against the graph the remat pass
built (the new nodes and changed reads read off the built graph).
"""

import dataclasses
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memplan.examples as examples
from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.memory_model import MemoryModel, NewNode, Timeline
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors
from memplan.capture import capture
from memplan.graphutil import copy_graph
from memplan.passes._remat.copies import apply_remat
from memplan.passes.remat import RematOptions, plan_remat
from memplan.passes.schedule import STRATEGIES, SchedulePlan, ScheduleProblem, apply_schedule
from memplan.policy import Policy
from memplan.testing import random_model, zoo

ZOO = list(zoo())
WORKLOADS = list(examples.WORKLOADS)


def graph_of(model, inputs, train, lifetimes="graph"):
    return dataclasses.replace(capture(model, *inputs, train=train, seed="tangents"), lifetimes=lifetimes)


def model_of(graph) -> MemoryModel:
    return AnalysisManager(graph).get(MemoryModel)


def walk(end: int, intervals) -> list[int]:
    """Bytes live right after each position allocates, from ``(start, stop, nbytes)`` intervals (``stop
    == end``: never freed), walked in Python."""
    born = [0] * end
    dies = [0] * end
    for start, stop, nbytes in intervals:
        born[start] += nbytes
        if stop < end:
            dies[stop] += nbytes
    live, timeline = 0, []
    for allocated, freed in zip(born, dies):
        live += allocated
        timeline.append(live)
        live -= freed
    return timeline


def walked(graph) -> list[int]:
    """The oracle: bytes live right after each node allocates, by walking every storage and position
    in Python (allocate at the creator, free after the interval's end, external never counted)."""
    am = AnalysisManager(graph)
    tensors, liveness = am.get(Tensors), am.get(Liveness)
    return walk(liveness.end, [(liveness.intervals[sid].start, liveness.intervals[sid].end, storage.nbytes)
                               for sid, storage in tensors.storages.items() if not storage.external])


def check_base(graph):
    """The base timeline is the oracle's and PeakSimulation's; a what-if of no change is the base."""
    model = model_of(graph)
    simulation = AnalysisManager(graph).get(PeakSimulation)
    assert model.live.tolist() == walked(graph) == [event.live for event in simulation.timeline]
    assert (model.peak, model.peak_index, model.after) == (simulation.peak, simulation.peak_index, simulation.after)
    assert model.peak == max([0, *walked(graph)])
    assert model.with_sizes({}).live.tolist() == model.live.tolist()
    if graph.lifetimes == "graph":
        assert model.with_order(range(model.end)).live.tolist() == model.live.tolist()
        assert model.with_recompute().live.tolist() == model.live.tolist()


# ----------------------------------------------------------------------------------------------
# the base timeline


@pytest.mark.parametrize("lifetimes", ["graph", "eager"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("name", WORKLOADS)
def test_examples_base_is_the_simulated_peak(name, train, lifetimes):
    w = examples.make(name)
    check_base(graph_of(w.model, w.inputs, train, lifetimes))


@pytest.mark.parametrize("lifetimes", ["graph", "eager"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("entry", ZOO, ids=lambda z: z.name)
def test_zoo_base_is_the_simulated_peak(entry, train, lifetimes):
    check_base(graph_of(entry.model, entry.inputs, train, lifetimes))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), train=st.booleans(), lifetimes=st.sampled_from(["graph", "eager"]))
def test_random_programs_base_is_the_simulated_peak(seed, train, lifetimes):
    model, inputs = random_model(seed, steps=16, requires_grad_input=train)
    check_base(graph_of(model, inputs, train, lifetimes))


# ----------------------------------------------------------------------------------------------
# with_sizes: a storage resized or dropped


def resized(graph, sizes):
    """``graph`` (a fresh capture: this edits its fake values) with each storage's fake storage resized."""
    tensors = AnalysisManager(graph).get(Tensors)
    for sid, nbytes in sizes.items():
        creator = graph.node(tensors.storages[sid].creator)
        index = next(info.index for info in tensors.tensors[creator.name] if info.storage == sid)
        value = creator.meta["val"] if index is None else creator.meta["val"][index]
        value.untyped_storage().resize_(nbytes)
    for node in graph.gm.graph.nodes:
        node.meta.pop("memplan_tensor_facts", None)  # Tensors' record of what the fake values said
    return dataclasses.replace(graph)


def check_sizes(make_graph, seed):
    graph = make_graph()
    model = model_of(graph)
    assert len(model.storage) > 0
    rng = random.Random(seed)
    largest = model.storage[int(np.argmax(model.nbytes))]
    picked = {int(largest), *rng.sample(model.storage.tolist(), min(3, len(model.storage)))}
    sizes = {sid: rng.choice([0, 4, 1 << 20]) for sid in picked}
    changed = AnalysisManager(resized(make_graph(), sizes))
    what_if = model.with_sizes(sizes)
    assert what_if.live.tolist() == changed.get(MemoryModel).live.tolist()
    assert what_if.peak == changed.get(PeakSimulation).peak


@pytest.mark.parametrize("lifetimes", ["graph", "eager"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("name", WORKLOADS)
def test_examples_with_sizes_is_the_resized_graph(name, train, lifetimes):
    w = examples.make(name)
    check_sizes(lambda: graph_of(w.model, w.inputs, train, lifetimes), seed=len(name))


@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("entry", ZOO, ids=lambda z: z.name)
def test_zoo_with_sizes_is_the_resized_graph(entry, train):
    check_sizes(lambda: graph_of(entry.model, entry.inputs, train), seed=0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), train=st.booleans())
def test_random_programs_with_sizes_is_the_resized_graph(seed, train):
    model, inputs = random_model(seed, steps=16, requires_grad_input=train)
    check_sizes(lambda: graph_of(model, inputs, train), seed)


def test_with_sizes_refuses_external_storages_and_negative_sizes():
    entry = ZOO[0]
    graph = graph_of(entry.model, entry.inputs, True)
    model = model_of(graph)
    tensors = model.tensors
    external = next(sid for sid, storage in tensors.storages.items() if storage.external)
    with pytest.raises(ValueError, match="not counted"):
        model.with_sizes({external: 8})
    with pytest.raises(ValueError, match=">= 0"):
        model.with_sizes({int(model.storage[0]): -1})


# ----------------------------------------------------------------------------------------------
# with_intervals: storages gone, intervals of bytes added


def intervals_walked(model, dropped, added) -> list[int]:
    """The oracle: every kept storage's interval and every added one walked in Python."""
    gone = set(dropped)
    rows = [(int(a), int(b), int(n)) for sid, a, b, n in zip(model.storage, model.start, model.stop, model.nbytes)
            if int(sid) not in gone]
    return walk(model.end, rows + list(added))


def check_intervals(graph, seed):
    model = model_of(graph)
    rng = random.Random(seed)
    ids = model.storage.tolist()
    dropped = rng.sample(ids, min(5, len(ids)))
    added = []
    for _ in range(4):
        start = rng.randrange(model.end)
        added.append((start, rng.choice([start, rng.randrange(start, model.end + 1), model.end]), rng.choice([0, 8, 1 << 20])))
    assert model.with_intervals(dropped, added).live.tolist() == intervals_walked(model, dropped, added)
    # a storage dropped and given back its own interval at another size is with_sizes
    sid = dropped[0]
    k = ids.index(sid)
    again = [(int(model.start[k]), int(model.stop[k]), 12345)]
    assert model.with_intervals([sid], again).live.tolist() == model.with_sizes({sid: 12345}).live.tolist()
    assert model.with_intervals().live.tolist() == model.live.tolist()


@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("name", WORKLOADS)
def test_examples_with_intervals_is_the_walked_timeline(name, train):
    w = examples.make(name)
    check_intervals(graph_of(w.model, w.inputs, train), seed=len(name))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), train=st.booleans(), lifetimes=st.sampled_from(["graph", "eager"]))
def test_random_programs_with_intervals_is_the_walked_timeline(seed, train, lifetimes):
    model, inputs = random_model(seed, steps=16, requires_grad_input=train)
    check_intervals(graph_of(model, inputs, train, lifetimes), seed)


def test_with_intervals_refuses_uncounted_storages_and_bad_intervals():
    entry = ZOO[0]
    model = model_of(graph_of(entry.model, entry.inputs, True))
    external = next(sid for sid, s in model.tensors.storages.items() if s.external)
    with pytest.raises(ValueError, match="not counted"):
        model.with_intervals([external])
    with pytest.raises(ValueError, match="dropped once"):
        model.with_intervals([int(model.storage[0])] * 2)
    for bad in [(-1, 0, 4), (3, 2, 4), (0, model.end + 1, 4), (0, 0, -4)]:
        with pytest.raises(ValueError, match="intervals must"):
            model.with_intervals((), [bad])


# ----------------------------------------------------------------------------------------------
# with_order: a reorder


def random_orders(graph, count, seed):
    """``count`` random topological orders (of data dependencies) of the scheduled nodes, as positions."""
    model = model_of(graph)
    nodes = [graph.node(name) for name in model.order]
    place = {node: i for i, node in enumerate(nodes)}
    preds = [{place[a] for a in node.all_input_nodes if a in place} for node in nodes]
    succs = [[] for _ in nodes]
    for i, ps in enumerate(preds):
        for j in ps:
            succs[j].append(i)
    rng = random.Random(seed)
    orders = []
    for _ in range(count):
        indegree = [len(ps) for ps in preds]
        ready = [i for i, d in enumerate(indegree) if d == 0]
        order = []
        while ready:
            i = ready.pop(rng.randrange(len(ready)))
            order.append(i)
            for j in succs[i]:
                indegree[j] -= 1
                if indegree[j] == 0:
                    ready.append(j)
        orders.append(order)
    return orders


def reordered(graph, names, order):
    """``graph`` put in ``order`` (positions into ``names``, its nodes in their order)."""
    plan = SchedulePlan(tuple(names[i] for i in order), "test", (("test", 0),))
    return apply_schedule(copy_graph(graph), plan)


def check_orders(graph, seed):
    model = model_of(graph)
    problem = ScheduleProblem(graph, AnalysisManager(graph))
    orders = [strategy(problem) for strategy in STRATEGIES.values()] + random_orders(graph, 3, seed)
    for order in orders:
        expected = model_of(reordered(graph, model.order, order))
        assert model.with_order(order).live.tolist() == expected.live.tolist()
        assert model.with_order(order).peak == expected.peak


@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("name", WORKLOADS)
def test_examples_with_order_is_the_reordered_graph(name, train):
    w = examples.make(name)
    check_orders(graph_of(w.model, w.inputs, train), seed=len(name))


@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("entry", ZOO, ids=lambda z: z.name)
def test_zoo_with_order_is_the_reordered_graph(entry, train):
    check_orders(graph_of(entry.model, entry.inputs, train), seed=1)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), train=st.booleans())
def test_random_programs_with_order_is_the_reordered_graph(seed, train):
    model, inputs = random_model(seed, steps=16, requires_grad_input=train)
    check_orders(graph_of(model, inputs, train), seed)


def test_with_order_refuses_what_is_not_a_permutation_and_eager_lifetimes():
    entry = ZOO[0]
    model = model_of(graph_of(entry.model, entry.inputs, True))
    with pytest.raises(ValueError, match="permutation"):
        model.with_order([0] * model.end)
    with pytest.raises(ValueError, match="permutation"):
        model.with_order(range(model.end - 1))
    eager = model_of(graph_of(entry.model, entry.inputs, True, "eager"))
    with pytest.raises(ValueError, match="graph lifetimes"):
        eager.with_order(range(eager.end))
    with pytest.raises(ValueError, match="graph lifetimes"):
        eager.with_recompute()


# ----------------------------------------------------------------------------------------------
# with_recompute: added recomputation


def as_recompute(before, after):
    """The new nodes and changed touches that turn ``before`` into ``after`` (which only inserts nodes),
    in the model's terms: storages of ``after`` whose creator is a node of ``before`` keep its ids, the
    others get new ids from ``next_storage``."""
    old, new = model_of(before), model_of(after)
    position = {name: i for i, name in enumerate(old.order)}
    new_position = {name: i for i, name in enumerate(new.order)}
    assert [name for name in new.order if name in position] == list(old.order)
    names_before = {node.name for node in before.gm.graph.nodes}
    ids: dict[int, int] = {}  # storage of after -> storage of before, or a new id
    created: dict[int, dict[int, int]] = {}  # position in after -> new ids it creates -> bytes
    fresh = old.next_storage
    for sid, storage in new.tensors.storages.items():
        creator = storage.creator
        if creator in names_before:
            index = next(info.index for info in new.tensors.tensors[creator] if info.storage == sid)
            ids[sid] = next(info.storage for info in old.tensors.tensors[creator] if info.index == index)
            assert old.tensors.storages[ids[sid]].nbytes == storage.nbytes
        else:
            ids[sid] = fresh
            fresh += 1
            created.setdefault(new_position[creator], {})[ids[sid]] = storage.nbytes
    was, now = touched_by(old), touched_by(new, ids)
    anchor = {}  # position in after -> position in before of the next node of before (or the output)
    following = old.end
    for at in range(new.end - 1, -1, -1):
        following = position.get(new.order[at], following)
        anchor[at] = following
    inserted, retouched = [], {}
    for at, name in enumerate(new.order):
        if name in position:
            if now.get(at, set()) != was.get(position[name], set()):
                retouched[position[name]] = sorted(now.get(at, set()))
        else:
            creates = created.get(at, {})
            inserted.append(NewNode(anchor[at], creates, tuple(sorted(now.get(at, set()) - set(creates)))))
    if now.get(new.end, set()) != was.get(old.end, set()):
        retouched[old.end] = sorted(now.get(new.end, set()))
    return inserted, retouched


def touched_by(model, ids=None):
    """Position -> the storages it touches (renamed by ``ids``), from the model's touchers."""
    found: dict[int, set[int]] = {}
    for sid, positions in model.touchers.items():
        for at in positions:
            found.setdefault(at, set()).add(sid if ids is None else ids[sid])
    return found


def check_recompute(model, inputs, limit=4):
    graph = graph_of(model, inputs, True)
    _, candidates = plan_remat(graph, AnalysisManager(graph), Policy(max_overhead=math.inf), RematOptions(bound=False))
    plans = [c.plan for c in candidates if c.plan.changes][:limit]
    for plan in plans:
        after = dataclasses.replace(apply_remat(graph_of(model, inputs, True), plan), lifetimes="graph")
        inserted, retouched = as_recompute(graph, after)
        what_if = model_of(graph).with_recompute(inserted, retouched)
        expected = AnalysisManager(after).get(PeakSimulation)
        assert what_if.live.tolist() == model_of(after).live.tolist(), plan.label
        assert what_if.peak == expected.peak
    return len(plans)


@pytest.mark.parametrize("entry", ZOO, ids=lambda z: z.name)
def test_zoo_with_recompute_is_the_rematerialised_graph(entry):
    assert check_recompute(entry.model, entry.inputs) > 0


@pytest.mark.parametrize("name", ["latent_gru", "seq2seq"])
def test_examples_with_recompute_is_the_rematerialised_graph(name):
    w = examples.make(name)
    assert check_recompute(w.model, w.inputs, limit=2) > 0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000))
def test_random_programs_with_recompute_is_the_rematerialised_graph(seed):
    model, inputs = random_model(seed, steps=16, requires_grad_input=True)
    check_recompute(model, inputs, limit=2)


def test_with_recompute_places_new_nodes_in_order_and_frees_after_the_last_toucher():
    entry = ZOO[0]
    model = model_of(graph_of(entry.model, entry.inputs, True))
    base, born, dies = model.live.tolist(), model.born.tolist(), model.dies.tolist()
    first, second = model.next_storage, model.next_storage + 1
    # before the node at position 1: a 100-byte value, then a 10-byte one that reads it
    inserted = [NewNode(1, {first: 100}), NewNode(1, {second: 10}, (first,))]
    live = model.with_recompute(inserted).live.tolist()
    assert len(live) == model.end + 2
    assert live[0] == base[0]
    assert live[1] == base[0] - dies[0] + 100
    assert live[2] == base[0] - dies[0] + 110  # the first lives until the second reads it
    assert live[3:] == base[1:]  # both freed: nobody reads the second
    # the node at position 1 reads the 10-byte value too: it lives one node longer
    retouched = {1: [*touched_by(model).get(1, ()), second]}
    live = model.with_recompute(inserted, retouched).live.tolist()
    assert live[3] == base[0] - dies[0] + born[1] + 10 and live[4:] == base[2:]
    with pytest.raises(ValueError, match="no earlier new node creates"):
        model.with_recompute([NewNode(0, {}, (first,))])
    with pytest.raises(ValueError, match="next_storage"):
        model.with_recompute([NewNode(0, {0: 8})])
    with pytest.raises(ValueError, match="positions"):
        model.with_recompute([NewNode(model.end + 1)])


def test_timeline_of_nothing_has_no_peak():
    empty = Timeline(np.zeros(0, dtype=np.int64))
    assert (empty.peak, empty.peak_index) == (0, -1)
