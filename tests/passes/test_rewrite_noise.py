"""The rewrite pass's noise replay: dropout's noise drawn again in the backward from the generator's state."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memplan
from memplan.analysis.peak import step_margin
from memplan.capture import Phase, capture
from memplan.measure import measure
from memplan.passes._rewrite.noise_replay import find_noise_replay
from memplan.passes._rewrite.remade import REMAKES
from memplan.steps import step_fn
from memplan.testing import assert_equivalent


class DropoutMLP(nn.Module):
    """``nn.Dropout`` between layers: ``empty_like(h).bernoulli_(q).div_(q)`` on a CPU."""

    def __init__(self, width=64, layers=4, p=0.2):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        for layer in self.layers:
            x = x + self.drop(torch.tanh(layer(x)))
        return x


class HandMask(nn.Module):
    """A mask written by hand, kept apart from the scaling: ``h * mask / keep``."""

    def __init__(self, width=64, keep=0.7):
        super().__init__()
        self.a, self.b, self.keep = nn.Linear(width, width), nn.Linear(width, width), keep

    def forward(self, x):
        h = torch.relu(self.a(x))
        mask = torch.empty_like(h).bernoulli_(self.keep)
        return self.b(h * mask / self.keep).sigmoid()


class Functional(nn.Module):
    """``F.dropout`` on a transposed activation: the noise takes the activation's strides."""

    def __init__(self, width=64):
        super().__init__()
        self.a = nn.Linear(width, width)

    def forward(self, x):
        h = torch.sin(self.a(x)).transpose(0, 1)
        return F.dropout(h, 0.3, training=True).transpose(0, 1).cumsum(0)


