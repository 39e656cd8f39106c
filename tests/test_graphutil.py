"""graphutil's fast paths build what fx and the fake mode would build, only faster."""

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.capture import capture
from memplan._capture.fake import wrap_fake
from memplan.graphutil import copy_graph, create_node, rebuilt_value


def _state(t: FakeTensor) -> tuple:
    return (type(t), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad,
            str(torch._C._dispatch_keys(t)), sorted(t.__dict__.items(), key=lambda kv: kv[0]))


def test_wrap_fake_equals_the_constructor():
    mode = FakeTensorMode()
    storage = torch.UntypedStorage(96, device="meta")
    for dtype, shape, stride, offset in [(torch.float32, (3, 4), (4, 1), 0), (torch.float16, (4, 2), (1, 8), 3)]:
        meta = torch.empty(0, dtype=dtype, device="meta").set_(storage, offset, shape, stride)
        expected = FakeTensor(mode, meta, torch.device("cpu"))
        first = wrap_fake(mode, meta, torch.device("cpu"))  # the constructor's, remembered
        second = wrap_fake(mode, meta, torch.device("cpu"))  # built from what was remembered
        assert _state(first) == _state(expected)
        assert _state(second) == _state(expected)
        assert StorageWeakRef(second.untyped_storage()) == StorageWeakRef(meta.untyped_storage())
        with mode:
            assert _state(second * 2)[:6] == _state(expected * 2)[:6]


def test_rebuilt_value_shares_storages_as_the_original():
    g = capture(lambda x: (x.t(), x[1:]), torch.randn(4, 4), train=False)
    out = next(n for n in g.gm.graph.nodes if n.op == "output")
    t, s = (a.meta["val"] for a in out.args[0])
    rebuilt = rebuilt_value((t, s), {})
    assert [(v.shape, v.stride(), v.storage_offset(), v.dtype, v.device) for v in rebuilt] == \
        [(v.shape, v.stride(), v.storage_offset(), v.dtype, v.device) for v in (t, s)]
    same = StorageWeakRef(rebuilt[0].untyped_storage()) == StorageWeakRef(rebuilt[1].untyped_storage())
    assert same and StorageWeakRef(rebuilt[0].untyped_storage()) != StorageWeakRef(t.untyped_storage())


def test_create_node_matches_fx():
    def build(make):
        g = torch.fx.Graph()
        a, b = g.placeholder("a"), g.placeholder("b")
        out = g.output(a)
        with g.inserting_before(out):
            for _ in range(2):
                make(g, (a, [2, b]), {"alpha": b})
        return g

    fx = build(lambda g, args, kwargs: g.create_node("call_function", torch.add, args, kwargs, "add"))
    ours = build(lambda g, args, kwargs: create_node(g, "call_function", torch.add, args, kwargs, "add"))
    assert str(fx) == str(ours)
    for x, y in zip(fx.nodes, ours.nodes):
        assert [u.name for u in x.users] == [u.name for u in y.users]
        assert [u.name for u in x.all_input_nodes] == [u.name for u in y.all_input_nodes]


def test_copy_graph_matches_fx_graph_copy():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            h = self.lin(x).relu()
            parts = h.split([1, 2], dim=1)
            return parts[0] * y.sum(dim=0, keepdim=True), torch.cat([parts[1], h], dim=1)

    g = capture(Model(), torch.randn(5, 4), torch.randn(2, 1))
    expected = torch.fx.Graph()
    expected.output(expected.graph_copy(g.gm.graph, {}))
    copied = copy_graph(g)
    assert str(copied.gm.graph) == str(expected)
    pairs = list(zip(g.gm.graph.nodes, copied.gm.graph.nodes, expected.nodes))
    for old, ours, fx in pairs:
        assert (ours.name, ours.op, ours.target, ours.type) == (fx.name, fx.op, fx.target, fx.type)
        assert [u.name for u in ours.users] == [u.name for u in fx.users]
        if old.op != "output":
            assert ours.meta == old.meta and ours.meta is not old.meta  # values shared, the dict its own
            assert ours.meta.get("val") is old.meta.get("val")
    # the copy is the passes' to edit: the captured graph stays as it was
    before = str(g.gm.graph)
    relu = next(n for _, n, _ in pairs if n.op == "call_function" and "relu" in str(n.target))
    relu.replace_all_uses_with(relu.args[0])
    copied.gm.graph.erase_node(relu)
    assert str(g.gm.graph) == before
