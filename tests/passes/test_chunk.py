"""The chunk pass: same outputs and gradients, a golden loop body, a lower peak, random-graph invariants."""

import dataclasses
import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from torch import nn

import memplan
import memplan._capture.tracer as tracer
import memplan.examples as examples
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.memory_model import MemoryModel
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors
from memplan.capture import capture
from memplan.graphutil import is_random, packet_name
from memplan.measure import measure
from memplan.analysis.cost import CostRates
from memplan.passes.chunk import (
    REP,
    Barrier,
    ChunkLoop,
    Need,
    Partial,
    Split,
    _output_spec,
    apply_chunk,
    chunk_rule,
    map_view,
    plan_chunk,
    refresh_aliases,
    region_backward,
)
from memplan.passes._chunk.graphs import fake_mode_of
from memplan.pipeline import PassManager
from memplan.policy import Policy
from memplan.steps import step_fn
from memplan.testing import assert_equivalent, is_well_conditioned, random_model, zoo

FORCE = dict(max_overhead=10.0)  # accept any extra compute, so the pass chunks whatever it can


# ----------------------------------------------------------------------------------------------
# hand models the pass has never seen


class PairwiseL1Min(nn.Module):
    """Nearest neighbour by a weighted L1 distance: a (40, 30, 16) broadcast reduced by sum and amin."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x, y):
        return ((x[:, None, :] - y[None, :, :]).abs() * self.w).sum(-1).amin(-1)


class SoftmaxWeightedSum(nn.Module):
    """Attention-like: softmax over keys of projected scores, then a weighted sum of values."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, q, k, v):
        return torch.softmax(self.proj(q) @ k.t() / 32**0.5, dim=-1) @ v


class BroadcastLogSumExp(nn.Module):
    """logsumexp over the middle of a (40, 50, 24) broadcast."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(24))

    def forward(self, x, y):
        return torch.logsumexp(x[:, None, :] + y[None, :, :] + self.bias, dim=1)


class LogSumExpOverBatch(nn.Module):
    """logsumexp over the first dimension: chunks combine by a running log-sum-exp."""

    def forward(self, x, y):
        return torch.logsumexp(x[:, None, :] * y[None, :, :], dim=0)


class MeanOverBatch(nn.Module):
    """A batch mean of a wide activation: chunks combine by a length-weighted sum."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 256)

    def forward(self, x):
        return torch.tanh(self.lin(x)).pow(2).mean(0) * 3


class Generator(nn.Module):
    """A vocabulary projection, log-softmax and NLL over (time, batch): the loss combines chunks by
    their total weight."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 500)

    def forward(self, h, t):
        log_probs = F.log_softmax(self.lin(h), dim=-1)
        return F.nll_loss(log_probs.reshape(-1, 500), t.reshape(-1))


class NormalisedLM(nn.Module):
    """Token embeddings normalised over the whole batch (which ties every sequence to every other), a
    hidden layer, a vocabulary head on (batch, time) and cross-entropy on the flattened logits: the
    batch is independent only from the hidden states on, and ``nn.Linear`` on the 3-d states views
    its product as (batch, time, vocabulary) before the loss flattens it again."""

    def __init__(self, vocab=2000, width=16):
        super().__init__()
        self.embed, self.hidden = nn.Embedding(vocab, width), nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids, targets):
        h = self.embed(ids)
        h = torch.tanh(self.hidden(h - h.mean((0, 1), keepdim=True)))
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class ShiftedGenerator(nn.Module):
    """The generator on targets shifted by one step, as a seq2seq model feeds it."""

    def __init__(self):
        super().__init__()
        self.generator = Generator()

    def forward(self, h, t):
        return self.generator(h, t[1:])


class DropoutPairwise(nn.Module):
    """A pairwise product with dropout inside: the random op must stay outside every loop."""

    def forward(self, x, y):
        return F.dropout(x[:, None, :] * y[None, :, :], 0.3).sum(-1).amax(-1)


class DropoutOfPartialSum(nn.Module):
    """Dropout of a product summed over its middle dimension: chunked along that dimension, the sum is
    a partial result, and the dropout's mask (``bernoulli_`` into an ``empty_like`` of it) reads only a
    replicated value; the random op must still stay outside every loop, drawn once, whole."""

    def forward(self, x, y):
        return F.dropout((x[:, :, None] * y[None]).sum(1), 0.3)


class SelfSimilarityLoss(nn.Module):
    """A contrastive loss over the cosine similarities of a batch with itself (``z @ z.t()``): the rows
    of ``z`` index the rows of the similarities, and the product reads ``z`` whole as its other side."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        z = F.normalize(self.proj(x), dim=-1)
        sim = (z @ z.t() / 0.5).masked_fill(torch.eye(x.shape[0], dtype=torch.bool), float("-inf"))
        return F.cross_entropy(sim, torch.arange(x.shape[0]).roll(1))


class SelfPairwiseNorm(nn.Module):
    """Distances from each point of a batch to its nearest other point: ``z[:, None] - z[None]`` reads two
    views of ``z``, one sliced by the rows and one whole, then a norm over the features."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        z = self.proj(x)
        return ((z[:, None] - z[None]).norm(dim=-1) + 10 * torch.eye(x.shape[0])).amin(-1).sum()


class UnrolledCell(nn.Module):
    """A recurrent cell unrolled over time steps: its batch is an index through every step."""

    def __init__(self):
        super().__init__()
        self.i2h, self.h2h = nn.Linear(8, 16), nn.Linear(16, 16)

    def forward(self, x, h):
        outputs = []
        for t in range(x.shape[0]):
            h = torch.tanh(self.i2h(x[t]) + self.h2h(h))
            outputs.append(h)
        return torch.stack(outputs).pow(2).mean()


def _hand_models():
    torch.manual_seed(0)
    return [
        ("pairwise_l1_min", PairwiseL1Min(), (torch.randn(40, 16, requires_grad=True), torch.randn(30, 16, requires_grad=True))),
        ("softmax_weighted", SoftmaxWeightedSum(), (torch.randn(64, 32, requires_grad=True), torch.randn(48, 32), torch.randn(48, 32, requires_grad=True))),
        ("broadcast_lse", BroadcastLogSumExp(), (torch.randn(40, 24, requires_grad=True), torch.randn(50, 24, requires_grad=True))),
        ("lse_over_batch", LogSumExpOverBatch(), (torch.randn(40, 24, requires_grad=True), torch.randn(50, 24, requires_grad=True))),
        ("mean_over_batch", MeanOverBatch(), (torch.randn(64, 32, requires_grad=True),)),
        ("generator", Generator(), (torch.randn(12, 8, 32, requires_grad=True), torch.randint(0, 500, (12, 8)))),
        ("self_similarity", SelfSimilarityLoss(), (torch.randn(256, 16, requires_grad=True),)),
        ("self_pairwise_norm", SelfPairwiseNorm(), (torch.randn(256, 16, requires_grad=True),)),
    ]


HAND = _hand_models()


# ----------------------------------------------------------------------------------------------
# (a) outputs and gradients


@pytest.mark.parametrize("name,model,inputs", HAND, ids=[h[0] for h in HAND])
def test_hand_models_are_chunked_and_equivalent(name, model, inputs):
    opt = memplan.optimize(model, passes="chunk", **FORCE)
    assert_equivalent(model, opt, *inputs)
    record = opt.plan.records[0]
    assert record.changed, f"{name}: nothing was chunked"
    # (c) the simulated peak is strictly lower
    assert record.peak_after < record.peak_before


@pytest.mark.parametrize("name", ["self_similarity", "self_pairwise_norm"])
def test_a_batch_compared_with_itself_is_chunked_by_its_rows(name):
    # The product (or difference) reads two views of one value: sliced by the rows on one side, it can
    # read the other whole. The rule refused the two sides carrying the index, so the region stopped
    # before the product and the N x N intermediates stayed whole.
    _, model, inputs = next(h for h in HAND if h[0] == name)
    opt = memplan.optimize(model, passes="chunk", **FORCE)
    assert_equivalent(model, opt, *inputs)
    record = opt.plan.records[0]
    assert record.peak_after < record.peak_before / 4


@pytest.mark.parametrize("name,model,inputs", HAND, ids=[h[0] for h in HAND])
def test_hand_models_in_inference(name, model, inputs):
    opt = memplan.optimize(model, passes="chunk", **FORCE)
    assert_equivalent(model, opt, *inputs, grad=False)
    assert opt.plan.records[0].changed and not opt.plan.training


@pytest.mark.parametrize("name", ["chain_product", "maxsim", "seq2seq"])
def test_examples_are_equivalent_at_default_policy(name):
    w = examples.make(name)
    opt = memplan.optimize(w.model, passes="chunk")
    assert_equivalent(w.model, opt, *w.inputs)
    assert opt.plan.planned_peak < opt.plan.eager_peak


@pytest.mark.parametrize("scale", [0.25, 2.0, 4.0])
@pytest.mark.parametrize("name", ["chain_product", "maxsim", "seq2seq"])
def test_examples_are_equivalent_through_the_pipeline_under_other_cost_rates(name, scale):
    """Other machines' rates pick other regions and chunk sizes, and the passes after chunk meet other
    loops: every such plan still gives the model's outputs and gradients."""
    base = CostRates()
    rates = dataclasses.replace(base, flops=base.flops * scale, bandwidth=base.bandwidth * scale,
                                cache_bandwidth=base.cache_bandwidth * scale,
                                index_element=base.index_element / scale)
    w = examples.make(name)
    opt = memplan.optimize(w.model, options={"chunk.rates": rates})
    assert_equivalent(w.model, opt, *w.inputs)
    assert opt.plan.planned_peak < opt.plan.eager_peak


