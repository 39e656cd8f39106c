"""The rewrite pass on hand-written attention: ``softmax(q @ k^T * scale + mask) @ v`` as one
``F.scaled_dot_product_attention`` (memplan/passes/_rewrite/attention.py)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memplan
from memplan.capture import Phase, capture
from memplan.graphutil import packet_name
from memplan.passes._rewrite.noise_replay import NoiseReplay
from memplan.passes.rewrite import Attention, apply_rewrite, plan_rewrite
from memplan.testing import assert_equivalent


class GPT2Attention(nn.Module):
    """GPT-2 style: one projection split into heads by view/transpose, ``matmul``, a division by
    ``sqrt(d)``, a causal ``-inf`` mask built from constants, ``F.softmax``, heads merged back."""

    def __init__(self, width=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        b, n, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(b, n, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(width // self.heads)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.proj(out.transpose(1, 2).reshape(b, n, width))


class MaskBuiltApart(GPT2Attention):
    """The causal mask built between the projection and the heads: its nodes take the projection's
    autograd number, so they stay (read by nothing) and the rest is fused."""

    def forward(self, x):
        b, n, width = x.shape
        qkv = self.qkv(x)
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        q, k, v = (t.view(b, n, self.heads, width // self.heads).transpose(1, 2) for t in qkv.split(width, dim=2))
        scores = torch.matmul(q, k.transpose(-1, -2)).masked_fill(mask, float("-inf")) / math.sqrt(width // self.heads)
        return self.proj(torch.matmul(F.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, n, width))


class EinsumAttention(nn.Module):
    """Research-code style: the scale on ``q``, ``einsum`` products, an additive padding mask."""

    def forward(self, q, k, v, mask):
        q = q * q.shape[-1] ** -0.5
        scores = torch.einsum("bhnd,bhmd->bhnm", q, k) + mask
        return torch.einsum("bhnm,bhmd->bhnd", scores.softmax(-1), v)


class BufferMaskAttention(nn.Module):
    """nanoGPT style: a causal mask kept in a buffer (read at run time, so passed as a mask), a
    ``-inf`` fill, and ``nn.Dropout`` on the weights (absent from the graph in evaluation)."""

    def __init__(self, n=32, p=0.1):
        super().__init__()
        self.drop = nn.Dropout(p)
        self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n))

    def forward(self, q, k, v):
        n = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :n, :n] == 0, float("-inf"))
        return self.drop(F.softmax(att, dim=-1)) @ v


class BatchedKeys(nn.Module):
    """``torch.bmm`` on 3-d operands, keys shared by the heads (broadcast by ``matmul``), ``where``."""

    def forward(self, q, k, v, keep):
        scores = torch.where(keep, (q @ k.transpose(-1, -2)) * 0.25, torch.tensor(float("-inf")))
        return torch.softmax(scores, dim=-1) @ v


class WiderValues(nn.Module):
    """Values with a head size of their own (the fused kernel takes one: ``q`` and ``k`` are padded
    with zeros), scaled in place."""

    def forward(self, q, k, v):
        scores = q @ k.transpose(-1, -2)
        scores.mul_(q.shape[-1] ** -0.5)
        return scores.softmax(-1) @ v


class Chained(nn.Module):
    """A second attention whose queries are the first's output: the first is fused (the second would
    read a node the first's rewrite replaces)."""

    def forward(self, q, k, v):
        out = (q @ k.transpose(-1, -2) / 4).softmax(-1) @ v
        return (out @ k.transpose(-1, -2) / 4).softmax(-1) @ v


def _qkv(*shape):
    return tuple(torch.randn(*shape, requires_grad=True) for _ in range(3))