class FeatureNoise(nn.Module):
    """Noise over whole channels and whole examples, smaller than the generator's state and kept as it is
    (``F.dropout2d``, stochastic depth as timm writes it: ``new_empty((N, 1, 1, 1)).bernoulli_(keep).div_(keep)``),
    beside ``F.alpha_dropout``'s full-size noise, drawn again."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.c = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1) for _ in range(3))

    def forward(self, x):
        h = F.dropout2d(torch.relu(self.a(x)), 0.2)
        branch = self.b(h)
        keep = 0.8
        h = h + branch * branch.new_empty((branch.shape[0], 1, 1, 1)).bernoulli_(keep).div_(keep)
        h = F.alpha_dropout(torch.tanh(h), 0.1, training=True)
        for c in self.c:  # the forward goes on while the noise is held
            h = torch.sin(c(h))
        return h.flatten(1)


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


MODELS = [
    ("mlp", lambda: DropoutMLP(), (64, 64)),
    ("hand_mask", lambda: HandMask(), (48, 64)),
    ("functional", lambda: Functional(), (40, 64)),
    ("encoder", _encoder, (4, 24, 32)),
    ("feature_noise", lambda: FeatureNoise(), (6, 3, 12, 12)),
]


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("name,make,shape", MODELS, ids=[m[0] for m in MODELS])
def test_the_plan_draws_eagers_bits_and_predicts_its_lower_peak(name, make, shape, seed):
    torch.manual_seed(seed)
    model, x = make(), torch.randn(*shape, requires_grad=True)
    opt = memplan.optimize(model, passes="rewrite")
    assert_equivalent(model, opt, x, exact=True, seed=seed)
    plan = opt.plan_for(x)
    notes = [note for r in plan.records for note in r.notes if "drawn again in the backward" in note]
    assert notes, plan.records
    measured = measure(step_fn(opt, (x,), train=True)).peak
    assert measured == plan.planned_peak + step_margin(plan.graph)
    before = memplan.optimize(model, passes="").plan_for(x)
    assert plan.planned_peak <= before.planned_peak and plan.saved_bytes < before.saved_bytes


@pytest.mark.parametrize("name,make,shape", MODELS, ids=[m[0] for m in MODELS])
def test_training_steps_under_the_default_pipeline_keep_eagers_values_and_random_stream(name, make, shape):
    torch.manual_seed(0)
    eager, planned = make(), make()
    planned.load_state_dict(eager.state_dict())
    opt = memplan.optimize(planned)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, planned)]
    x = torch.randn(*shape)
    for step in range(3):
        results = []
        for module, optimizer in zip((eager, opt), optimizers):
            torch.manual_seed(100 + step)
            loss = module(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            results.append((loss.detach(), torch.rand(4)))  # the draw after the step: the stream went on as eager's
        (eager_loss, eager_after), (planned_loss, planned_after) = results
        torch.testing.assert_close(planned_loss, eager_loss, rtol=1e-5, atol=1e-6)
        assert torch.equal(planned_after, eager_after)
    for p, q in zip(planned.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    assert any("drawn again in the backward" in n for r in opt.plan.records for n in r.notes)


class Unreplayable(nn.Module):
    """A draw the replay would not make again: a write into the noise after it, or a view the backward reads."""

    def __init__(self, kind):
        super().__init__()
        self.a, self.kind = nn.Linear(16, 16), kind

    def forward(self, x):
        h = torch.tanh(self.a(x))
        noise = torch.empty_like(h).bernoulli_(0.5)
        if self.kind == "written":
            noise[0] = 1.0
            return h * noise
        return h.t() * noise.t()


@pytest.mark.parametrize("model", [Unreplayable("written"), Unreplayable("view")], ids=["written", "view"])
def test_draws_the_replay_could_not_make_again_are_left_alone(model):
    x = torch.randn(8, 16)
    assert find_noise_replay(capture(model, x, seed="tangents")) == []
    opt = memplan.optimize(model, passes="rewrite")
    assert_equivalent(model, opt, x, exact=True)


def test_the_generators_state_is_taken_right_before_its_draw_whatever_the_schedule():
    # Two dropouts whose noises the backward reads in the other order; the default pipeline reorders
    # freely, and each replay must start from its own draw's state.
    class Crossed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            h1 = F.dropout(torch.tanh(self.a(x)), 0.5)
            h2 = F.dropout(torch.tanh(self.b(x)), 0.5)
            return (h1 @ h2.t()).logsumexp(-1)

    torch.manual_seed(0)
    model, x = Crossed(), torch.randn(64, 32, requires_grad=True)
    assert len(find_noise_replay(capture(model, x, seed="tangents"))) == 2
    for passes in ("rewrite", None):
        assert_equivalent(model, memplan.optimize(model, passes=passes), x, exact=passes == "rewrite", seed=4)


class FeedForward(nn.Module):
    """Dropout between two layers of a feed-forward stack: the second layer saves the dropped activation."""

    def __init__(self, width=64, layers=3):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(width, 4 * width) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(4 * width, width) for _ in range(layers))

    def forward(self, x):
        for up, down in zip(self.up, self.down):
            x = x + down(F.dropout(torch.relu(up(x)), 0.1))
        return x


def test_remat_recomputes_through_a_draw_whose_state_was_taken():
    # The dropped activation (relu's output times the noise) is what the second layer saves. With the
    # state taken, remat may recompute it in the backward, drawing the noise again; without it, the
    # noise, or the product, stays saved.
    torch.manual_seed(0)
    model, x = FeedForward(), torch.randn(128, 64, requires_grad=True)
    replayed = memplan.optimize(model, passes="rewrite,remat", max_overhead=2.0)
    kept = memplan.optimize(model, passes="remat", max_overhead=2.0)
    assert_equivalent(model, replayed, x, seed=1)
    plan, other = replayed.plan_for(x), kept.plan_for(x)
    draws = [n for n in plan.graph.gm.graph.nodes if n.target is torch.ops.memplan.replay_bernoulli_.default]
    rewritten = sum(1 for r in plan.records for note in r.notes if "drawn again in the backward" in note)
    assert len(draws) > rewritten  # remat's copies draw again too
    assert plan.planned_peak < other.planned_peak
    measured = measure(step_fn(replayed, (x,), train=True)).peak
    assert measured == plan.planned_peak + step_margin(plan.graph)


class HeadsAttention(nn.Module):
    """Attention written out, heads as a batch dimension, ``F.dropout`` on the probabilities."""

    def __init__(self, width=64, heads=4, p=0.1):
        super().__init__()
        self.qkv, self.out, self.heads, self.p = nn.Linear(width, 3 * width), nn.Linear(width, width), heads, p

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        probs = F.dropout(scores.softmax(-1), self.p, training=self.training)
        return self.out((probs @ v).transpose(1, 2).reshape(b, n, d))


class CausalEinsum(nn.Module):
    """Another layout: one head, scores by ``einsum``, a causal mask, ``nn.Dropout`` as a module."""

    def __init__(self, width=48):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        n = x.shape[1]
        scores = torch.einsum("bid,bjd->bij", self.q(x), self.k(x)) * x.shape[-1] ** -0.5
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        probs = self.drop(scores.masked_fill(~mask, float("-inf")).softmax(-1))
        return torch.einsum("bij,bjd->bid", probs, self.v(x)).tanh()


@pytest.mark.parametrize("make,shape", [(HeadsAttention, (4, 192, 64)), (CausalEinsum, (8, 160, 48))],
                         ids=["heads", "causal_einsum"])
def test_chunk_splits_attention_around_noise_drawn_whole(make, shape):
    # The dropout's noise reads no value once its state is taken (a tensor made from its shape), so the
    # forward draws it whole, as eager does, and the loops read it in slices; the backward loop reads the
    # noise drawn again in the backward, and the forward's dies after the forward loop.
    torch.manual_seed(0)
    model, x = make().train(), torch.randn(*shape, requires_grad=True)
    chunked = memplan.optimize(model, passes="rewrite,chunk")
    assert_equivalent(model, chunked, x, seed=2)
    plan, whole = chunked.plan_for(x), memplan.optimize(model, passes="rewrite").plan_for(x)
    assert any(r.name == "chunk" and r.changed for r in plan.records), plan
    assert plan.planned_peak < 0.75 * whole.planned_peak, (plan.planned_peak, whole.planned_peak)
    assert measure(step_fn(chunked, (x,), train=True)).peak == plan.planned_peak + step_margin(plan.graph)
    graph = plan.graph
    remade = [n.meta[REMAKES] for n in graph.gm.graph.nodes if REMAKES in n.meta]
    assert remade
    for name in remade:
        assert all(graph.phases[u.name] is Phase.FORWARD for u in graph.node(name).users), name
    # the stream goes on as eager's after the step
    after = []
    for module in (model, chunked):
        torch.manual_seed(7)
        module(x).sum().backward()
        after.append(torch.rand(4))
    assert torch.equal(*after)


class DrawnFromProbabilities(nn.Module):
    """A draw whose probabilities are the region's own values (``torch.bernoulli(p)``): it reads what the
    loop would compute in slices, so chunk must not split it, nor draw it per chunk."""

    def __init__(self, width=32):
        super().__init__()
        self.qk = nn.Linear(width, 2 * width)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        probs = (q @ k.transpose(-1, -2)).softmax(-1)
        noise = torch.bernoulli(probs.detach().clamp(0.2, 0.8))
        return (probs * noise).sum(-1)


def test_a_draw_that_reads_the_region_is_never_split():
    torch.manual_seed(0)
    model, x = DrawnFromProbabilities(), torch.randn(6, 128, 32, requires_grad=True)
    assert_equivalent(model, memplan.optimize(model, passes="rewrite,chunk"), x, seed=3)