def test_maxsim_after_rewrite_is_equivalent_and_lower():
    w = examples.make("maxsim")
    opt = memplan.optimize(w.model, passes="rewrite,chunk", max_overhead=1.0)
    assert_equivalent(w.model, opt, *w.inputs)
    rewrite, chunk = opt.plan.records
    assert rewrite.changed and chunk.changed and chunk.peak_after < chunk.peak_before


@pytest.mark.parametrize("z", list(zoo()), ids=lambda z: z.name)
def test_zoo_is_untouched_or_equivalent(z):
    opt = memplan.optimize(z.model, passes="chunk", **FORCE)
    assert_equivalent(z.model, opt, *z.inputs)


def test_a_region_whose_tuple_leaves_it_is_dropped_before_its_backward_is_searched(monkeypatch):
    # the latent GRU's batch dimension reaches a split (a tuple) whose items the forward reads outside
    # the region: the analysis gives up before searching the backward, with the answer the full
    # analysis gives
    import memplan.passes.chunk as chunk_module

    w = examples.make("latent_gru")
    graph = capture(w.model, *w.inputs)
    seeds = dict(chunk_module._seed_sets(graph, chunk_module.ChunkOptions.from_options({})))
    batch = {k: v for k, v in seeds.items() if k.startswith("dim 1 of args[0]")}
    assert batch
    searched = []
    real = chunk_module.region_backward
    monkeypatch.setattr(chunk_module, "region_backward", lambda *a, **k: searched.append(1) or real(*a, **k))
    for label, seed in batch.items():
        assert chunk_module._analyse(graph, seed, label) is None
    assert not searched
    monkeypatch.setattr(chunk_module, "_tuple_leaves", lambda *a: False)
    for label, seed in batch.items():
        assert chunk_module._analyse(graph, seed, label) is None
    assert searched


def test_random_op_is_never_chunked():
    model = DropoutPairwise()
    x, y = torch.randn(40, 16, requires_grad=True), torch.randn(30, 16, requires_grad=True)
    opt = memplan.optimize(model, passes="chunk", **FORCE)
    assert_equivalent(model, opt, x, y)  # same RNG seed, same mask: the dropout ran once, whole
    for module in opt.plan.graph.gm.modules():
        if isinstance(module, ChunkLoop):
            for body in module.bodies.values():
                assert not any(is_random(n) for n in body.graph.nodes if n.op == "call_function")


def _loop_bodies(opt):
    return [body for module in opt.plan.graph.gm.modules() if isinstance(module, ChunkLoop)
            for body in module.bodies.values()]


@pytest.mark.parametrize("train", [False, True], ids=["no_grad", "training"])
def test_random_op_reading_only_replicated_values_stays_outside_loops(train):
    # The region runs each op it holds once per chunk; a random op whose inputs are all replicated (the
    # mask of a dropout of a partial sum) once joined it, drawing a mask per chunk where eager draws one.
    model = DropoutOfPartialSum()
    x, y = torch.randn(4, 256, requires_grad=train), torch.randn(256, 4, requires_grad=train)
    opt = memplan.optimize(model, passes="chunk", **FORCE)
    assert_equivalent(model, opt, x, y, grad=train)  # same RNG seed, same mask: one whole draw
    bodies = _loop_bodies(opt)
    assert bodies, "the product is still chunked, with the dropout after the loop"
    for body in bodies:
        assert not any(is_random(n) for n in body.graph.nodes if n.op == "call_function")


def test_random_op_is_a_barrier_whatever_its_inputs_states():
    graph = capture(DropoutOfPartialSum(), torch.randn(4, 256), torch.randn(256, 4), train=False)
    (draw,) = [n for n in graph.gm.graph.nodes if n.op == "call_function" and is_random(n)]
    assert chunk_rule(draw, {}.get) == Barrier("random op")  # every input replicated
    assert chunk_rule(draw, {a: Split(0) for a in draw.all_input_nodes}.get) == Barrier("random op")


# ----------------------------------------------------------------------------------------------
# (b) golden op listing


def _op(node):
    if node.op == "call_module":
        return "loop"
    return packet_name(node) or node.target.__name__


def test_golden_loop_for_pairwise_l1():
    # In inference the cheapest plan chunks y, the dimension amin reduces: chunks combine by min.
    model = PairwiseL1Min()
    x, y = torch.randn(40, 16), torch.randn(30, 16)
    graph = dataclasses.replace(capture(model, x, y, train=False), lifetimes="graph")
    plan = plan_chunk(graph, Policy(max_overhead=10.0))
    (region,) = plan.regions
    assert (region.units, region.chunk) == (30, 2)
    assert region.sources == (("args_1", Split(0)),)
    new = apply_chunk(graph, plan)
    ops = [_op(n) for n in new.gm.graph.nodes if n.op in ("call_function", "call_module")]
    assert ops == ["unsqueeze", "loop", "getitem"]  # x broadcast once; one loop; its output
    (loop,) = [m for m in new.gm.modules() if isinstance(m, ChunkLoop)]
    body = [packet_name(n) for n in loop.bodies["2"].graph.nodes if n.op == "call_function"]
    # abs and mul write into the sub's buffer, which nothing reads after them
    assert body == ["unsqueeze", "sub", "abs_", "mul_", "sum", "amin"]
    assert [o.kind for o in loop.spec.outputs] == ["min"]


def test_golden_states_of_rules():
    x = torch.randn(8, 4)
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda a, w: torch.logsumexp((a @ w).exp(), dim=0), tracing_mode="fake"
    )(x, torch.randn(4, 6))
    a, w, mm, exp, lse = [n for n in gm.graph.nodes][:5]
    states = {a: Split(0)}
    states[mm] = chunk_rule(mm, states.get)
    states[exp] = chunk_rule(exp, states.get)
    assert chunk_rule(lse, states.get) == Partial("lse")
    assert chunk_rule(mm, {w: Split(1)}.get) == Split(1)
    assert chunk_rule(mm, {a: Split(1), w: Split(0)}.get) == Partial("sum")
    assert chunk_rule(exp, {mm: REP}.get) == REP
    assert map_view((16, 64, 32), (1024, 32), Split(0)) == Split(0, 64)


def test_golden_states_of_vector_norms():
    # over other dimensions the index moves as in a sum; a norm over the chunked one has no partial form
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda a: torch.linalg.vector_norm(a, 2, dim=-1) + torch.linalg.vector_norm(a, 2, dim=0, keepdim=True).sum(),
        tracing_mode="fake",
    )(torch.randn(8, 4, 6))
    a, norm, keepdim_norm = [n for n in gm.graph.nodes][:3]
    assert chunk_rule(norm, {a: Split(1)}.get) == Split(1)
    assert chunk_rule(keepdim_norm, {a: Split(1)}.get) == Split(1)
    assert chunk_rule(keepdim_norm, {a: Split(2)}.get) == Split(2)
    assert isinstance(chunk_rule(norm, {a: Split(2)}.get), Barrier)
    assert chunk_rule(norm, {}.get) == REP


