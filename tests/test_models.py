"""The default pipeline on the zoo and on common model shapes that no pass was written for: outputs
and gradients equal to eager, and never a higher peak, in training and in inference."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memplan.api import optimize
from memplan.measure import measure
from memplan.steps import step_fn
from memplan.testing import assert_equivalent, zoo


class _Wrapped(nn.Module):
    """A module whose first output is what the step differentiates (nn.LSTM returns a tuple with a tuple)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)[0]


class _CellLoop(nn.Module):
    def __init__(self, cell, hidden, lstm):
        super().__init__()
        self.cell, self.hidden, self.lstm = cell, hidden, lstm
        self.out = nn.Linear(hidden, 4)

    def forward(self, x):
        h = x.new_zeros(x.shape[1], self.hidden)
        state = (h, h) if self.lstm else h
        outs = []
        for t in range(x.shape[0]):
            state = self.cell(x[t], state)
            outs.append(self.out(state[0] if self.lstm else state))
        return torch.stack(outs).pow(2).mean()


class _ResidualBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.c2, self.b2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


class _MaskedAttention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        return self.out(scores.masked_fill(mask, float("-inf")).softmax(-1) @ v)


class _CausalSDPA(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.qkv, self.heads = nn.Linear(dim, 3 * dim), heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)


class _SelfAttentionWeights(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, heads, dropout=0.1)

    def forward(self, x):
        out, weights = self.attention(x, x, x, need_weights=True)
        return out.sum() + weights.sum()


class _Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 500)

    def forward(self, x, target):
        return F.cross_entropy(self.lin(x), target, label_smoothing=0.1)


