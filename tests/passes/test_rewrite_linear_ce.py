"""The rewrite pass's vocabulary head: a linear head and its cross-entropy, chunked so that the full
logits never exist (memplan.passes._rewrite.linear_ce)."""

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memplan
from memplan.analysis.cost import REFERENCE_RATES
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation
from memplan.capture import capture
from memplan.passes._chunk.graphs import region_backward
from memplan.passes._rewrite.linear_ce import LinearCrossEntropy, Nll, RowSum, _replay, chunk_count, least_extra_seconds
from memplan.passes.rewrite import plan_rewrite
from memplan.testing import assert_equivalent

TOKENS, HIDDEN, VOCAB = 256, 64, 4000


class LinearHead(nn.Module):
    """A layer, then ``nn.Linear`` and ``F.cross_entropy`` over ``(B*T, V)`` logits, ignoring -100."""

    def __init__(self, hidden=HIDDEN, vocab=VOCAB, label_smoothing=0.0, z_loss=0.0):
        super().__init__()
        self.body = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.label_smoothing, self.z_loss = label_smoothing, z_loss

    def forward(self, x, targets):
        logits = self.head(torch.tanh(self.body(x)))
        loss = F.cross_entropy(logits, targets, ignore_index=-100, label_smoothing=self.label_smoothing)
        if self.z_loss:
            loss = loss + self.z_loss * torch.logsumexp(logits, -1).pow(2).mean()
        return loss


class TiedShiftedHead(nn.Module):
    """A tied embedding as the head (``h @ emb.weight.T`` of a 3-d ``h``), Hugging Face's shift
    ``logits[..., :-1, :].contiguous()``, a ``view(-1, V)``, ``.float()`` and ``reduction='sum'``."""

    def __init__(self, hidden=HIDDEN, vocab=VOCAB):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids)))
        logits = (h @ self.emb.weight.T)[..., :-1, :].contiguous()
        labels = ids[..., 1:].contiguous()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1), reduction="sum")


def _targets(n, vocab=VOCAB, seed=0):
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab, (n,), generator=generator)
    targets[::7] = -100  # padding
    return targets


