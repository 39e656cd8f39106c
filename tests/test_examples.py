"""Tests of the example workloads in :mod:`memplan.examples`."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from memplan.examples import SIZES, WORKLOADS, Workload, make

NAMES = list(WORKLOADS)

# Input shapes of the "full" sizes, from the user reports.
FULL_INPUT_SHAPES: dict[str, list[tuple[int, ...]]] = {
    "chain_product": [(500, 1, 40, 200)],
    "broadcast_matmul": [(8192, 512)],
    "maxsim": [(8, 2000, 256), (8, 1990, 256)],
    "latent_gru": [(1000, 64, 128), (64, 256)],
    "seq2seq": [(50, 64), (50, 64)],
}


def _floating_outputs(output: torch.Tensor | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    outputs = (output,) if isinstance(output, torch.Tensor) else tuple(output)
    return [out for out in outputs if out.is_floating_point()]


def _run(workload: Workload, seed: int = 1234) -> list[torch.Tensor]:
    """Run the forward with torch's RNG seeded (latent_gru samples noise inside forward)."""
    torch.manual_seed(seed)
    return _floating_outputs(workload.model(*workload.inputs))


def test_registry_order_and_reports() -> None:
    assert NAMES == ["chain_product", "broadcast_matmul", "maxsim", "latent_gru", "seq2seq"]
    reports = [make(name).seed_report for name in NAMES]
    assert reports == ["000", "001", "002", "003", "004"]


@pytest.mark.parametrize("name", NAMES)
def test_small_workload_metadata(name: str) -> None:
    workload = make(name)
    assert workload.name == name
    assert workload.size == "small"
    assert workload.description and "\n" not in workload.description
    assert workload.model.training
    params = list(workload.model.parameters())
    assert params and all(isinstance(p, torch.nn.Parameter) for p in params)
    for tensor in workload.inputs:
        assert tensor.is_leaf
        if not tensor.is_floating_point():
            assert not tensor.requires_grad


@pytest.mark.parametrize("name", NAMES)
def test_small_training_step_gives_finite_gradients(name: str) -> None:
    workload = make(name)
    outputs = _run(workload)
    assert outputs
    for out in outputs:
        assert torch.isfinite(out).all()
    loss = torch.stack([out.sum() for out in outputs]).sum()
    loss.backward()

    for param_name, param in workload.model.named_parameters():
        assert param.grad is not None, param_name
        assert torch.isfinite(param.grad).all(), param_name
    grad_inputs = [x for x in workload.inputs if x.requires_grad]
    for position, x in enumerate(grad_inputs):
        assert x.grad is not None, position
        assert x.grad.shape == x.shape
        assert torch.isfinite(x.grad).all(), position