class _NearestDistance(nn.Module):
    """The squared distance of each point to its nearest neighbour: a (512, 384, 16) broadcast."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x, y):
        a, b = self.proj(x), self.proj(y)
        return (a[:, None, :] - b[None, :, :]).pow(2).sum(-1).min(1).values.sum()


class _TopKExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 8)
        self.experts = nn.Parameter(torch.randn(8, 16, 16) * 0.1)

    def forward(self, x):
        weights, index = self.gate(x).softmax(-1).topk(2, -1)
        y = torch.einsum("nd,nkde->nke", x, self.experts[index])
        return (y * weights[..., None]).sum(1)


class _InPlaceUser(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        y = self.a(x)
        y.relu_()
        z = self.b(y)
        z += y
        z.mul_(0.5)
        return z.sigmoid()


class _TiedWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding, self.hidden = nn.Embedding(100, 32), nn.Linear(32, 32)

    def forward(self, index):
        return torch.tanh(self.hidden(self.embedding(index))) @ self.embedding.weight.t()


class _Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return {"relu": y.relu(), "rest": (y.sum(), y.tanh())}


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        segment = lambda t: self.b(torch.relu(self.a(t)))  # noqa: E731
        return torch.utils.checkpoint.checkpoint(segment, x, use_reentrant=False).sum(1)


class _GradientHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        if y.requires_grad:
            y.register_hook(lambda grad: grad * 3)
        return self.b(y).tanh()


class _Autocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.b(torch.relu(self.a(x))).float()


class _FourierFilter(nn.Module):
    def __init__(self):
        super().__init__()
        self.response = nn.Parameter(torch.randn(33))

    def forward(self, x):
        return torch.fft.irfft(torch.fft.rfft(x) * self.response, n=64)


def _hooked_sequential():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].register_forward_hook(lambda module, inputs, out: out * 1.5)
    model[2].register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0.5,))
    return model


def _cases():
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    for entry in zoo():
        yield entry.name, lambda entry=entry: (entry.model, entry.inputs)
    yield "transformer_layer_dropout", lambda: (
        nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True), (torch.randn(4, 32, 64),))
    yield "transformer_norm_first", lambda: (
        nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, norm_first=True),
                              2, enable_nested_tensor=False), (torch.randn(4, 32, 64),))
    yield "lstm", lambda: (_Wrapped(nn.LSTM(16, 32, num_layers=2)), (torch.randn(20, 8, 16),))
    yield "gru_bidirectional", lambda: (
        _Wrapped(nn.GRU(16, 32, bidirectional=True, batch_first=True)), (torch.randn(8, 20, 16),))
    yield "lstm_cell_loop", lambda: (_CellLoop(nn.LSTMCell(16, 32), 32, True), (torch.randn(30, 8, 16),))
    yield "gru_cell_loop", lambda: (_CellLoop(nn.GRUCell(16, 32), 32, False), (torch.randn(30, 8, 16),))
    yield "resnet_batchnorm", lambda: (
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _ResidualBlock(8), _ResidualBlock(8), nn.AdaptiveAvgPool2d(1),
                      nn.Flatten(), nn.Linear(8, 5)), (torch.randn(4, 3, 16, 16),))
    yield "conv1d_groupnorm", lambda: (
        nn.Sequential(nn.Conv1d(4, 16, 5, padding=2), nn.GroupNorm(4, 16), nn.SiLU(),
                      nn.Conv1d(16, 16, 3, dilation=2, padding=2)), (torch.randn(2, 4, 128),))
    yield "upsampling_decoder", lambda: (
        nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(),
                      nn.ConvTranspose2d(8, 4, 2, stride=2), nn.Upsample(scale_factor=2, mode="bilinear"),
                      nn.PixelShuffle(2), nn.InstanceNorm2d(1, affine=True)), (torch.randn(2, 3, 32, 32),))
    yield "channels_last", lambda: (
        nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Dropout2d(0.2)).to(memory_format=torch.channels_last),
        (torch.randn(2, 4, 16, 16).to(memory_format=torch.channels_last),))
    yield "masked_attention", lambda: (_MaskedAttention(32), (torch.randn(2, 64, 32),))
    yield "causal_sdpa", lambda: (_CausalSDPA(32, 4), (torch.randn(2, 64, 32),))
    yield "attention_weights", lambda: (_SelfAttentionWeights(32, 4), (torch.randn(10, 3, 32),))
    yield "cross_entropy", lambda: (_Classifier(), (torch.randn(64, 32), torch.randint(0, 500, (64,))))
    yield "nearest_distance", lambda: (_NearestDistance(), (torch.randn(512, 16), torch.randn(384, 16)))
    yield "top_k_experts", lambda: (_TopKExperts(), (torch.randn(64, 16),))
    yield "in_place_user_ops", lambda: (_InPlaceUser(), (torch.randn(16, 32),))
    yield "tied_weights", lambda: (_TiedWeights(), (torch.randint(0, 100, (4, 10)),))
    yield "structured_outputs", lambda: (_Structured(), (torch.randn(4, 8),))
    yield "checkpointed_segment", lambda: (_Checkpointed(), (torch.randn(16, 32),))
    yield "module_hooks", lambda: (_hooked_sequential(), (torch.randn(4, 8, requires_grad=True),))
    yield "gradient_hook", lambda: (_GradientHook(), (torch.randn(4, 8),))
    yield "parametrizations", lambda: (
        nn.Sequential(weight_norm(nn.Linear(16, 16)), nn.Tanh(), spectral_norm(nn.Linear(16, 16))), (torch.randn(8, 16),))
    yield "autocast_bfloat16", lambda: (_Autocast(), (torch.randn(8, 16),))
    yield "fourier_filter", lambda: (_FourierFilter(), (torch.randn(8, 64),))
    yield "float64", lambda: (nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).double(),
                              (torch.randn(8, 16, dtype=torch.float64),))


CASES = list(_cases())


@pytest.mark.parametrize("make", [make for _, make in CASES], ids=[name for name, _ in CASES])
def test_default_pipeline_is_equivalent_and_never_uses_more_memory(make):
    torch.manual_seed(0)
    model, inputs = make()
    reference = copy.deepcopy(model)  # hooks and parametrizations are copied with it
    opt = optimize(model)
    assert_equivalent(reference, opt, *inputs)  # chunks may sum in another order
    for train in (True, False):
        eager_step, opt_step = step_fn(reference, inputs, train=train), step_fn(opt, inputs, train=train)
        opt_step()
        assert measure(opt_step).peak <= measure(eager_step).peak