def _padding(b, m):
    mask = torch.zeros(b, 1, 1, m)
    mask[0, ..., m // 2:] = torch.finfo(torch.float32).min  # the first sequence is half padding
    return mask


def _models():
    torch.manual_seed(0)
    keep = torch.rand(2, 1, 32, 32) > 0.3
    keep[..., 0] = True  # every query sees a key (a row with none is NaN in eager, see the module)
    return [
        ("gpt2", GPT2Attention(), (torch.randn(2, 32, 64, requires_grad=True),), True),
        ("mask_built_apart", MaskBuiltApart(), (torch.randn(2, 32, 64, requires_grad=True),), True),
        ("einsum_padding", EinsumAttention(), (*_qkv(2, 4, 32, 16), _padding(2, 32)), False),
        ("buffer_mask_eval", BufferMaskAttention().eval(), _qkv(2, 4, 32, 16), False),
        ("shared_keys_where", BatchedKeys(), (torch.randn(2, 4, 32, 16, requires_grad=True),
                                              torch.randn(2, 1, 32, 16, requires_grad=True),
                                              torch.randn(2, 1, 32, 16, requires_grad=True), keep), False),
        ("chained", Chained(), _qkv(2, 4, 32, 16), False),
        ("wider_values", WiderValues(), (*_qkv(1, 2, 128, 8)[:2], torch.randn(1, 2, 128, 16, requires_grad=True)), False),
    ]


MODELS = _models()


@pytest.mark.parametrize("name,model,inputs,causal", MODELS, ids=[m[0] for m in MODELS])
def test_attention_is_fused_equivalent_and_lower(name, model, inputs, causal):
    (pattern,) = [p for p in plan_rewrite(capture(model, *inputs)).rewrites if isinstance(p, Attention)]
    assert pattern.causal is causal
    opt = memplan.optimize(model, passes="rewrite")
    assert_equivalent(model, opt, *inputs)
    assert opt.plan.records[0].changed
    assert opt.plan.planned_peak < opt.plan.eager_peak


def test_golden_gpt2_attention():
    name, model, inputs, _ = MODELS[0]
    graph = capture(model, *inputs)
    (pattern,) = plan_rewrite(graph).rewrites
    assert pattern.scale == pytest.approx(16 ** -0.5)
    assert pattern.causal and {op.kind for op in pattern.ops} == {"scale"}  # the mask became is_causal
    new, done = apply_rewrite(graph, plan_rewrite(graph))
    assert done == (pattern,)
    forward = [packet_name(n) for n in new.gm.graph.nodes if n.op == "call_function" and new.phases[n.name] is Phase.FORWARD]
    backward = [packet_name(n) for n in new.gm.graph.nodes if n.op == "call_function" and new.phases[n.name] is Phase.BACKWARD]
    assert forward.count("_scaled_dot_product_flash_attention_for_cpu") == 1
    assert backward.count("_scaled_dot_product_flash_attention_for_cpu_backward") == 1
    # no scores, no mask, no copy of q, k or v for a bmm: the one clone merges the heads after
    assert not {"bmm", "_softmax", "masked_fill", "triu", "ones"} & set(forward) and forward.count("clone") == 1
    assert not {"bmm", "_softmax_backward_data"} & set(backward)
    shapes = [tuple(n.meta["val"].shape) for n in new.gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert not [s for s in shapes if s[-2:] == (32, 32)]  # no (..., queries, keys) value left, forward or backward


def test_inference_is_fused_and_equivalent():
    _, model, inputs, _ = MODELS[1]
    opt = memplan.optimize(model, passes="rewrite")
    with torch.no_grad():
        opt(*inputs)
    assert opt.plan.records[0].changed
    assert_equivalent(model, opt, *inputs, grad=False)


# ----------------------------------------------------------------------------------------------
# what must not be rewritten


class ReturnsWeights(nn.Module):
    def forward(self, q, k, v):
        probs = (q @ k.transpose(-1, -2) / 4).softmax(-1)
        return probs @ v, probs


class SoftmaxOverQueries(nn.Module):
    def forward(self, q, k, v):
        return (q @ k.transpose(-1, -2) / 4).softmax(-2) @ v


class LearnedBias(nn.Module):
    """A bias that needs a gradient: SDPA would build the full scores for it (its math path)."""

    def __init__(self, n=32):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(n, n))

    def forward(self, q, k, v):
        return (q @ k.transpose(-1, -2) / 4 + self.bias).softmax(-1) @ v


class FiniteFill(nn.Module):
    """``masked_fill(mask, -1e9)`` sets scores; on a row with every key masked eager's weights are
    uniform with no gradient into the scores, SDPA's additive mask would pass one."""

    def forward(self, q, k, v, mask):
        return (q @ k.transpose(-1, -2) / 4).masked_fill(mask, -1e9).softmax(-1) @ v


class ShortAndWide(nn.Module):
    """Few keys and wide values: ``q`` and ``k`` padded to the values' head size would hold more bytes
    than the scores they replace."""

    def forward(self, q, k, v):
        return (q @ k.transpose(-1, -2) / 2).softmax(-1) @ v


class HeadsReordered(nn.Module):
    """The product's batch read back in another order (heads outer): not a reshape of the scores."""

    def forward(self, q, k, v):  # (B * H, n, d), the batch index b * H + h
        scores = torch.bmm(q, k.transpose(1, 2)).view(2, 4, 32, 32).transpose(0, 1)  # (H, B, n, m)
        return (scores.softmax(-1) @ v.view(2, 4, 32, 16).transpose(0, 1)).sum(0)


def _refused():
    torch.manual_seed(1)
    q, k, v = _qkv(2, 4, 32, 16)
    return [
        ("dropout_in_training", BufferMaskAttention().train(), (q, k, v)),
        ("returns_weights", ReturnsWeights(), (q, k, v)),
        ("softmax_over_queries", SoftmaxOverQueries(), (q, k, v)),
        ("learned_bias", LearnedBias(), (q, k, v)),
        ("finite_fill", FiniteFill(), (q, k, v, torch.rand(2, 1, 32, 32) > 0.7)),
        ("short_and_wide", ShortAndWide(), (*_qkv(2, 4, 8, 4)[:2], torch.randn(2, 4, 8, 32, requires_grad=True))),
        ("heads_reordered", HeadsReordered(), _qkv(8, 32, 16)),
    ]


REFUSED = _refused()


@pytest.mark.parametrize("name,model,inputs", REFUSED, ids=[m[0] for m in REFUSED])
def test_attention_that_must_not_be_rewritten(name, model, inputs):
    assert not any(isinstance(p, Attention) for p in plan_rewrite(capture(model, *inputs)).rewrites)
    opt = memplan.optimize(model, passes="rewrite")
    assert_equivalent(model, opt, *inputs)  # dropout included: the same draws as eager's
    record = opt.plan.records[0]
    # at most dropout's noise, drawn again in the backward (test_rewrite_noise.py)
    assert all(isinstance(p, NoiseReplay) for p in record.plan.rewrites) and record.peak_after <= record.peak_before