def test_golden_states_of_fused_attention():
    # Batch and heads are independent; query positions are when the attention is not causal (each
    # chunk of queries then reads every key, and the keys' gradients add up over the chunks); key
    # positions and features are mixed; with dropout the op draws from the RNG.
    def attention(q, k, v, causal):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).sum()

    def ops(causal):
        q, kv = torch.randn(2, 3, 5, 4, requires_grad=True), torch.randn(2, 3, 6, 4, requires_grad=True)
        graph = capture(attention, q, kv, kv.detach().clone().requires_grad_(), causal)
        return [n for n in graph.gm.graph.nodes if "attention" in str(n.target)]

    (forward, backward) = ops(causal=False)
    q, k, v = forward.args[:3]
    for d in (0, 1):
        assert chunk_rule(forward, {q: Split(d), k: Split(d), v: Split(d)}.get) == (Split(d), Split(d))
        assert chunk_rule(forward, {q: Split(d)}.get) == Need(k, Split(d))
        assert chunk_rule(backward, {a: Split(d) for a in backward.all_input_nodes}.get) == (Split(d),) * 3
    assert chunk_rule(forward, {q: Split(2)}.get) == (Split(2), Split(2))
    grad, query, _, _, out, lse = backward.args[:6]
    assert chunk_rule(backward, {grad: Split(2), query: Split(2), out: Split(2), lse: Split(2)}.get) == (
        Split(2), Partial("sum"), Partial("sum"))
    assert isinstance(chunk_rule(forward, {k: Split(2), v: Split(2)}.get), Barrier)
    assert isinstance(chunk_rule(forward, {q: Split(3)}.get), Barrier)
    (causal, _) = ops(causal=True)
    assert chunk_rule(causal, {causal.args[0]: Split(2)}.get) == Barrier("causal attention along the query positions")
    assert not is_random(forward)
    forward.args = (q, k, v, 0.5, False)  # dropout (on the CPU, torch runs it unfused: set it by hand)
    assert is_random(forward)
    assert chunk_rule(forward, {q: Split(0), k: Split(0), v: Split(0)}.get) == Barrier("random op")


class AttentionThenVocabulary(nn.Module):
    """Queries attend to a few keys (not causally), then each attended vector is scored against a
    vocabulary, and the softmax of the scores weighs the vocabulary back: the scores are the large
    value, and the softmax mixes the vocabulary."""

    def __init__(self):
        super().__init__()
        self.vocabulary = nn.Parameter(torch.randn(16, 600) * 0.1)

    def forward(self, q, k, v):
        scores = F.scaled_dot_product_attention(q, k, v) @ self.vocabulary
        return (scores.softmax(-1) @ self.vocabulary.t()).pow(2).sum()


@pytest.mark.parametrize("train", [True, False])
def test_attention_runs_in_chunks_of_queries_or_batch_and_is_equivalent(train):
    # With only the walks back to where the index enters (no region starting at the small attention
    # output), the region holds the attention: queries, keys and values are sliced (or handed whole).
    torch.manual_seed(0)
    model = AttentionThenVocabulary()
    inputs = [torch.randn(2, 2, 48, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)]
    inputs = [t.requires_grad_(train) for t in inputs]
    opt = memplan.optimize(model, passes="chunk", options={"chunk.shallow_fraction": 0.0}, **FORCE)
    if train:
        assert_equivalent(model, opt, *inputs)
    else:
        assert_equivalent(model, opt, *inputs, grad=False)
    loops = [m for m in opt.plan.graph.gm.modules() if isinstance(m, ChunkLoop)]
    assert loops and any("attention" in str(n.target) for loop in loops for body in loop.bodies.values()
                         for n in body.graph.nodes)


def test_a_partial_sum_times_itself_is_not_partial():
    """``p * p`` and ``p / p`` read one partial node twice: not linear, whatever the node count says."""
    graph = torch.fx.Graph()
    p, q = graph.placeholder("p"), graph.placeholder("q")
    states = {p: Partial("sum"), q: REP}
    for target in (torch.ops.aten.mul.Tensor, torch.ops.aten.div.Tensor):
        twice, once = graph.call_function(target, (p, p)), graph.call_function(target, (p, q))
        for node in (p, q, twice, once):
            node.meta["val"] = torch.empty(8, 6, device="meta")
        assert not isinstance(chunk_rule(twice, states.get), Partial), target
        assert chunk_rule(once, states.get) == Partial("sum"), target


# ----------------------------------------------------------------------------------------------
# (c) counts and peaks


def test_maxsim_peak_is_much_lower_and_the_ruler_agrees():
    w = examples.make("maxsim")
    opt = memplan.optimize(w.model, passes="rewrite,chunk", max_overhead=1.0)
    step = step_fn(opt, w.inputs, train=True)
    step()
    measured = measure(step).peak
    eager = measure(step_fn(w.model, w.inputs, train=True)).peak
    assert measured * 15 < eager  # nested chunks: the i of each pair, then the tokens j
    assert abs(measured - opt.plan.planned_peak) <= 0.05 * opt.plan.planned_peak  # the ruler agrees


def test_more_chunks_lower_peak_and_more_overhead():
    graph = dataclasses.replace(capture(BroadcastLogSumExp(), torch.randn(40, 24), torch.randn(50, 24), train=False), lifetimes="graph")
    peaks = []
    for counts in ((2,), (8,)):
        plan = plan_chunk(graph, Policy(max_overhead=10.0), {"chunk.counts": counts})
        peaks.append(AnalysisManager(apply_chunk(graph, plan)).get(PeakSimulation).peak)
    assert peaks[1] < peaks[0] < AnalysisManager(graph).get(PeakSimulation).peak


