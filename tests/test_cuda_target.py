"""Planning for a GPU from a machine without one: capture, analyze, optimize and the CLI with device="cuda".

These run on a CPU-only build (where they are the point) as on a CUDA one: a CUDA target is traced over
fake tensors either way. Numbers are derived in the tests from shapes, or compared with an independent
walk of the same graph's liveness; none is pinned to one model.
"""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan.analysis.allocator import CUDA_CACHING, allocator_for, cublas_workspace_bytes
from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.memory_model import MemoryModel
from memplan.analyze import analyze
from memplan.api import optimize
from memplan.capture import capture
from memplan.cli import load_target, main
from memplan.errors import CaptureError, TargetDeviceError
from memplan.fit import fit, largest_batch

CUDA0 = torch.device("cuda", 0)
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the stand-in trace of a machine without a GPU")


def _round(nbytes: int) -> int:
    return 0 if nbytes == 0 else -(-nbytes // 512) * 512


class MLP(nn.Module):
    """Odd sizes, so that the CUDA allocator's 512-byte blocks change the figures; a tensor it makes on its
    inputs' device, so that the plan's code names the device."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(37, 53)
        self.fc2 = nn.Linear(53, 11)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        return self.fc2(h) + torch.ones(11, device=x.device)


def _values(graph):
    for node in graph.gm.graph.nodes:
        value = node.meta.get("val")
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.Tensor):
                yield node, item


def _peak_by_hand(analysis, charge) -> int:
    """The peak of the graph's liveness intervals with each counted storage charged ``charge(bytes)``: a
    plain loop over positions, independent of the memory model's arrays."""
    liveness = AnalysisManager(analysis.graph).get(Liveness)
    counted = [(liveness.intervals[sid], charge(s.nbytes)) for sid, s in analysis.tensors.storages.items() if not s.external]
    return max((sum(n for iv, n in counted if iv.start <= t <= iv.end) for t in range(liveness.end)), default=0)


def test_analyze_for_cuda_puts_every_value_on_cuda_and_charges_512_byte_blocks():
    model, x = MLP(), torch.randn(7, 37, requires_grad=True)
    cpu = analyze(model, x)
    cuda = analyze(model, x, device="cuda")
    devices = {value.device for _, value in _values(cuda.graph)}
    assert devices == {CUDA0}
    assert cuda.device == CUDA0 and cuda.allocator is CUDA_CACHING
    # the same program, storage by storage, each charged in 512-byte blocks
    assert [n.name for n in cuda.graph.gm.graph.nodes] == [n.name for n in cpu.graph.gm.graph.nodes]
    assert [s.nbytes for s in cuda.tensors.storages.values()] == [_round(s.nbytes) for s in cpu.tensors.storages.values()]
    assert cuda.peak == _peak_by_hand(cpu, _round) > cpu.peak
    assert cpu.peak == _peak_by_hand(cpu, lambda n: n)
    # resident: parameters and the input, each in its blocks
    assert cuda.resident == sum(_round(t.nbytes) for t in (*model.parameters(), x))


def test_cuda_prediction_is_stable():
    model, x = MLP(), torch.randn(7, 37, requires_grad=True)
    first, second = analyze(model, x, device="cuda"), analyze(model, x, device="cuda")
    assert first.peak == second.peak
    assert [e.live for e in first.timeline] == [e.live for e in second.timeline]
    assert first.graph.gm.code == second.graph.gm.code


def test_cpu_prediction_is_unchanged():
    linear, x = nn.Linear(256, 250), torch.randn(3, 256)
    output = 3 * 250 * 4  # bytes of the output, the only allocation of the inference step
    assert analyze(linear, x, train=False).peak == output
    assert analyze(linear, x, train=False, device="cpu").peak == output
    assert analyze(linear, x, train=False, device="cuda").peak == _round(output)
    assert allocator_for("cpu").charge(output) == output
    assert capture(linear, x, train=False).target_device is None


def test_what_ifs_charge_the_cuda_allocators_blocks():
    def f(x):
        return (x.exp() + 1).sin()

    for device, charge in ((None, lambda n: n), ("cuda", _round)):
        graph = dataclasses.replace(capture(f, torch.randn(256), train=False, target_device=device), lifetimes="graph")
        model = AnalysisManager(graph).get(MemoryModel)
        add = model.tensors.storages_of("add")[0]
        assert model.peak == 2 * 1024  # exp's and add's outputs, 1 KiB each
        assert model.with_sizes({add: 1030}).peak == 1024 + charge(1030)
        assert model.with_intervals(added=[(0, 0, 100)]).peak == 2 * 1024
        assert model.with_intervals(added=[(1, 1, 100)]).peak == 2 * 1024 + charge(100)


def test_optimize_for_cuda_plans_without_running_and_refuses_to_run_on_the_cpu():
    model, x = MLP(), torch.randn(7, 37, requires_grad=True)
    opt = optimize(model, device="cuda")
    plan = opt.plan_for(x)
    assert opt.plan is plan and plan.device == CUDA0
    for graph in (plan.graph, plan.original):
        for node, value in _values(graph):
            assert value.device == CUDA0 or (value.device.type == "cpu" and value.dim() == 0), node.format_node()
    assert "device(type='cuda', index=0)" in plan.code and "meta" not in plan.code
    assert plan.planned_peak % 512 == 0 and plan.eager_peak % 512 == 0
    assert opt.plan_for(x) is plan  # kept, per signature
    with pytest.raises(TargetDeviceError, match=r"plans for cuda:0.*args\[0\] is on cpu.*plan_for"):
        opt(x)


@needs_no_gpu
def test_cuda_kernel_choices_of_a_stand_in_trace():
    """Fused attention and the fused LSTM cell, as CUDA runs them, where the CPU trace runs its own kernels."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = nn.LSTMCell(16, 16)

        def forward(self, q, x):
            return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum() + self.cell(x)[0].sum()

    def ops(model, *inputs, **kwargs):
        return {str(n.target) for n in capture(model, *inputs, target_device="cuda", **kwargs).gm.graph.nodes}

    efficient = "aten._scaled_dot_product_efficient_attention.default"
    q, x = torch.randn(2, 2, 32, 16, requires_grad=True), torch.randn(4, 16)
    found = ops(Block(), q, x)
    assert {efficient, "aten._thnn_fused_lstm_cell.default"} <= found
    assert "aten.bmm.default" not in found  # no L x S scores
    # through nn.MultiheadAttention, and with dropout (whose backward replays the forward's draw)
    x = torch.randn(2, 32, 16)
    assert efficient in ops(nn.MultiheadAttention(16, 2, batch_first=True), x, x, x, need_weights=False)
    assert efficient in ops(lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1), q)
    # dropout in training: CUDA's fused kernel and its one-byte mask, not the CPU's float noise
    for dropout in (nn.Dropout(0.1), lambda x: F.dropout(x, 0.2), lambda x: torch.dropout(x, 0.3, True)):
        graph = capture(lambda x: dropout(x.tanh()), q, target_device="cuda")
        found = {str(n.target) for n in graph.gm.graph.nodes}
        assert "aten.native_dropout.default" in found and "aten.bernoulli_.float" not in found
        mask = next(n for n in graph.gm.graph.nodes if str(n.target) == "aten.native_dropout.default").meta["val"][1]
        assert mask.dtype == torch.bool
    # in place, or outside training, as the composite runs it
    assert "aten.native_dropout.default" not in ops(lambda x: F.dropout(x * 2, 0.2, inplace=True), q)
    assert "aten.native_dropout.default" not in ops(lambda x: F.dropout(x.tanh(), 0.2, training=False), q)


@needs_no_gpu
@pytest.mark.parametrize("kind, message", [
    ("gru", r"nn.GRUCell runs CUDA's fused kernel.*Fix:"),
    ("lstm", r"nn.LSTM runs cuDNN.*Fix:"),
    ("autocast", r"torch.autocast\('cuda'\).*Fix:"),
    ("arange", r"reads tensors on two devices.*cuda:0(,| and) cpu.*Fix: make it on the device"),
    ("by_name", r"by name \(device='cuda'\).*Fix:"),
])
def test_what_a_cpu_only_build_cannot_plan_for_cuda_is_refused(kind, message):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.gru, self.lstm = nn.Linear(8, 8), nn.GRUCell(8, 8), nn.LSTM(8, 8)

        def forward(self, x):
            if kind == "gru":
                return self.gru(x)
            if kind == "lstm":
                return self.lstm(x)[0]
            if kind == "autocast":
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return self.fc(x)
            if kind == "arange":
                return self.fc(x) + torch.arange(8.0)
            return self.fc(x) + torch.zeros(8, device="cuda")

    with pytest.raises(CaptureError, match=message) as caught:
        capture(Model(), torch.randn(4, 8), target_device="cuda")
    assert "test_cuda_target.py" in str(caught.value)  # the user's line


def test_unknown_target_device_is_refused():
    with pytest.raises(ValueError, match="plans for 'cpu' and 'cuda'"):
        optimize(nn.Linear(2, 2), device="mps")


def test_cublas_workspace():
    assert cublas_workspace_bytes(":4096:8") == 32 * 2**20
    assert cublas_workspace_bytes(":4096:2:16:8") == 8 * 2**20 + 128 * 2**10
    x = torch.randn(7, 37, requires_grad=True)
    # cuBLAS handles are per thread: the forward's, and autograd's backward thread
    assert analyze(MLP(), x, device="cuda").workspace == 2 * cublas_workspace_bytes()
    assert analyze(MLP(), x, device="cuda", train=False).workspace == cublas_workspace_bytes()
    assert analyze(lambda x: x.relu(), x, device="cuda").workspace == 0
    assert analyze(MLP(), x).workspace == 0


# ----------------------------------------------------------------------------------------------
# does it fit


FACTORY = '''
import torch
from torch import nn

def make(batch=8):
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64)), (torch.randn(batch, 64),)
'''


@pytest.fixture
def factory(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(FACTORY)
    return f"{path}:make"


def test_fit_and_largest_batch_agree():
    def make(batch):
        return nn.Sequential(nn.Linear(256, 384), nn.ReLU(), nn.Linear(384, 256)), (torch.randn(batch, 256),)

    workspace = cublas_workspace_bytes()
    capacity = workspace + 3 * 2**20
    found = largest_batch(make, device="cuda", capacity=capacity, train=False, memplan=False)
    assert found.eager is not None and not found.at_least

    def fits(batch):
        model, inputs = make(batch)
        report = fit(model, *inputs, device="cuda", capacity=capacity, train=False, plans=False)
        assert report.needs.workspace == workspace
        return report.fits(report.needs.eager)

    assert fits(found.eager) and not fits(found.eager + 1)


def test_cli_says_whether_it_fits(factory, capsys):
    capacity = str(cublas_workspace_bytes() + 100 * 2**10)  # the workspace, and 100 KiB for the model
    assert main(["analyze", factory, "--device", "cuda", "--mode", "infer", "--capacity", capacity, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["device"] == "cuda:0" and payload["fit"]["prediction"] is True
    plans = payload["fit"]["plans"]
    assert set(plans) == {"eager", "default", "smallest"}
    assert all(p["fits"] for p in plans.values())
    assert plans["smallest"]["peak"] <= plans["default"]["peak"] <= plans["eager"]["peak"]
    batch = payload["fit"]["largest_batch"]
    assert batch["memplan"] >= batch["eager"] >= 8

    assert main(["analyze", factory, "--device", "cuda", "--mode", "infer", "--capacity", str(cublas_workspace_bytes())]) == 0
    text = capsys.readouterr().out
    verdicts = [line.rsplit("  ", 1)[-1] for line in text.splitlines() if " peak " in line and " total " in line]
    assert "prediction for cuda:0" in text and verdicts == ["does not fit"] * 3
    assert "largest batch that fits: eager none, memplan none" in text  # the workspace alone fills the capacity


@needs_no_gpu
def test_cli_builds_a_cuda_target_on_the_meta_device():
    _, model, inputs = load_target("maxsim", device="cuda")
    assert {p.device.type for p in model.parameters()} | {x.device.type for x in inputs} == {"meta"}


def _grouped_addmm_nodes(gm):
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            yield from (n for n in module.graph.nodes if n.target is torch.ops.memplan.grouped_addmm_.default)


def test_a_plan_for_cuda_is_priced_as_a_gpus_step_and_gathers_max_gradients_in_one_block():
    """On a GPU an op's fixed cost is the host's (Python, dispatch, launch) and its work is fast, so
    memplan::grouped_addmm_ takes all its entries at once (one dispatch of each of its ops) where on a
    CPU it takes them in blocks; and its blocks are priced as the dispatches they are."""
    from memplan.analysis.cost import REFERENCE_CUDA_RATES, REFERENCE_RATES, op_work
    from memplan.examples import make

    workload = make("maxsim", size="small")
    on_cpu = optimize(workload.model, device="cpu").plan_for(*workload.inputs)
    on_gpu = optimize(workload.model, device="cuda").plan_for(*workload.inputs)
    cpu_nodes, gpu_nodes = list(_grouped_addmm_nodes(on_cpu.graph.gm)), list(_grouped_addmm_nodes(on_gpu.graph.gm))
    assert cpu_nodes and gpu_nodes
    for node in gpu_nodes:
        cols, workspace = node.args[1].meta["val"], node.args[6].meta["val"]
        assert workspace.shape[1] == cols.numel()
        assert op_work(node).rounds == 6 or op_work(node).rounds == 4  # one block: each op of it once
    for node in cpu_nodes:
        cols, workspace = node.args[1].meta["val"], node.args[6].meta["val"]
        blocks = -(-cols.numel() // workspace.shape[1])
        work = op_work(node)
        assert work.rounds >= blocks
        # the blocks' dispatches are priced: the same work in one block is cheaper by them
        assert work.price(REFERENCE_RATES) - dataclasses.replace(work, rounds=0).price(REFERENCE_RATES) == \
            pytest.approx(work.rounds * REFERENCE_RATES.dispatch)
    # each plan is held to the same allowance over eager's time, priced with its device's rates
    assert on_gpu.overhead <= 0.3 + 1e-9 and on_cpu.overhead <= 0.3 + 1e-9
    # the bytes a GPU moves in the time of one dispatch: hundreds of times what a CPU moves
    assert REFERENCE_CUDA_RATES.dispatch * REFERENCE_CUDA_RATES.bandwidth > 100 * (
        REFERENCE_RATES.dispatch * REFERENCE_RATES.bandwidth)
