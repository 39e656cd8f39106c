"""Memory snapshots for PyTorch's visualizer: they replay to the predicted peak, their addresses are
consistent, and torch's own ``_memory_viz`` renders them on a machine without CUDA."""

import base64
import json
import pickle
import re
import textwrap

import pytest
import torch
from torch import nn
from torch.cuda import _memory_viz

import memplan
from memplan.capture import capture
from memplan.cli import main
from memplan.report.snapshot import ALIGN, replay_peak, snapshot_paths, to_snapshot
from memplan.steps import step_fn


# Defined here, not imported from test_html: the frames of a snapshot must name this file as the user's.
class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


class Stack(nn.Module):
    def __init__(self, d=32, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(d), "mlp": Mlp(d)}) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = x + block["mlp"](block["norm"](x))
        return x


class Views(nn.Module):
    """One product and a chain of views and in-place ops on it: one storage, so one allocation."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        y = x @ self.w
        z = y.view(-1)
        z.relu_()
        z.mul_(2)
        return z.view(4, 32).t()


def _replay(trace):
    """An independent replay of a device trace: the running total and its maximum, checking that each
    free names the address and size of a live allocation and that live blocks never overlap."""
    live = {}
    total = peak = 0
    for entry in trace:
        addr, size = entry["addr"], entry["size"]
        if entry["action"] == "alloc":
            end = addr + size
            for other, other_size in live.items():
                assert end <= other or other + other_size <= addr, f"{addr:#x} overlaps {other:#x}"
            live[addr] = size
            total += size
            peak = max(peak, total)
        elif entry["action"] in ("free_requested", "free_completed"):
            assert live.get(addr) == size, f"free of {size} at {addr:#x}, live there: {live.get(addr)}"
            if entry["action"] == "free_completed":
                del live[addr]
                total -= size
    return peak, live


@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
def test_the_trace_replays_to_exactly_the_predicted_peak(train):
    a = memplan.analyze(Stack(), torch.randn(64, 32), train=train)
    snap = a.to_snapshot()
    peak, live = _replay(snap["device_traces"][0])
    assert peak == a.peak == replay_peak(snap) == snap["memplan"]["peak"]
    # what is still allocated at the end is what the simulation keeps to the end (outputs, gradients)
    assert sum(live.values()) == a.simulation.after
    assert all(addr % ALIGN == 0 for addr in live)


def test_aliasing_storages_are_one_allocation():
    a = memplan.analyze(Views(), torch.randn(8, 16), train=False)
    allocs = [e for e in a.to_snapshot()["device_traces"][0] if e["action"] == "alloc"]
    assert [e["size"] for e in allocs] == [8 * 16 * 4]  # y, its views and in-place results share it
    assert a.peak == 8 * 16 * 4


def test_replay_refuses_a_free_with_no_alloc():
    snap = to_snapshot(capture(Mlp(8), torch.randn(4, 8), train=False))
    trace = snap["device_traces"][0]
    free = {"action": "free_completed", "addr": trace[0]["addr"] + ALIGN, "size": 4, "stream": 0, "frames": []}
    with pytest.raises(ValueError, match="free of 4 bytes"):
        replay_peak({"device_traces": [trace + [free]], "segments": []})


def test_frames_name_the_users_line_the_module_and_the_op():
    a = memplan.analyze(Stack(), torch.randn(64, 32))
    snap = a.to_snapshot()
    frames = [f for e in snap["device_traces"][0] for f in e["frames"]]
    assert {"filename": "module", "line": 0, "name": "blocks.1.mlp.fc"} in frames
    mine = [f for f in frames if f["filename"] == __file__]
    assert mine and {f["name"] for f in mine} == {"forward"}
    with open(__file__) as source:
        lines = source.read().splitlines()
    assert any("block[" in lines[f["line"] - 1] or "self.out(" in lines[f["line"] - 1] for f in mine)
    assert any(f["filename"].endswith("torch/nn/modules/linear.py") for f in frames)
    assert any(re.fullmatch(r"\w+ = aten\.addmm\.default \(saved activation, forward\)", f["name"]) for f in frames)


def test_torch_memory_viz_renders_it_without_cuda():
    a = memplan.analyze(Stack(), torch.randn(64, 32))
    snap = a.to_snapshot()
    # the flamegraph input of `python -m torch.cuda._memory_viz memory`: blocks alive at the end, by frames
    lines = _memory_viz.memory(snap, format_flamegraph=lambda text: text).splitlines()
    params = [line for line in lines if ";parameter:0:blocks.0.mlp.fc.weight " in line]
    assert len(params) == 1 and params[0].endswith(f" {32 * 128 * 4}")
    grads = [line for line in lines if line.startswith("stream_0;active_allocated;module:0:blocks.1.mlp.fc;")]
    assert grads and any(f"test_snapshot.py:{_line_of('self.out(self.act')}:forward" in line for line in grads)
    # `stats`: its own accounting check passes (blocks tile their segments)
    stats = _memory_viz.segsum(snap)
    active = sum(b["requested_size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert active == a.simulation.after + snap["memplan"]["before_call"]
    assert f"total_allocated: {_memory_viz.Bytes(active)}" in stats
    # `trace`: one line per alloc and per free, sizes in torch's units
    text = _memory_viz.trace(snap)
    trace = snap["device_traces"][0]
    assert text.count("del ") == sum(e["action"] == "free_requested" for e in trace)
    biggest = max(e["size"] for e in trace)
    assert f":{_memory_viz.Bytes(biggest)}]" in text
    # `trace_plot`: the page PyTorch's visualizer opens carries the snapshot as it is
    page = _memory_viz.trace_plot(snap)
    encoded = re.search(r'"base64": "([^"]+)"', page).group(1)
    assert pickle.loads(base64.b64decode(encoded)) == snap


def _line_of(text):
    with open(__file__) as source:
        return next(i for i, line in enumerate(source.read().splitlines(), 1) if text in line and "_line_of" not in line)


def test_the_plan_and_the_model_as_written_each_replay_to_their_peak():
    opt = memplan.optimize(Stack(d=32, depth=3))
    step_fn(opt, (torch.randn(64, 32),), train=True)()
    plan = opt.plan
    eager, planned = plan.to_snapshot("eager"), plan.to_snapshot()
    assert replay_peak(eager) == plan.eager_peak and eager["memplan"]["label"] == "eager"
    assert replay_peak(planned) == plan.planned_peak and planned["memplan"]["label"] == "plan"
    with pytest.raises(ValueError, match="choose 'plan'"):
        plan.to_snapshot("optimized")


MODEL = textwrap.dedent(
    """
    import torch

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
        return model, (torch.randn(16, 32),)
    """
)


def test_cli_writes_snapshots(tmp_path, capsys):
    (tmp_path / "model.py").write_text(MODEL)
    target = f"{tmp_path / 'model.py'}:make"
    assert main(["analyze", target, "--snapshot", str(tmp_path / "a.pickle")]) == 0
    with open(tmp_path / "a.pickle", "rb") as f:
        analyzed = pickle.load(f)
    assert "a.pickle" in capsys.readouterr().err
    assert main(["report", target, "--out", str(tmp_path / "r.html"), "--snapshot", str(tmp_path / "r.pickle")]) == 0
    eager_path, plan_path = snapshot_paths(tmp_path / "r.pickle")
    with open(eager_path, "rb") as f:
        eager = pickle.load(f)
    with open(plan_path, "rb") as f:
        planned = pickle.load(f)
    assert eager["memplan"]["label"] == "eager" and planned["memplan"]["label"] == "plan"
    assert replay_peak(analyzed) == analyzed["memplan"]["peak"] > 0
    assert replay_peak(eager) == eager["memplan"]["peak"] and replay_peak(planned) == planned["memplan"]["peak"]
    with pytest.raises(SystemExit, match="no such directory"):
        main(["analyze", target, "--snapshot", str(tmp_path / "missing" / "a.pickle")])


def test_the_chrome_trace_counters_reach_each_timelines_peak(tmp_path):
    opt = memplan.optimize(Stack(d=32, depth=3))
    step_fn(opt, (torch.randn(64, 32),), train=True)()
    plan, report = opt.plan, opt.report()
    path = report.save_chrome_trace(str(tmp_path / "trace.json"))
    with open(path) as f:
        trace = json.load(f)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {0: report.before.label, 1: report.after.label}
    for pid, peak, ops in ((0, plan.eager_peak, len(report.before.steps)), (1, plan.planned_peak, len(report.after.steps))):
        counters = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["pid"] == pid]
        assert [e["ts"] for e in counters] == list(range(ops))
        assert all(e["args"]["parameters"] == report.parameter_bytes for e in counters)
        assert max(sum(e["args"].values()) - e["args"]["parameters"] for e in counters) == peak


def test_each_allocation_says_what_it_is():
    a = memplan.analyze(Stack(), torch.randn(64, 32))
    said = {re.search(r"\((.*), (forward|backward)\)$", e["frames"][0]["name"]).group(1)
            for e in a.to_snapshot()["device_traces"][0] if e["action"] == "alloc"}
    assert said == {"saved activation", "temporary", "parameter gradient", "output"}


def test_a_measured_snapshot_needs_cuda_and_says_what_to_export_instead():
    from memplan.errors import UnsupportedInputError
    from memplan.measure import measured_snapshot

    with pytest.raises(UnsupportedInputError, match="save_snapshot"):
        measured_snapshot(lambda x: x * 2, torch.ones(8))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_measured_snapshot_of_a_plan_renders_beside_the_predicted_one():
    from memplan.measure import measured_snapshot

    model = Stack(d=32, depth=3).cuda()
    opt = memplan.optimize(model)
    step = step_fn(opt, (torch.randn(64, 32, device="cuda"),), train=True)
    step()
    measured = measured_snapshot(step)
    allocs = [e for trace in measured["device_traces"] for e in trace if e["action"] == "alloc"]
    assert allocs and measured["segments"]
    _memory_viz.segsum(measured)  # torch's own reader takes it