def test_budget_picks_the_least_overhead_that_fits():
    model = BroadcastLogSumExp()
    graph = dataclasses.replace(capture(model, torch.randn(40, 24), torch.randn(50, 24), train=False), lifetimes="graph")
    base = AnalysisManager(graph).get(PeakSimulation).peak
    tight, loose = apply_chunk(graph, plan_chunk(graph, Policy(budget=base // 10))), apply_chunk(graph, plan_chunk(graph, Policy(budget=base // 2)))
    tight_peak = AnalysisManager(tight).get(PeakSimulation).peak
    loose_peak = AnalysisManager(loose).get(PeakSimulation).peak
    assert tight_peak <= base // 10 and loose_peak <= base // 2 and tight_peak <= loose_peak


def test_full_size_maxsim_plans_under_64_mib():
    # Planning runs on fake tensors: the full-size plan is checked without running it (the benchmark runs it).
    w = examples.make("maxsim", size="full")
    graph = capture(w.model, *w.inputs, seed="tangents")
    result = memplan.pipeline.PassManager("rewrite,chunk", Policy(budget="64MiB")).run(graph)
    assert result.records[-1].peak_after <= 64 * 2**20


def test_generator_is_chunked_over_time_despite_shared_sequence_numbers():
    # The targets' slice shares its autograd sequence number with the log-probabilities' view, and
    # gradient accumulations carry a stale one: the region's backward is still found, by dataflow.
    model = ShiftedGenerator()
    h, t = torch.randn(12, 8, 32, requires_grad=True), torch.randint(0, 500, (13, 8))
    graph = dataclasses.replace(capture(model, h, t), lifetimes="graph")
    (region,) = plan_chunk(graph, Policy(max_overhead=10.0)).regions
    assert region.units == 12 and any(n.startswith("_log_softmax_backward") for n, _ in region.backward)
    assert region_backward(graph, [n for n, _ in region.forward]) is not None


def test_the_logits_of_a_head_after_batch_mixing_layers_are_never_made_whole():
    # Walked back to where the batch enters the graph, the logits' batch index meets the batch-wide
    # normalisation and the region stops short of the product; walked back only to the first value
    # small enough to keep whole (the hidden states), the region holds the head's product, its views
    # and the loss, so no value outside the loops is as large as the logits.
    model = NormalisedLM()
    ids, targets = torch.randint(0, 2000, (4, 16)), torch.randint(0, 2000, (4, 16))
    opt = memplan.optimize(model, passes="chunk", **FORCE)
    assert_equivalent(model, opt, ids, targets)
    logits = ids.numel() * 2000 * 4  # bytes
    graph = opt.plan.graph.gm.graph
    assert any(n.op == "call_module" for n in graph.nodes)
    # the largest value outside the loops' bodies (a loop's scratch counts: it is one value)
    largest = max(v.numel() * v.element_size() for n in graph.nodes for v in _values(n.meta.get("val")))
    assert largest < logits


def test_a_loop_output_with_gaps_keeps_its_order_in_memory():
    # q of a fused projection (its part of each row, heads in front of time): the loop cannot write the
    # gaps, and writes a dense tensor in the same order of dimensions, as empty_like would.
    graph = capture(lambda x: x.split(8, -1)[0].view(2, 5, 2, 4).transpose(1, 2) * 1, torch.randn(2, 5, 24),
                    train=False)
    q = next(n for n in graph.gm.graph.nodes if n.name.startswith("transpose"))
    assert q.meta["val"].stride() == (120, 4, 24, 1)
    spec = _output_spec(q, Split(0))
    assert (spec.shape, spec.stride) == ((2, 2, 5, 4), (40, 4, 8, 1))


def test_ops_after_a_relaid_loop_output_are_laid_out_again_or_refused():
    # ``b = a * 2`` follows ``a``'s layout; a loop that makes ``a`` in another layout changes ``b``'s.
    # Then ``b.sum(0)`` is fine, but a view that needed ``b``'s old layout is refused (ValueError: the
    # region is not a candidate) rather than left to fail when the plan runs.
    def fn(x, flat):
        b = x.t() * 2
        return (b.t().reshape(-1) if flat else b.sum(0))

    for flat in (False, True):
        graph = capture(fn, torch.randn(3, 4), flat, train=False)
        nodes = {n.name: n for n in graph.gm.graph.nodes}
        a, b = nodes["t"], nodes["mul"]
        assert b.meta["val"].stride() == (1, 4)
        mode = fake_mode_of(graph.gm.graph)
        with mode:
            a.meta["val"] = torch.empty(4, 3)  # as a loop writing it densely would
        if flat:
            with pytest.raises(ValueError, match="cannot run on the layout"):
                refresh_aliases(graph.gm.graph, [a], mode, relaid=[a])
        else:
            refresh_aliases(graph.gm.graph, [a], mode, relaid=[a])
            assert b.meta["val"].stride() == (3, 1)


def _values(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _values(v)]
    return []


# ----------------------------------------------------------------------------------------------
# (d) random-graph invariants


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000))
@example(seed=8302)  # squares a partial sum: mul(p, p)
@example(seed=4342)  # sin of a squared exp: skipped, ill-conditioned
@example(seed=3122)  # sin of a matmul of exp(2 exp(x)), about 1e18: skipped, ill-conditioned
def test_random_programs_are_untouched_or_equivalent(seed):
    # A chunk's smaller matmuls use another kernel blocking: another rounding, not another answer.
    # In float64 that difference is far below the tolerance, unless the program amplifies rounding
    # (then even float64 is off by more): such programs are skipped, about 1 in 100.
    model, inputs = random_model(seed, requires_grad_input=True)
    assume(is_well_conditioned(model, *inputs))
    model = model.double()
    inputs = tuple(x.detach().double().requires_grad_(x.requires_grad) for x in inputs)
    opt = memplan.optimize(model, passes="chunk", **FORCE)
    assert_equivalent(model, opt, *inputs)
    record = opt.plan.records[0]
    assert record.peak_after <= record.peak_before
    if not record.changed:
        assert not any(isinstance(m, ChunkLoop) for m in opt.plan.graph.gm.modules())


def test_a_body_that_fails_to_trace_leaves_no_error_in_the_log(monkeypatch, fake_tensor_log):
    # Random program 3085 has a region whose body does not trace at its first chunk size (a broadcast
    # the rules missed): the candidate is dropped, and torch's traceback of the failing meta kernel
    # must not reach the user's terminal. (The region cannot be placed either, which the pass now
    # finds before building it: the check is switched off here to reach the trace.)
    from memplan.passes import chunk as chunk_pass

    monkeypatch.setattr(chunk_pass, "_placeable", lambda graph, region, tensors: True)
    dropped = []
    quiet = tracer._META_FAILURES.filter
    monkeypatch.setattr(tracer._META_FAILURES, "filter", lambda r: quiet(r) or dropped.append(r))
    model, inputs = random_model(3085, requires_grad_input=True)
    opt = memplan.optimize(model, passes="chunk", **FORCE)
    assert_equivalent(model, opt, *inputs)
    assert dropped and fake_tensor_log == []


def test_plans_are_deterministic():
    graph = dataclasses.replace(capture(PairwiseL1Min(), torch.randn(40, 16), torch.randn(30, 16)), lifetimes="graph")
    assert plan_chunk(graph, Policy(max_overhead=10.0)) == plan_chunk(graph, Policy(max_overhead=10.0))


# ----------------------------------------------------------------------------------------------
# planning: one build per region variant, and bounds that prune without building


def _regions_of(model, inputs, train=True):
    from memplan.analysis.tensors import Tensors
    from memplan.passes import chunk as chunk_pass

    graph = dataclasses.replace(capture(model, *inputs, train=train), lifetimes="graph")
    am = AnalysisManager(graph)
    return graph, am, chunk_pass._regions(graph, chunk_pass.ChunkOptions(), am.get(Tensors))


class _OuterProductStates(nn.Module):
    """A linear-attention recurrence unrolled in Python: a (batch, d, d) state per step, each a seed."""

    def __init__(self, d=16):
        super().__init__()
        self.k, self.v = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        state, outs = x.new_zeros(x.shape[0], x.shape[2], x.shape[2]), []
        for t in range(x.shape[1]):
            state = 0.9 * state + F.elu(self.k(x[:, t]))[:, :, None] * self.v(x[:, t])[:, None, :]
            outs.append(state.sum(1))
        return torch.stack(outs, 1).square().mean()


def test_regions_from_neighbouring_steps_are_evaluated_once():
    # Each step's state seeded a region one step longer than the last: three regions differing in a few
    # nodes out of hundreds took the three places to evaluate, each built and priced to the same verdict.
    _, _, regions = _regions_of(_OuterProductStates(), (torch.randn(8, 40, 16),))
    assert regions
    for i, a in enumerate(regions):
        a_nodes = {n for n, _ in a.forward} | {n for n, _ in a.backward}
        for b in regions[:i]:
            b_nodes = {n for n, _ in b.forward} | {n for n, _ in b.backward}
            assert a.units != b.units or len(a_nodes & b_nodes) < 0.95 * max(len(a_nodes), len(b_nodes))


class _CentredBlocks(nn.Module):
    """Identical MLP blocks, each after a centring over the batch, which mixes the rows: every block's
    MLP is a region of its own along the rows, and the regions tie on peak and overhead."""

    def __init__(self, width=32, layers=3):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(width, 8 * width) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(8 * width, width) for _ in range(layers))

    def forward(self, x):
        for up, down in zip(self.up, self.down):
            x = x - x.mean(0, keepdim=True)
            x = x + down(F.gelu(up(x)))
        return x


class _PaddedHead(nn.Module):
    def __init__(self, width=64, vocab=500):
        super().__init__()
        self.head = nn.Linear(width, vocab)

    def forward(self, x, targets, weight=None):
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten(), weight=weight)