@pytest.mark.parametrize("name", NAMES)
def test_small_workload_is_deterministic(name: str) -> None:
    first = make(name, seed=3)
    second = make(name, seed=3)
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(first.inputs, second.inputs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():
        for a, b in zip(_run(first), _run(second), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_seed_changes_the_values() -> None:
    first = make("maxsim", seed=0)
    second = make("maxsim", seed=1)
    assert not torch.equal(first.inputs[0], second.inputs[0])


def test_latent_gru_forward_is_random() -> None:
    workload = make("latent_gru")
    with torch.no_grad():
        first = _run(workload, seed=0)[0]
        second = _run(workload, seed=1)[0]
    assert not torch.equal(first, second)


@pytest.mark.parametrize("name", NAMES)
def test_small_workload_is_traceable_with_fake_tensors(name: str) -> None:
    workload = make(name)
    model = workload.model
    # Parameters go in as graph inputs (as memplan's capture passes them); fake mode rejects real
    # tensors reached through the module's attributes.
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def forward(state: dict[str, torch.Tensor], *inputs: torch.Tensor):
        return torch.func.functional_call(model, state, inputs)

    graph_module = make_fx(forward, tracing_mode="fake")(state, *workload.inputs)
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    assert len(placeholders) == len(state) + len(workload.inputs)
    output_node = next(node for node in graph_module.graph.nodes if node.op == "output")
    returned = output_node.args[0]
    returned = list(returned) if isinstance(returned, (list, tuple)) else [returned]
    traced_shapes = [tuple(node.meta["val"].shape) for node in returned]
    with torch.no_grad():
        eager_shapes = [tuple(out.shape) for out in _run(workload)]
    assert traced_shapes == eager_shapes


def test_latent_gru_trace_keeps_the_random_op() -> None:
    workload = make("latent_gru")
    model = workload.model
    state = dict(model.named_parameters())

    def forward(state: dict[str, torch.Tensor], *inputs: torch.Tensor):
        return torch.func.functional_call(model, state, inputs)

    graph_module = make_fx(forward, tracing_mode="fake")(state, *workload.inputs)
    targets = [node.target for node in graph_module.graph.nodes if node.op == "call_function"]
    assert torch.ops.aten.randn.default in targets


@pytest.mark.parametrize("name", NAMES)
def test_full_size_shapes_on_meta(name: str) -> None:
    workload = make(name, size="full", device="meta")
    assert workload.size == "full"
    assert [tuple(x.shape) for x in workload.inputs] == FULL_INPUT_SHAPES[name]
    for tensor in list(workload.model.parameters()) + list(workload.inputs):
        assert tensor.device.type == "meta"


def test_full_chain_product_parameters() -> None:
    model = make("chain_product", size="full", device="meta").model
    assert tuple(model.bulk.shape) == (1, 1, 39, 200, 200)
    assert tuple(model.p0.shape) == (1, 1, 200)


def test_dtype_is_applied_to_floating_tensors_only() -> None:
    workload = make("seq2seq", dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in workload.model.parameters())
    assert all(x.dtype == torch.int64 for x in workload.inputs)
    workload = make("maxsim", dtype=torch.float64)
    assert all(x.dtype == torch.float64 and x.requires_grad and x.is_leaf for x in workload.inputs)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown workload 'resnet'") as info:
        make("resnet")
    for name in NAMES:
        assert repr(name) in str(info.value)


def test_unknown_size_lists_valid_sizes() -> None:
    with pytest.raises(ValueError, match="unknown size 'medium'") as info:
        make("maxsim", size="medium")
    for size in SIZES:
        assert repr(size) in str(info.value)


def test_non_floating_dtype_is_rejected() -> None:
    with pytest.raises(ValueError, match="floating-point"):
        make("maxsim", dtype=torch.int32)


def test_chain_product_matches_direct_product() -> None:
    from memplan.examples.chain_product import ChainProduct

    torch.manual_seed(0)
    n, t, v, c = 3, 2, 5, 4  # v - 1 = 4 blocks: a full binary tree, so no padding block
    model = ChainProduct(t, v, c).double()
    x = torch.randn(n, t, v, c, dtype=torch.float64)
    expected = torch.empty(n, t, dtype=torch.float64)
    with torch.no_grad():
        for row in range(n):
            for step in range(t):
                vector = model.p0[0, step]
                for i in range(v - 1):
                    vector = (vector * x[row, step, i].exp()) @ model.bulk[0, step, i]
                expected[row, step] = torch.log(vector @ x[row, step, -1].exp())
        torch.testing.assert_close(model(x), expected)


def test_head_matmul_matches_per_head_loop() -> None:
    workload = make("broadcast_matmul")
    x, weight = workload.inputs[0].detach(), workload.model.W.detach()
    heads, dim, _ = weight.shape
    expected = torch.cat([x[:, h * dim : (h + 1) * dim] @ weight[h] for h in range(heads)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(workload.model(x), expected)


def test_maxsim_matches_pairwise_loop() -> None:
    workload = make("maxsim")
    a, b = (x.detach() for x in workload.inputs)
    expected = torch.empty(a.shape[0], b.shape[0])
    for i in range(a.shape[0]):
        for m in range(b.shape[0]):
            expected[i, m] = (a[i] @ b[m].T).max(dim=-1).values.sum()
    with torch.no_grad():
        torch.testing.assert_close(workload.model(a, b), expected, rtol=1e-4, atol=1e-3)
