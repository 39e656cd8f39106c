"""The one time model (memplan.analysis.cost): op FLOPs, eager's autograd nodes, calibration and its
cache, and the whole plan held to max_overhead by the pipeline."""

import dataclasses
import json
import math

import pytest
import torch

import memplan
from memplan.analysis import cost
from memplan.analysis.cost import (
    REFERENCE_CUDA_RATES,
    REFERENCE_RATES,
    CostRates,
    autograd_nodes,
    eager_seconds,
    graph_cost,
    op_flops,
    rates_for,
)
from memplan.capture import capture
from memplan.examples import make
from memplan.graphutil import packet_name


def _nodes(graph, name):
    return [n for n in graph.gm.graph.nodes if packet_name(n) == name]


def test_matrix_products_count_their_flops_in_place_or_not():
    graph = capture(lambda a, b, c: torch.addmm(c, a, b).add_(torch.bmm(a[None], b[None])[0]),
                    torch.randn(4, 8), torch.randn(8, 3), torch.randn(4, 3), train=False)
    [addmm] = _nodes(graph, "addmm")
    [bmm] = _nodes(graph, "bmm")
    assert op_flops(addmm) == 2 * 4 * 8 * 3 + 4 * 3
    assert op_flops(bmm) == 2 * 4 * 8 * 3
    assert op_flops(_nodes(graph, "add_")[0]) == 0
    accumulate = capture(lambda a, b, c: c.addmm_(a, b), torch.randn(4, 8), torch.randn(8, 3),
                         torch.randn(4, 3), train=False)
    assert op_flops(_nodes(accumulate, "addmm_")[0]) == op_flops(addmm)


def test_convolutions_count_their_flops():
    conv = torch.nn.Conv2d(3, 5, 3, padding=1)
    graph = capture(conv, torch.randn(2, 3, 8, 8))
    [forward] = _nodes(graph, "convolution")
    assert op_flops(forward) == 2 * (2 * 5 * 8 * 8) * 3 * 3 * 3
    [backward] = _nodes(graph, "convolution_backward")
    assert op_flops(backward) == 2 * op_flops(forward)


def _eager_autograd_nodes(outputs: torch.Tensor) -> int:
    """Autograd nodes reachable from ``outputs`` that run a backward (leaves' AccumulateGrad aside)."""
    seen, stack = set(), [outputs.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return sum(type(n).__name__ != "AccumulateGrad" for n in seen)


class _Unrolled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = torch.nn.GRUCell(4, 5)

    def forward(self, xs):
        h, outs = None, []
        for x in xs:
            h = self.cell(x, h)
            outs.append(h)
        return torch.stack(outs)


@pytest.mark.parametrize("name", ["mlp", "rnn"])
def test_eager_autograd_nodes_are_counted_from_the_backward(name):
    torch.manual_seed(0)
    if name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        inputs = (torch.randn(3, 6),)
    else:
        model, inputs = _Unrolled(), (torch.randn(5, 2, 4),)
    graph = capture(model, *inputs)
    # eager's nodes, and the one of the seed's sum (the step memplan captures ends in out.sum()); a node
    # whose backward runs no op (a GRU cell's chunk of its gates) leaves no trace to count
    eager = _eager_autograd_nodes(model(*inputs).sum())
    assert 0.7 * eager <= autograd_nodes(graph) <= eager
    if name == "mlp":
        assert autograd_nodes(graph) == eager
    assert autograd_nodes(capture(model, *inputs, train=False)) == 0


def test_eager_costs_its_ops_and_autograd_a_plan_its_ops():
    graph = capture(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh()), torch.randn(3, 6))
    rates = dataclasses.replace(REFERENCE_RATES, autograd_node=1e-3)
    assert eager_seconds(graph, rates) == pytest.approx(graph_cost(graph, rates) + 1e-3 * autograd_nodes(graph))
    assert eager_seconds(graph, CostRates(autograd_node=0.0)) == graph_cost(graph)


def test_calibration_measures_positive_rates():
    rates = cost.calibrate("cpu")
    assert rates.source.startswith("calibrated")
    for field in ("flops", "bandwidth", "cache_bandwidth", "dispatch", "view_dispatch", "index_element"):
        value = getattr(rates, field)
        assert math.isfinite(value) and value > 0, field
    assert rates.cache_bandwidth >= rates.bandwidth and rates.autograd_node >= 0
    assert rates.threads == torch.get_num_threads()


def test_calibrated_rates_are_kept_per_machine_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cost, "_CALIBRATED", {})
    calls = []
    measured = dataclasses.replace(REFERENCE_RATES, flops=1.25e9, source="calibrated (test)")
    monkeypatch.setattr(cost, "calibrate", lambda device: calls.append(device) or measured)
    assert rates_for("calibrated") == measured
    assert rates_for("calibrated") == measured and len(calls) == 1  # kept in the process
    stored = json.loads((tmp_path / "memplan" / "rates.json").read_text())
    [key] = stored
    assert "threads" in key and stored[key]["flops"] == 1.25e9
    monkeypatch.setattr(cost, "_CALIBRATED", {})
    assert rates_for("calibrated") == measured and len(calls) == 1  # read back from the file


def test_rates_follow_the_environment_and_refuse_what_they_cannot_read(monkeypatch):
    monkeypatch.setenv("MEMPLAN_RATES", "reference")
    assert rates_for() is REFERENCE_RATES
    monkeypatch.delenv("MEMPLAN_RATES")
    assert rates_for() is REFERENCE_RATES  # the default: the same plan on every machine
    custom = CostRates(flops=1e9, threads=None)
    assert rates_for(custom).threads == torch.get_num_threads()
    with pytest.raises(ValueError, match="'reference' or 'calibrated'"):
        rates_for("fast")
    assert rates_for("calibrated", "meta") is REFERENCE_RATES  # a device this machine cannot time
    # a GPU's plan is priced as a GPU's step: its ops are fast and its fixed costs are the host's
    assert rates_for("reference", "cuda") is REFERENCE_CUDA_RATES
    assert REFERENCE_CUDA_RATES.flops > 100 * REFERENCE_RATES.flops
    assert REFERENCE_CUDA_RATES.dispatch >= REFERENCE_RATES.dispatch


@pytest.mark.parametrize("name, max_overhead", [("chain_product", 0.0), ("latent_gru", 0.0), ("seq2seq", 0.3)])
def test_the_whole_plan_is_held_to_max_overhead(name, max_overhead):
    """The passes share one allowance: the plan's predicted step time over eager's stays within it,
    whatever each pass took, up to what a pass's estimate leaves out (the views its copies read
    through, concat's part copies: under 3% of eager's time)."""
    workload = make(name)
    opt = memplan.optimize(workload.model, max_overhead=max_overhead)
    opt(*workload.inputs)
    plan = opt.plan
    assert plan.eager_time == pytest.approx(eager_seconds(plan.original))
    assert plan.plan_time == pytest.approx(graph_cost(plan.graph))
    assert plan.overhead <= max_overhead + 0.03
    records = plan.records
    assert records[0].time_before == pytest.approx(graph_cost(plan.original))
    assert all(a.time_after == b.time_before for a, b in zip(records, records[1:]))