def test_a_chunk_of_ignored_targets_only_adds_nothing_to_a_mean_loss():
    # A chunk's mean NLL is its sum over its total weight: 0/0 for a sequence of padding only (or of
    # classes of weight 0), and nan times 0 made the whole loss nan while eager's skips those rows.
    torch.manual_seed(0)
    model, x = _PaddedHead(), torch.randn(4, 32, 64, requires_grad=True)
    targets = torch.randint(0, 500, (4, 32))
    targets[3] = -100  # the last sequence is padding
    weight = torch.ones(500)
    weight[targets[1]] = 0  # and the second one's classes weigh nothing
    options = {"chunk.counts": (4,)}  # a chunk per sequence
    for kwargs in ({}, {"weight": weight}):
        opt = memplan.optimize(model, passes="chunk", options=options)
        assert_equivalent(model, opt, x, targets, kwargs=kwargs)
        assert any(n.op == "call_module" for n in opt.plan.graph.gm.graph.nodes)  # the loss runs in a loop
        with torch.no_grad():  # the inference plan
            planned = memplan.optimize(model, passes="chunk", options=options)(x, targets, **kwargs)
            torch.testing.assert_close(planned, model(x, targets, **kwargs))
    with torch.no_grad():  # every target ignored: nan, as eager gives
        assert memplan.optimize(model, passes="chunk", options=options)(x, torch.full_like(targets, -100)).isnan()


def test_of_regions_the_policy_cannot_tell_apart_the_latest_is_chunked():
    # The tie went to whichever label sorted first (or to rounding in the cost sums). In training the
    # backward meets a later block first, while the most is held: its region is the one to chunk.
    torch.manual_seed(0)
    model, x = _CentredBlocks(), torch.randn(256, 32, requires_grad=True)
    graph = capture(model, x, seed="tangents")
    result = PassManager("chunk", Policy(max_overhead=10.0), options={"chunk.regions": 1}).run(graph)
    (region,) = result.records[0].plan.regions
    position = {n.name: i for i, n in enumerate(graph.gm.graph.nodes)}
    second_block = position["addmm_2"]  # the first block's MLP is addmm and addmm_1
    assert region.label.startswith("dim 0 of addmm_2")
    assert min(position[n] for n, _ in region.forward) >= second_block
    assert_equivalent(model, memplan.optimize(model), x)


