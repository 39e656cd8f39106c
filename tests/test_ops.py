"""memplan's own operators (``memplan.ops``): values against a dense reference, no hidden memory."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.profiler import ProfilerActivity, profile

import memplan.ops  # noqa: F401  (registers torch.ops.memplan)
from memplan.opschema import mutated_args


def _reference(out, cols, values, dense, per_group, scatter):
    group = torch.arange(cols.numel()) // per_group
    cols = cols.long()
    if scatter:
        return out.index_add(0, cols, dense[group] * values[:, None])
    return out.index_add(0, group, dense[cols] * values[:, None])


@pytest.mark.parametrize("scatter", [False, True])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block", [1, 3, 7, 1000])
@pytest.mark.parametrize("per_group", [1, 5])
def test_grouped_addmm_matches_a_dense_scatter_add(scatter, dtype, block, per_group):
    g = torch.Generator().manual_seed(block * 10 + per_group)
    groups, others, k = 9, 11, 4
    out = torch.randn(others if scatter else groups, k, generator=g)
    dense = torch.randn(groups if scatter else others, k, generator=g)
    cols = torch.randint(0, others, (groups * per_group,), generator=g, dtype=dtype)
    values = torch.randn(groups * per_group, generator=g)
    expected = _reference(out, cols, values, dense, per_group, scatter)
    workspace = torch.empty(2, block, dtype=torch.int64)
    result = torch.ops.memplan.grouped_addmm_(out, cols, values, dense, per_group, scatter, workspace)
    assert result is out
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("scatter", [False, True])
def test_grouped_addmm_allocates_nothing_below_the_dispatcher(scatter):
    """The CPU ruler cannot see inside an operator; the profiler can: no storage is allocated there."""
    torch.manual_seed(0)
    nnz, per_group, k = 640, 20, 16
    groups, others = nnz // per_group, 300
    out = torch.zeros(others if scatter else groups, k)
    dense = torch.randn(groups if scatter else others, k)
    cols = torch.randint(0, others, (nnz,), dtype=torch.int32)
    values, workspace = torch.randn(nnz), torch.empty(2, 64, dtype=torch.int64)
    torch.ops.memplan.grouped_addmm_(out, cols, values, dense, per_group, scatter, workspace)  # warm up
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.ops.memplan.grouped_addmm_(out, cols, values, dense, per_group, scatter, workspace)
    allocated = {e.key: e.self_cpu_memory_usage for e in prof.key_averages() if e.self_cpu_memory_usage > 0}
    assert allocated == {}


def test_grouped_addmm_traces_over_fake_tensors_and_declares_its_writes():
    def f(out, cols, values, dense, workspace):
        return torch.ops.memplan.grouped_addmm_(out, cols, values, dense, 2, True, workspace) * 2

    args = (torch.zeros(5, 3), torch.tensor([0, 4, 1, 1]), torch.randn(4), torch.randn(2, 3), torch.empty(2, 2, dtype=torch.int64))
    gm = make_fx(f, tracing_mode="fake")(*args)
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.memplan.grouped_addmm_.default]
    assert [a.name for a in mutated_args(op)] == [op.args[0].name, op.args[6].name]
    assert tuple(op.meta["val"].shape) == (5, 3)


def test_grouped_addmm_names_what_is_wrong():
    out, dense = torch.zeros(3, 2), torch.randn(4, 2)
    cols, values = torch.tensor([0, 1, 2]), torch.randn(3)
    with pytest.raises(ValueError, match="workspace"):
        torch.ops.memplan.grouped_addmm_(out, cols, values, dense, 1, False, torch.empty(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="groups of 2"):
        torch.ops.memplan.grouped_addmm_(out, cols, values, dense, 2, False, torch.empty(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="int32 or int64"):
        torch.ops.memplan.grouped_addmm_(out, cols.float(), values, dense, 1, False, torch.empty(2, 4, dtype=torch.int64))