def _cases():
    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    return {
        # nn.Linear, F.cross_entropy(ignore_index=-100, label_smoothing=0.1) and a z-loss on the logits
        "linear_smoothed_z_loss": (LinearHead(label_smoothing=0.1, z_loss=1e-3), (x, _targets(TOKENS))),
        "tied_shifted_sum": (TiedShiftedHead(), (torch.randint(0, VOCAB, (4, TOKENS // 4 + 1)),)),
    }


CASES = _cases()


@functools.cache
def _optimized(name):
    """The case's model through the rewrite pass alone (planned at the first call), shared by the tests."""
    model, inputs = CASES[name]
    opt = memplan.optimize(model, passes="rewrite")
    opt(*inputs)
    return opt


def _captured(name):
    model, inputs = CASES[name]
    return capture(model, *inputs)


def _head(graph):
    return [p for p in plan_rewrite(graph).rewrites if isinstance(p, LinearCrossEntropy)]


# ----------------------------------------------------------------------------------------------
# the pattern, from the graph's structure


def test_the_heads_are_found_with_their_terms():
    (smoothed,) = _head(_captured("linear_smoothed_z_loss"))
    assert sorted(type(t).__name__ for t in smoothed.terms) == ["LogSumExp", "Nll", "RowSum"]
    (nll,) = [t for t in smoothed.terms if isinstance(t, Nll)]
    assert (nll.ignore_index, nll.reduction) == (-100, 1)
    assert (smoothed.rows, smoothed.vocab, smoothed.program) == (TOKENS, VOCAB, ())
    (tied,) = _head(_captured("tied_shifted_sum"))
    assert [type(t) for t in tied.terms] == [Nll] and tied.terms[0].reduction == 2
    assert tied.rows == TOKENS  # 4 x (T + 1 - 1) tokens
    assert [kind for kind, _ in tied.program] == ["reshape", "slice", "reshape"]  # the shift's rows


class ReturnsLogits(LinearHead):
    """The logits are an output too (what a Hugging Face model's output holds)."""

    def forward(self, x, targets):
        logits = self.head(x)
        return F.cross_entropy(logits, targets), logits


class ConvLogits(nn.Module):
    """Logits from a 1x1 convolution: not a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(HIDDEN, 300, 1)

    def forward(self, x, targets):
        return F.cross_entropy(self.conv(x.t()[None])[0].t(), targets)


class ScaledLogits(LinearHead):
    """A scale between the product and the softmax: not a row move."""

    def forward(self, x, targets):
        return F.cross_entropy(self.head(x) / 2, targets)


class VocabularySlice(LinearHead):
    """A slice of the vocabulary changes every row's softmax."""

    def forward(self, x, targets):
        return F.cross_entropy(self.head(x)[:, :-1], targets)


class ArgmaxToo(LinearHead):
    """An accuracy read from the logits: they must exist."""

    def forward(self, x, targets):
        logits = self.head(x)
        return F.cross_entropy(logits, targets) + (logits.argmax(-1) == targets).float().mean()


class PlainHead(LinearHead):
    """The control: the same head and loss, nothing else."""

    def forward(self, x, targets):
        return F.cross_entropy(self.head(x), targets)


_NOT_FOUND = [(PlainHead(), 1), (ReturnsLogits(), 0), (ConvLogits(), 0), (ScaledLogits(), 0), (VocabularySlice(), 0),
              (ArgmaxToo(), 0)]


@pytest.mark.parametrize("model,found", _NOT_FOUND, ids=[type(m).__name__ for m, _ in _NOT_FOUND])
def test_only_heads_whose_logits_nothing_else_reads_are_found(model, found):
    x, targets = torch.randn(32, HIDDEN, requires_grad=True), torch.randint(0, 299, (32,))
    if isinstance(model, LinearHead):
        model.head = nn.Linear(HIDDEN, 300)
    assert len(_head(capture(model, x, targets))) == found


def test_hugging_face_gpt2_is_found_only_when_its_logits_are_dropped():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100, n_positions=8, use_cache=False)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 100, (2, 8))
    # CausalLMOutput holds the logits: a caller that keeps the whole output keeps them
    assert _head(capture(_Called(model, lambda out: (out.loss, out.logits)), ids)) == []
    (head,) = _head(capture(_Called(model, lambda out: out.loss), ids))
    assert head.terms[0].ignore_index == -100 and head.rows == 16


class _Called(nn.Module):
    """A Hugging Face causal LM called on its own labels, and what ``pick`` keeps of its output."""

    def __init__(self, model, pick):
        super().__init__()
        self.model, self.pick = model, pick

    def forward(self, ids):
        return self.pick(self.model(input_ids=ids, labels=ids))


# ----------------------------------------------------------------------------------------------
# (a) outputs and gradients, (c) peaks


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_and_gradients_equal_eager_and_the_logits_never_exist(name):
    model, inputs = CASES[name]
    opt = _optimized(name)
    assert_equivalent(model, opt, *inputs)
    (record,) = opt.plan.records
    (head,) = [r for r in record.plan.rewrites if isinstance(r, LinearCrossEntropy)]
    assert head.chunks >= 2
    assert opt.plan.planned_peak < opt.plan.eager_peak
    # the head's share of the peak (what the region and its backward, or their replacement, hold there,
    # beyond gradients shaped as its inputs) falls from several full logits to about one chunk
    before, after = dataclasses.replace(capture(model, *inputs), lifetimes="graph"), opt.plan.graph
    full = head.rows * head.vocab * head.logits_dtype.itemsize
    assert _held_at_peak(before, _region_nodes(before, head)) >= 2 * full
    new = {n.name for n in after.gm.graph.nodes} - {n.name for n in before.gm.graph.nodes}
    assert _held_at_peak(after, new) <= 2 * head.chunk_bytes() + 4 * head.rows * 4


def _region_nodes(graph, head):
    return set(head.region()) | set(region_backward(graph, head.region()).nodes)


def _held_at_peak(graph, names):
    """Bytes alive at the simulated peak in storages made by ``names``, gradients of inputs aside."""
    sim = AnalysisManager(graph).get(PeakSimulation)
    inputs = {tuple(n.meta["val"].shape) for n in graph.gm.graph.nodes if n.op == "placeholder"}
    storages = sim.tensors.storages
    held = 0
    for s in sim.live_at_peak:
        value = graph.node(storages[s].creator).meta["val"]
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        if storages[s].creator in names and shape not in inputs:
            held += storages[s].nbytes
    return held


def test_the_backward_runs_twice_with_retain_graph():
    model, inputs = CASES["linear_smoothed_z_loss"]
    opt = _optimized("linear_smoothed_z_loss")
    grads = []
    for fn in (model, opt):
        x = inputs[0].detach().clone().requires_grad_(True)
        loss = fn(x, inputs[1])
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        loss.backward()
        grads.append((first, x.grad.clone()))
    (eager_first, eager_twice), (first, twice) = grads
    torch.testing.assert_close(first, eager_first, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(twice, 2 * first)


def test_an_allowance_of_no_extra_time_keeps_the_head():
    # a wide head is mostly its matrix products: the extra one adds time, which max_overhead=0 does
    # not allow (a narrow one may be predicted no slower: eager's passes over the logits cost more)
    model, x = WideHead(), torch.randn(64, 256, requires_grad=True)
    targets = torch.randint(0, 2000, (64,))
    graph = capture(model, x, targets)
    (head,) = _head(graph)
    assert least_extra_seconds(graph, head, REFERENCE_RATES) > 0  # so no chunk count is even built
    opt = memplan.optimize(model, passes="rewrite", max_overhead=0.0)
    opt(x, targets)
    assert not opt.plan.records[0].changed


class WideHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(256, 2000)

    def forward(self, x, targets):
        return F.cross_entropy(self.head(x), targets)


def test_without_the_pattern_the_peak_never_rises():
    class LogSoftmaxOfActivations(nn.Module):  # a cross-entropy, but not of a linear head's logits
        def forward(self, x, targets):
            return F.cross_entropy(torch.tanh(x), targets)

    x, targets = torch.randn(64, 300, requires_grad=True), torch.randint(0, 300, (64,))
    opt = memplan.optimize(LogSoftmaxOfActivations(), passes="rewrite")
    opt(x, targets)
    assert opt.plan.planned_peak <= opt.plan.eager_peak
    assert not any(isinstance(r, LinearCrossEntropy) for r in opt.plan.records[0].plan.rewrites)


def test_chunk_count_follows_the_fall_of_the_peak():
    assert chunk_count(1000, 600, 4096) == 16  # A = 800, F = 200: a doubling gains < 10% past 16 chunks
    assert chunk_count(1000, 800, 4096) == 3  # A = 400, F = 600
    assert chunk_count(1000, 1000, 4096) == 2  # the peak is elsewhere
    assert chunk_count(1000, 600, 3) == 3  # no more chunks than tokens (or words)


# ----------------------------------------------------------------------------------------------
# the chunked function itself, against a plain reference, on every axis and uneven chunks


class WeightedSmoothedZLoss(nn.Module):
    """Class weights, label smoothing (with the weights) and a z-loss: every term at once."""

    def __init__(self, hidden=6, vocab=11):
        super().__init__()
        self.head = nn.Linear(hidden, vocab)
        self.register_buffer("weight", torch.rand(vocab) + 0.5)

    def forward(self, x, targets):
        logits = self.head(x)
        loss = F.cross_entropy(logits, targets, weight=self.weight, ignore_index=3, label_smoothing=0.2)
        return loss + 0.1 * torch.logsumexp(logits, -1).pow(2).mean()


class PerTokenLoss(nn.Module):
    """``reduction='none'`` of a head without a bias (``h @ W``, the weight stored ``H x V``)."""

    def __init__(self, hidden=6, vocab=11):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, vocab))

    def forward(self, x, targets):
        return F.cross_entropy(x @ self.weight, targets, reduction="none", ignore_index=-100).sum()


def _function_forms():
    """Small heads in float64, where the chunks' other summation order is far below the tolerance."""
    x = torch.randn(13, 6, dtype=torch.float64, requires_grad=True)
    return {
        "weighted_smoothed_z_loss": (WeightedSmoothedZLoss().double(), (x, torch.randint(0, 11, (13,)))),
        "per_token": (PerTokenLoss().double(), (x, torch.randint(0, 11, (13,)))),
        "tied_shifted": (TiedShiftedHead(hidden=6, vocab=11).double(), (torch.randint(0, 11, (3, 5)),)),
    }


FORMS = _function_forms()


def _reference(pattern, values):
    """The region's outputs computed plainly: the whole product, its rows, the log-softmax, the terms."""
    h, right, bias, *_ = values
    product = h @ right if bias is None else torch.addmm(bias.reshape(-1), h, right)
    rows = torch.arange(pattern.tokens).reshape(pattern.leading)
    rows = _replay(pattern.program, rows) if pattern.program else rows.reshape(-1)
    logits = product[rows].to(pattern.logits_dtype)
    log_probs = torch.log_softmax(logits, 1)
    outputs = []
    for term in pattern.terms:
        if isinstance(term, Nll):
            weight = values[term.weight] if term.weight is not None else None
            outputs += list(torch.ops.aten.nll_loss_forward(log_probs, values[term.target], weight, term.reduction,
                                                            term.ignore_index))
        elif isinstance(term, RowSum):
            weighted = log_probs if term.weight is None else log_probs * values[term.weight]
            outputs.append(weighted.sum(-1, keepdim=term.keepdim))
        else:
            outputs.append(torch.logsumexp(logits, -1, keepdim=term.keepdim))
    return outputs


def _synthetic(graph, pattern, ignore):
    """Values for the pattern's inputs, in the graph's dtypes: random ``h``, ``R`` and bias (leaves),
    targets with ignored ones, positive weights."""
    generator = torch.Generator().manual_seed(1)
    values = []
    for i, name in enumerate(pattern.inputs):
        if name is None:
            values.append(None)
            continue
        fake = graph.node(name).meta["val"]
        if fake.dtype == torch.int64:
            value = torch.randint(0, pattern.vocab, tuple(fake.shape), generator=generator)
            value.view(-1)[::4] = ignore
        else:
            value = (torch.rand(tuple(fake.shape), generator=generator) + 0.5).to(fake.dtype)
            if i < 3:
                value = (2 * value - 2).requires_grad_(True)
        values.append(value)
    return values


@pytest.mark.parametrize("axis,chunks", [("vocab", 1), ("vocab", 4), ("tokens", 3), ("tokens", 13)])
@pytest.mark.parametrize("form", list(FORMS))
def test_the_chunked_function_matches_the_plain_computation(form, axis, chunks):
    model, inputs = FORMS[form]
    graph = capture(model, *inputs)
    (pattern,) = _head(graph)
    pattern = dataclasses.replace(pattern, axis=axis, chunks=chunks)
    ignore = next(t.ignore_index for t in pattern.terms if isinstance(t, Nll))
    values = _synthetic(graph, pattern, ignore)
    fn = pattern.replacement(graph).fn
    got = fn(*[v for v in values if v is not None])
    expected = _reference(pattern, values)
    leaves = [v for v in values[:3] if v is not None]
    upstream = [torch.randn_like(e) for e in expected]
    # the total weight (items 1 of an nll) gets no gradient
    pairs = [(g, e, u) for g, e, u, kind in zip(got, expected, upstream, _kinds(pattern)) if kind != "total"]
    # float64 throughout, but the shifted head's .float() computes its loss in float32
    tolerance = 1e-10 if pattern.logits_dtype == torch.float64 else 1e-5
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=tolerance, atol=tolerance)
    grads = torch.autograd.grad([(g * u).sum() for g, _, u in pairs], leaves)
    expected_grads = torch.autograd.grad([(e * u).sum() for _, e, u in pairs], leaves)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=tolerance, atol=tolerance)


def _kinds(pattern):
    kinds = []
    for term in pattern.terms:
        kinds += ["loss", "total"] if isinstance(term, Nll) else ["value"]
    return kinds


def test_a_low_precision_head_with_a_float_loss_matches_within_its_precision():
    graph = capture(TiedShiftedHead(hidden=6, vocab=11).to(torch.bfloat16), torch.randint(0, 11, (3, 5)))
    (pattern,) = _head(graph)
    assert pattern.logits_dtype == torch.float32  # .float() of bfloat16 logits
    pattern = dataclasses.replace(pattern, chunks=3)
    values = _synthetic(graph, pattern, -100)
    got = pattern.replacement(graph).fn(*[v for v in values if v is not None])[0]
    expected = _reference(pattern, values)[0]
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=0)
    (grad_h,) = torch.autograd.grad(got, values[0])
    (expected_h,) = torch.autograd.grad(expected, values[0])
    assert grad_h.dtype == torch.bfloat16
    torch.testing.assert_close(grad_h, expected_h, rtol=2e-2, atol=2e-2 * expected_h.abs().max().item())