@pytest.mark.parametrize("name,model,inputs", HAND[:4], ids=[h[0] for h in HAND[:4]])
def test_one_built_body_prices_every_chunk_length(name, model, inputs):
    # A body at another chunk length has the same nodes, storages and live intervals; values that
    # carry the index scale with the length. So one build gives every length's peak and cost exactly.
    from memplan.passes import chunk as chunk_pass
    from memplan.analysis.cost import CostRates, module_cost
    from memplan.passes._chunk.loops import BodyModel, body_peak

    graph, _, regions = _regions_of(model, inputs)
    rates = CostRates()
    checked = 0
    for region in regions[:2]:
        sizes = sorted({-(-region.units // k) for k in (2, 3, 8) if k <= region.units}, reverse=True)
        applied = chunk_pass._apply_region(graph, dataclasses.replace(region, chunk=sizes[0]), compile=False)
        built = applied.loops_for(sizes[0])
        models = [BodyModel.of(loop.bodies[str(sizes[0])], scales, sizes[0]) for (_, loop), scales in zip(built, applied.scales)]
        for size in sizes:
            for (_, loop), body_model in zip(applied.loops_for(size), models):
                for length, body in loop.bodies.items():
                    assert body_model.peak(int(length)) == body_peak(body)
                    assert body_model.cost(int(length), rates) == pytest.approx(module_cost(body, rates), rel=1e-9)
                    checked += 1
    assert checked


_RECURRENT = ("unrolled_cell", UnrolledCell(), (torch.randn(6, 8, 8, requires_grad=True), torch.randn(8, 16)))


def test_a_region_is_placeable_exactly_when_its_loops_can_be_built():
    # The check made before building (no cycle once each loop's nodes are one node) agrees with the
    # build itself on every region and variant found, placeable or not (chain_product has both).
    from memplan.passes import chunk as chunk_pass

    cases = [(n, m, i) for n, m, i in HAND] + [_RECURRENT]
    for name in ("chain_product", "maxsim", "seq2seq"):
        w = examples.make(name)
        cases.append((name, w.model, w.inputs))
    outcomes = set()
    for name, model, inputs in cases:
        graph, _, regions = _regions_of(model, inputs)
        for region in regions:
            for variant, sizes in chunk_pass._variants(graph, region, chunk_pass.ChunkOptions()):
                placeable = chunk_pass._placeable(graph, variant, AnalysisManager(graph).get(Tensors))
                try:
                    chunk_pass._apply_region(graph, dataclasses.replace(variant, chunk=sizes[0]), compile=False)
                    built = True
                except ValueError as exc:
                    if "cycle" not in str(exc):
                        continue  # refused for another reason (a layout): says nothing about cycles
                    built = False
                assert placeable == built, (name, variant.label)
                outcomes.add(built)
    assert outcomes == {True, False}


@pytest.mark.parametrize("name,model,inputs", HAND + [_RECURRENT], ids=[h[0] for h in HAND + [_RECURRENT]])
def test_pruning_bounds_never_exceed_what_is_built(name, model, inputs):
    # Regions are skipped when their peak bound or overhead bound already fails the policy: both must
    # be lower bounds of every candidate the region would have produced. (In the unrolled cell, the
    # loops chunking the batch make every step's value at once: the bound counts them from there.)
    from memplan.passes import chunk as chunk_pass
    from memplan.analysis.cost import graph_cost

    graph, am, regions = _regions_of(model, inputs)
    options = chunk_pass.ChunkOptions()
    base_cost = graph_cost(graph, options.rates)
    memory = am.get(MemoryModel)
    for region in regions:
        peak_bound = chunk_pass._peak_bound(graph, region, memory)
        for variant, sizes in chunk_pass._variants(graph, region, options):
            candidates = chunk_pass._evaluate(graph, variant, sizes, base_cost, options, Policy(max_overhead=100.0))
            fewest = -(-region.units // sizes[0])
            overhead_bound = chunk_pass._overhead_bound(graph, variant, options.rates, fewest) / base_cost
            for c in candidates:
                assert peak_bound <= c.peak, c.label
                assert overhead_bound <= c.overhead + 1e-9, c.label


# ----------------------------------------------------------------------------------------------
# loop bodies: cheap values computed again where they are read late, narrow saved indices, no
# layout copy of a loop output already in its leaf's layout


def test_body_recomputes_a_cheap_value_read_late_and_holds_less():
    from memplan.passes._chunk.graphs import fake_mode_of
    from memplan.passes._chunk.loops import AGAIN, body_graph, rematerialise_cheap

    def f(x):
        u = x.exp()
        v = u.clamp(min=0.5)  # read early (by the product) and late (by the last line)
        big = (v @ v.t()).tanh().sum()
        return (big + (v * u).sum(),)

    x = torch.randn(64, 64)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(x)
    reference = torch.fx.experimental.proxy_tensor.make_fx(f)(x)
    before = AnalysisManager(body_graph(gm)).get(PeakSimulation).peak
    assert rematerialise_cheap(gm.graph, fake_mode_of(gm.graph)) == 1  # (c) one value, once
    gm.recompile()
    assert any(n.name.endswith(AGAIN) for n in gm.graph.nodes)
    assert AnalysisManager(body_graph(gm)).get(PeakSimulation).peak < before
    torch.testing.assert_close(gm(x)[0], reference(x)[0])


def test_saved_indices_are_stored_narrow_and_factories_never_saved():
    # chain_product's saved variant keeps the maxima and their indices (over 48 states: uint8), never
    # the zero padding block (a factory: free to make again)
    w = examples.make("chain_product")
    opt = memplan.optimize(w.model, passes="rewrite,chunk")
    assert_equivalent(w.model, opt, *w.inputs)
    (chunk_record,) = [r for r in opt.plan.records if r.name == "chunk"]
    saved = [name for region in chunk_record.plan.regions for name in region.saved]
    assert saved and not any(name.startswith(("new_zeros", "zeros")) for name in saved)
    dtypes = [out.dtype for m in opt.plan.graph.gm.modules() if isinstance(m, ChunkLoop) for out in m.spec.outputs]
    assert torch.uint8 in dtypes and torch.int64 not in dtypes


def test_maxsim_gradient_is_not_copied_into_its_layout_and_the_ruler_agrees():
    w = examples.make("maxsim")
    opt = memplan.optimize(w.model, passes="rewrite,chunk")
    step = step_fn(opt, w.inputs, train=True)
    step()
    graph = opt.plan.graph.gm.graph
    loop_items = {n for n in graph.nodes if n.target is operator.getitem and n.args[0].op == "call_module"}
    assert not [n for n in graph.nodes if packet_name(n) == "copy_" and n.args[1] in loop_items]
    measured = measure(step).peak
    assert measured * 15 < measure(step_fn(w.model, w.inputs, train=True)).peak  # (eager: its gradient in place)
    assert abs(measured - opt.plan.planned_peak) <= 0.05 * opt.plan.planned_peak


@pytest.mark.parametrize("name,model,inputs", HAND, ids=[h[0] for h in HAND])
def test_bodies_write_in_place_only_into_values_they_made(name, model, inputs):
    """(d) The inplace pass runs on every body: its ops write into values the chunk made and nothing
    reads later, never into a loop input (a slice of a tensor other chunks still read)."""
    from memplan.graphutil import mutated_args
    from memplan.passes._chunk.graphs import ALIAS_OPS

    opt = memplan.optimize(model, passes="chunk", **FORCE)
    assert_equivalent(model, opt, *inputs)
    for module in opt.plan.graph.gm.modules():
        if not isinstance(module, ChunkLoop):
            continue
        for body in module.bodies.values():
            for node in body.graph.nodes:
                for target in mutated_args(node) if node.op == "call_function" else ():
                    while packet_name(target) in ALIAS_OPS:
                        target = target.args[0]
                    # a loop's own accumulator is the only input a body adds into
                    assert target.op != "placeholder" or target.name.endswith("_acc"), node.format_node()


def test_body_negates_the_sum_not_the_gradient_and_folds_it_into_a_subtraction():
    from memplan.passes._chunk.graphs import fake_mode_of
    from memplan.passes._chunk.loops import sink_negations

    def f(a, g):
        # the gradient of m in x - m (m broadcast over dim 1), added to another contribution
        return (a + (-g).sum(1, keepdim=True), (-g).sum(0) * 2)

    a, g = torch.randn(64, 1), torch.randn(64, 48)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(a, g)
    reference = torch.fx.experimental.proxy_tensor.make_fx(f)(a, g)
    assert sink_negations(gm.graph, fake_mode_of(gm.graph)) == 3  # two sums, one addition
    gm.recompile()
    assert [packet_name(n) for n in gm.graph.nodes if n.op == "call_function"] == ["sum", "sub", "sum", "neg", "mul"]
    for got, want in zip(gm(a, g), reference(a, g)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # exact: a change of sign rounds symmetrically


def test_more_threads_speed_up_whole_ops_only_above_the_grain():
    from memplan.analysis.cost import OpWork

    big = OpWork(fixed_bytes=8 * 2**20, elements=2**20)
    small = OpWork(fixed_bytes=8 * 2**14, elements=2**14)  # below the grain: one thread
    one, two = CostRates(threads=1), CostRates(threads=2)
    assert two.ways(2**20) == 2 and two.ways(2**14) == 1 and one.ways(2**20) == 1
    assert big.price(two) < 0.6 * big.price(one)
    assert small.price(two) == small.price(one)
    # a chunk 1/64 of the op's length is below the grain again: a second thread does not help it
    chunked = OpWork(scaled_bytes=8 * 2**20, elements=2**20, elements_scale=True)
    assert chunked.price(two) < 0.6 * chunked.price(one)
    assert chunked.price(two, 1 / 64) == chunked.price(one, 1 / 64)


def test_chunking_costs_more_at_two_threads_and_the_default_prices_one():
    """The original graph's whole-batch ops use both threads, a chunk's small ops fewer: the same chunked
    graph is priced further above the original at two threads. The default prices one thread, so plans
    do not depend on the machine's cores."""
    from memplan.analysis.cost import graph_cost

    assert CostRates().threads == 1
    w = examples.make("chain_product")
    graph = dataclasses.replace(capture(w.model, *w.inputs, train=True), lifetimes="graph")
    plan = plan_chunk(graph, Policy(**FORCE), {"chunk.counts": (16,)})
    assert plan.regions and plan.regions[0].chunks == 16
    new = apply_chunk(graph, plan)
    overhead = {t: graph_cost(new, CostRates(threads=t)) / graph_cost(graph, CostRates(threads=t)) - 1 for t in (1, 2)}
    assert overhead[2] > overhead[1] + 0.1


def test_golden_states_of_the_grouped_product():
    """Entries sliced with their groups: the gather is sliced like its rows, the scatter into zeros a
    partial sum; a whole operand is asked to be sliced, a dense operand sliced unlike its groups is not."""
    import memplan.ops  # noqa: F401

    def f(cols, values, a, b):
        grad_a = torch.ops.memplan.grouped_addmm_(torch.zeros(8, 4), cols, values, b, 3, False, torch.empty(2, 5, dtype=torch.int64))
        grad_b = torch.ops.memplan.grouped_addmm_(torch.zeros(10, 4), cols, values, a, 3, True, torch.empty(2, 5, dtype=torch.int64))
        return grad_a, grad_b

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(
        torch.zeros(24, dtype=torch.int64), torch.randn(24), torch.randn(8, 4), torch.randn(10, 4))
    nodes = {n.name: n for n in gm.graph.nodes}
    cols, values, a, b = (nodes[k] for k in ("cols_1", "values_1", "a_1", "b_1"))
    gather, scatter = [n for n in gm.graph.nodes if packet_name(n) == "grouped_addmm_"]
    zero_a, zero_b = gather.args[0], scatter.args[0]
    entries = {cols: Split(0, 6), values: Split(0, 6)}
    assert chunk_rule(gather, {**entries, zero_a: Split(0, 2)}.get) == Split(0, 2)
    assert chunk_rule(gather, entries.get, lambda n: n is zero_a).node is zero_a  # Need: rows of out
    assert chunk_rule(scatter, {**entries, a: Split(0, 2)}.get, lambda n: n is zero_b) == Partial("sum")
    assert chunk_rule(scatter, {cols: Split(0, 6), a: Split(0, 2)}.get, lambda n: n is zero_b).node is values
    assert chunk_rule(scatter, {**entries, a: Split(0, 1)}.get, lambda n: n is zero_b) == Barrier("grouped_addmm_ with groups sliced unlike their entries")
    assert isinstance(chunk_rule(gather, {**entries, zero_a: Split(0, 2), b: Split(0, 1)}.get), Barrier)


def test_maxsim_is_15x_lower_with_its_gradient_written_in_place_by_the_loop():
    """The backward's selections are sparse products (no gathered rows), and each chunk's rows of the
    gradient of a are written straight into the result (no chunk-sized copy)."""
    w = examples.make("maxsim")
    opt = memplan.optimize(w.model)
    step = step_fn(opt, w.inputs, train=True)
    step()
    loops = [m for m in opt.plan.graph.gm.modules() if isinstance(m, ChunkLoop)]
    assert any(out.into for loop in loops for out in loop.spec.outputs)
    measured = measure(step).peak
    # eager writes the gradient of its max in place (4.96 MiB here); the floor is the gradients of the
    # inputs, 278 KiB, 1/17.9 of it
    assert measured * 15 <= measure(step_fn(w.model, w.inputs, train=True)).peak
    assert abs(measured - opt.plan.planned_peak) <= 0.05 * opt.plan.planned_peak
    assert_equivalent(w.model, opt, *w.inputs)


@pytest.mark.parametrize("dim", [0, 1])
def test_a_loop_writes_each_chunk_into_its_slice_or_copies_where_the_slice_is_strided(dim):
    """``LoopOutput.into``: the body adds into the zero tensor the loop passes it. Along dim 0 of a
    contiguous result that is the chunk's slice itself (written in place); along dim 1 the slice is
    strided, so the loop passes a fresh zero tensor and copies it in. Both give the whole result."""
    from torch.fx.graph import _BoxedCodeGen

    from memplan.passes._chunk.loops import LoopInput, LoopOutput, LoopSpec

    bodies = {}
    for length in (2, 1):  # chunks of two units, and a last one of one
        graph = torch.fx.Graph()
        part, zero = graph.placeholder("x_in"), graph.placeholder("zero_out")
        flat = graph.call_function(torch.ops.aten.reshape.default, (part, [-1]))
        added = graph.call_function(torch.ops.aten.add_.Tensor, (zero, flat))
        shaped = (length * 6,) if dim == 0 else (6, length)
        graph.output((graph.call_function(torch.ops.aten.view.default, (added, list(shaped))),))
        graph.set_codegen(_BoxedCodeGen())
        bodies[length] = torch.fx.GraphModule(torch.nn.Module(), graph)
    # the result: (24,) cut into chunks of 2 x 6 elements, or (6, 5) cut along its columns, 2 at a time;
    # the body's zero tensor holds a chunk's values flattened: 6 per unit
    x, inner = (torch.randn(24), 6) if dim == 0 else (torch.randn(6, 5), 1)
    spec = LoopSpec(
        units=x.shape[dim] // inner, chunk=2, inputs=(LoopInput(dim, inner),),
        outputs=(LoopOutput("cat", dim, inner, tuple(x.shape), x.stride(), into=6, acc_shape=(x.numel(),)),),
        scratch=0,
    )
    (result, _scratch) = ChunkLoop(spec, bodies)(x)
    torch.testing.assert_close(result, x, rtol=0, atol=0)


class GatherByIndexFilledInPlace(nn.Module):
    """The index of a gather built by an in-place write into zeros (``idx[:, 1] = labels``): the chunked
    backward recomputes the zeros, and must fill them again before its gather's gradient scatters."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 4096)

    def forward(self, x, labels):
        logp = self.proj(x).log_softmax(-1)
        index = torch.zeros(x.shape[0], 2, dtype=torch.long)
        index[:, 1] = labels
        return -logp.gather(1, index).mean()


def test_a_recomputed_value_is_recomputed_with_its_in_place_writes():
    torch.manual_seed(0)
    model = GatherByIndexFilledInPlace()
    x, labels = torch.randn(256, 32, requires_grad=True), torch.randint(1, 4096, (256,))
    opt = memplan.optimize(model, budget="7MiB")
    assert_equivalent(model, opt, x, labels)
    assert any(r.name == "chunk" and r.changed for r in opt.plan.records)


class _HalfDistances(nn.Module):
    """Squared distances summed over features in a half-precision dtype, then cast up."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.a, self.dtype = nn.Linear(32, 64), dtype

    def forward(self, x, y):
        h, g = self.a(x).to(self.dtype), self.a(y).to(self.dtype)
        return ((h[:, None, :] - g[None, :, :]) ** 2).sum(-1).float()


@pytest.mark.parametrize("options", [{}, {"passes": ["chunk"], "max_overhead": 10.0}])
def test_half_precision_sums_are_not_split_over_the_summed_dimension(options):
    # Chunks of the summed features each rounded their partial sum, or added them after the cast up: the
    # results were no longer bfloat16 values, up to 0.375 off eager's, which rounds the whole sum once.
    torch.manual_seed(0)
    model, x, y = _HalfDistances(torch.bfloat16), torch.randn(64, 32), torch.randn(48, 32)
    opt = memplan.optimize(model, **options)
    expected = model(x, y)
    assert torch.equal(opt(x, y), expected)
    with torch.no_grad():
        assert torch.equal(opt(x, y), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_sum_over_the_chunked_dimension_is_partial_only_in_single_precision_or_wider(dtype):
    g = capture(lambda a: (a * 2).sum(-1), torch.randn(8, 64).to(dtype), train=False)
    mul, total = [n for n in g.gm.graph.nodes if n.op == "call_function"]
    answer = chunk_rule(total, {mul: Split(1)}.get)
    assert isinstance(answer, Partial) == (dtype == torch.float32)


@pytest.mark.parametrize("name", ["chain_product", "maxsim", "broadcast_matmul"])
def test_a_budget_chooses_the_regions_it_would_choose_building_every_variant(name, monkeypatch):
    # With a budget, a variant whose overhead cannot be below that of a candidate already fitting the
    # budget is not built (the policy takes the least overhead that fits): the plan is the one made
    # by building every variant.
    import memplan.passes.chunk as chunk_module

    workload = examples.make(name)
    graph = dataclasses.replace(capture(workload.model, *workload.inputs, seed="tangents"), lifetimes="graph")
    base = AnalysisManager(graph).get(PeakSimulation).peak
    for fraction in (1.2, 0.9, 0.5, 0.2, 0.05):
        policy = Policy(budget=int(base * fraction), when_over="lowest")
        pruned = chunk_module.plan_chunk(graph, policy)
        with monkeypatch.context() as m:
            m.setattr(chunk_module, "_overhead_bound", lambda *a, **k: 0.0)
            full = chunk_module.plan_chunk(graph, policy)
        assert [(r.label, r.chunks) for r in pruned.regions] == [(r.label, r.chunks) for r in full.regions], fraction


# ----------------------------------------------------------------------------------------------
# the algebra of partial results: only linear ops cross a partial before its combine


class _PairwiseDistance(nn.Module):
    """``sqrt(sum_k (x_ik - x_jk)^2 + eps)`` over a projected ``x``: chunking the features ``k`` makes
    the sum partial, and ``tail`` is what meets the partial sum before anything else."""

    def __init__(self, tail):
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.tail = tail

    def forward(self, x):
        x = self.lin(x)
        return self.tail(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1))


_AFFINE_TAILS = {
    "add_constant": lambda d: d.add(1e-2).sqrt(),
    "sub_constant": lambda d: (d - 1e-2).abs(),
    "constant_minus": lambda d: 1.0 - d,
    "add_shared_tensor": lambda d: d + torch.linspace(0, 1, d.shape[-1]),
    "clamp": lambda d: d.clamp(min=300.0),
    "square": lambda d: d * d,
}


@pytest.mark.parametrize("tail", sorted(_AFFINE_TAILS))
def test_an_affine_or_nonlinear_op_does_not_cross_a_partial_sum(tail):
    # add(partial, 1e-2) used to count as linear (its only tensor operand is the partial), so each
    # chunk added the constant: with two chunks the diagonal was sqrt(2e-2) where eager gives sqrt(1e-2).
    torch.manual_seed(0)
    model, x = _PairwiseDistance(_AFFINE_TAILS[tail]), torch.randn(128, 256)
    opt = memplan.optimize(model, passes="chunk", **FORCE)
    assert_equivalent(model, opt, x)
    assert_equivalent(model, opt, x, grad=False)
    # the pass still chunks the region up to the partial sum, which it combines before the tail
    assert any(isinstance(m, ChunkLoop) for m in opt.plan.graph.gm.modules())


def test_the_partial_algebra_classes_ops_by_what_they_do_to_the_partial():
    from memplan.passes._chunk.rules import AFFINE, LINEAR, NONLINEAR, crosses

    def rule(fn, *shapes):
        g = capture(fn, *[torch.randn(*s) for s in shapes], train=False)
        ops = [n for n in g.gm.graph.nodes if n.op == "call_function"]
        placeholders = [n for n in g.gm.graph.nodes if n.op == "placeholder"]
        states = {placeholders[0]: Partial("sum")}
        for op in ops:  # every op's state from its inputs', as the flood propagates them
            states[op] = chunk_rule(op, states.get)
        return states[ops[-1]]

    assert rule(lambda p: p + 1e-6, (4, 4)) == Barrier("add is affine in a partial result, which only linear ops may cross")
    assert rule(lambda p, b: p + b, (4, 4), (4,)) == Barrier("add is affine in a partial result, which only linear ops may cross")
    assert rule(lambda p: p * 3.0 - p, (4, 4)) == Partial("sum")
    assert rule(lambda p, s: p * s, (4, 4), (4,)) == Partial("sum")
    assert rule(lambda p: -p / 2.0, (4, 4)) == Partial("sum")
    assert isinstance(rule(lambda p: p.exp(), (4, 4)), Barrier)
    assert isinstance(rule(lambda p: torch.div(p, 2.0, rounding_mode="trunc"), (4, 4)), Barrier)
    assert crosses("sum", LINEAR) and crosses("mean", LINEAR)
    assert not any(crosses(kind, c) for kind in ("sum", "mean", "max", "lse") for c in (AFFINE, NONLINEAR))
    assert not crosses("max", LINEAR) and not crosses("lse", LINEAR)


class _CarriedSum(nn.Module):
    """A chunk loop over ``w``'s rows whose sum ``s`` over the chunked dimension is carried out of the
    loop both as itself (read by a broadcast op) and through views (``outputs`` picks which)."""

    def __init__(self, outputs):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 48))
        self.outputs = outputs

    def forward(self, x, y):
        c = torch.tanh(x[:, None, None, :] * self.w[None, :, :, None] + y[None, None, None, :])
        s = c.sum(dim=(1, 2))
        return self.outputs(x, s)


_CARRIED = {  # the outputs, and how many values the loop folds for them (the rest are their views)
    "transpose_and_broadcast": (lambda x, s: (s.t(), x + s), 1),
    "flat_view_and_broadcast": (lambda x, s: (s.view(-1), x + s), 1),
    "two_views_only": (lambda x, s: (s.t(), s.view(-1)), 1),
    "row_and_itself": (lambda x, s: (s[3], s * 2, s), 2),  # s * 2 is a partial sum of its own
    "expanded_view": (lambda x, s: (s[None].expand(2, -1, -1), x - s), 1),
}


@pytest.mark.parametrize("case", sorted(_CARRIED))
def test_views_of_a_value_a_loop_carries_are_views_of_the_combined_value(case):
    # s.t() and s were combined as two outputs, each in place into the first chunk's value, which they
    # shared: every chunk was added twice (outputs off by about 5 on values of about 6).
    torch.manual_seed(0)
    outputs, folds = _CARRIED[case]
    model, inputs = _CarriedSum(outputs), (torch.randn(16, 32), torch.randn(32))
    opt = memplan.optimize(model, passes="chunk", **FORCE)
    assert_equivalent(model, opt, *inputs, grad=False)
    assert_equivalent(model, opt, *inputs)
    gm = opt.plan.graph.gm  # the training plan
    (loop,) = [gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module" and n.name.endswith("_forward")]
    folded = [out for out in loop.spec.outputs if out.combined and out.view_of < 0 and out.same_as < 0]
    assert len(folded) == folds  # s is folded once; the outputs that are its views are handed out of it
    # the views share the folded value's storage in the plan's graph as at run time: the prediction is
    # as close as the unplanned graph's (the ruler counts a few bytes capture does not see in both)
    gaps = []
    for planned in (opt, memplan.optimize(model, passes="")):
        step = step_fn(planned, inputs, train=True)
        step()
        gaps.append(measure(step).peak - planned.plan.planned_peak)
    assert gaps[0] <= max(gaps[1], 0)


class _RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(128))

    def forward(self, x):
        return F.rms_norm(x, (128,), self.w, eps=1e-6)


def test_a_value_written_in_place_is_not_saved_for_a_recomputation_that_writes_it_again():
    # rms_norm is mean(x ** 2).add_(eps).rsqrt(): the save-small variant kept the mean, which add_ had
    # already written, and the backward recomputed add_ from it: eps twice, gradients 1000x eager's error.
    torch.manual_seed(0)
    model, x = _RMSNorm(), (torch.randn(3, 66, 128) * 0.09).requires_grad_()
    opt = memplan.optimize(model, passes="chunk", **FORCE)
    assert_equivalent(model, opt, x)
    assert any(isinstance(m, ChunkLoop) for m in opt.plan.graph.gm.modules())
    graph = capture(model, x, seed="tangents")
    for region in plan_chunk(graph, Policy(**FORCE)).regions:
        assert "add_" not in region.saved and "mean" not in region.saved


class _BmmAmaxAndGather(nn.Module):
    def forward(self, a, b, table, rows):
        return table[rows].relu(), torch.bmm(a, b).amax(-1)


def test_a_backward_that_compares_recomputed_values_is_not_nested():
    # amax's backward finds the maxima by x == amax. Nested loops chunked the forward body along the
    # columns and the backward body along the rows: the recomputed products rounded otherwise, no
    # element equalled its maximum, and the gradient was 0 / 0 (NaN in 120 places).
    g = torch.Generator()
    inputs = (
        torch.randn(2, 59, 24, generator=g.manual_seed(514864267)).mul(0.2041).requires_grad_(),
        torch.randn(2, 24, 354, generator=g.manual_seed(26952737)).mul(0.05315).requires_grad_(),
        torch.randn(59, 64, generator=g.manual_seed(1901720973)).requires_grad_(),
        torch.randint(0, 59, (118,), generator=g.manual_seed(61847020)),
    )
    model = _BmmAmaxAndGather()
    opt = memplan.optimize(model, passes="chunk", budget=211578)
    assert_equivalent(model, opt, *inputs)
    (region,) = opt.plan.records[0].plan.regions
    assert not region.inner


class _SliceAddedInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 64))

    def forward(self, x):
        h = x[:, ::2, None].expand(-1, -1, 3) @ self.w
        y = h.clone()
        y[..., 32:] += h[..., :32].sin()
        return y.sum(-1)


def test_a_loop_never_moves_a_read_across_an_in_place_write_outside_it():
    # autograd's backward of y[..., 32:] += ... copies into a slice of the dense gradient between two
    # reads of it; a backward loop holding both reads ran them on one side of the write (the pipeline's
    # check: "in-place write by copy__1 clobbers a value chunk1_backward still reads afterwards").
    torch.manual_seed(0)
    model, x = _SliceAddedInPlace(), torch.randn(65, 96, requires_grad=True)
    opt = memplan.optimize(model, passes="chunk", **FORCE)
    assert_equivalent(model, opt, x)


def test_a_loops_scratch_counts_the_results_the_first_chunk_hands_over_once():
    """During the first chunk a folded result is the body's own value; every later chunk runs beside it."""
    from memplan.passes._chunk.loops import loop_scratch

    def peak(length):  # a body with a 100-byte result and 10 bytes a unit besides
        return 100 + 10 * length

    assert loop_scratch(peak, 4, 4, results=100) == 40  # one chunk: the result is the body's
    assert loop_scratch(peak, 3, 2, results=100) == 110  # the second chunk (1 unit) runs beside it
    assert loop_scratch(peak, 6, 2, results=100) == 120  # a middle chunk (2 units) runs beside it
    assert loop_scratch(peak, 6, 2) == 120
    assert loop_scratch(peak, 4, 8, results=100) == 40  # a chunk longer than the units is all of them


class _WrittenThenSummed(nn.Module):
    """A pairwise max, a zero tensor written in part by a slice (an op the index cannot cross), summed."""

    def forward(self, x, y):
        m = (x[..., :, :, None] + y[..., None, :, :]).amax(dim=-2)
        v = torch.zeros_like(m)
        v[..., :41] = m[..., :41].tanh()
        return v.sum(-1)


def test_a_loop_never_runs_a_read_and_the_write_before_it_in_the_wrong_order():
    # the loop made the zeros and summed them, and the write into a slice between the two stayed
    # outside it: the loop summed zeros, and every output was 0 (found by the structural fuzzer, seed
    # 1145, in inference and under a budget); the write's order against its storage's other touchers
    # now ties the region as its data edges do
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 54, 64, generator=gen), torch.randn(64, 83, generator=gen)
    model = _WrittenThenSummed()
    assert_equivalent(model, memplan.optimize(model, passes="chunk", **FORCE), x, y, grad=False)
    x.requires_grad_(), y.requires_grad_()
    assert_equivalent(model, memplan.optimize(model, passes="chunk", **FORCE), x, y)


class _MaxThenWriteThroughTranspose(nn.Module):
    def forward(self, x, y):
        m = (x[..., :, :, None] + y[..., None, :, :]).max(-2).values
        c = m.clone()
        c.transpose(-1, -2)[..., 1:, :].sub_(0.5)
        return (c,)


def test_two_outputs_of_a_loop_that_are_views_of_one_value_keep_sharing_it():
    # c and c.t() both left the loop, each concatenated into a result of its own: the write through
    # the transpose missed the returned c, every element but a column 0.5 off in inference (found by
    # the structural fuzzer, seed 3561). Such a region is not built.
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(85, 96, generator=gen), torch.randn(96, 85, generator=gen)
    model = _MaxThenWriteThroughTranspose()
    assert_equivalent(model, memplan.optimize(model, passes="chunk", **FORCE), x, y, grad=False)
    x.requires_grad_(), y.requires_grad_()
    assert_equivalent(model, memplan.optimize(model, passes="chunk", **FORCE), x, y)
