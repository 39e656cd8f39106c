"""Library models at sizes where activations dominate: eager, per-block checkpointing, torch.compile and memplan.

The models people train, built from their libraries with random weights (no downloads), each at a size
where what a training step keeps for its backward outweighs the parameters:

* ``gpt2``: Hugging Face ``GPT2LMHeadModel``, its own loss on next tokens (``labels=input_ids``);
* ``bert``: Hugging Face ``BertForMaskedLM``, 15% of the tokens masked for the loss;
* ``resnet``: Hugging Face ``ResNetForImageClassification``, bottleneck blocks (ResNet-50's layout);
* ``vit``: Hugging Face ``ViTForImageClassification``;
* ``lstm``: a two-layer ``nn.LSTMCell`` loop unrolled in Python, cross-entropy on the stacked outputs;
* ``encoder``: a stack of ``nn.TransformerEncoderLayer`` (pre-norm), a token classifier on top.

The Hugging Face models use a reduced vocabulary (``--vocab``, 8192 by default) so that the blocks'
activations, which per-block checkpointing can save, are what dominates the peak, not the logits of a
50k vocabulary, which no per-block scheme touches. Their attention is torch's fused
``scaled_dot_product_attention`` (``attn_implementation="sdpa"``, the library's default), which memplan
captures as one op; dropout is on (training mode). A model whose library is absent is skipped with a note.

Variants, side by side in one run for each model:

* ``eager``: the model as written;
* ``checkpoint per block``: the user's usual fix, each block run under ``torch.utils.checkpoint``
  (``use_reentrant=False``): Hugging Face's ``gradient_checkpointing_enable`` where the model supports it
  (GPT-2, BERT, ViT), each bottleneck layer wrapped by hand in the ResNet and each layer in the encoder
  stack, and every ``round(sqrt(T))`` time steps in the LSTM loop;
* ``memplan default``: ``memplan.optimize(model)`` (at most 30% more compute);
* ``memplan budget=F``: ``memplan.optimize(model, budget=F)``, F a fraction of the model's own peak
  (``--budgets``; a budget no plan reaches is reported with the smallest peak memplan names);
* ``memplan smallest``: the lowest peak memplan can reach. ``optimize`` has no ``when_over`` argument:
  a budget of one byte raises :class:`memplan.InfeasibleBudgetError` naming the smallest peak of memplan's
  ladder of plans, and that peak, given back as the budget in bytes, is planned;
* ``compile budget=F (RSS)``: ``torch.compile(model)`` (``--compile-backend``, inductor by default) with
  ``torch._functorch.config.activation_memory_budget = F`` (``--compile-budget``, 0.5), in a fresh
  process (the setting is global, and compiled code runs outside the dispatcher that ``memplan.measure``
  counts). Its peak is the growth of the process's resident set during one step after warm-up (the
  high-water mark reset by ``/proc/self/clear_refs``, big allocations returned to the system on free),
  and its ratio is to eager's peak measured the same way in the same process; its time is against
  eager's in the same process. Without a C++ compiler, or where it fails, the row says why. Inductor
  keeps compiled kernels in its on-disk cache: a first run compiles for one to three minutes a model
  (the unrolled LSTM the longest), a later run a few seconds; the row's note gives the seconds.

Peaks are ``memplan.measure`` on ``memplan.steps.step_fn(model, inputs, train=True)``: bytes allocated
during one training step. Times are medians of ``--repeats`` steps taken in alternating blocks
(:func:`memplan.bench.interleaved_medians`), over eager's median from the same rounds. "plan s" is
memplan's first call for the signature: capture, the passes and emitting the plan (for "memplan smallest",
the one-byte probe before it took about as long again, and is not counted). Each memplan variant's
loss and gradients are checked against eager's once (:func:`memplan.testing.assert_equivalent`).

Then, per model, three checks against per-block checkpointing: (a) memplan's default is not dominated
(both more memory and more time); (b) memplan's smallest peak is below checkpointing's; (c) among the
memplan variants at checkpointing's step time or less, the lowest peak is at most 0.8 of checkpointing's.

Run ``python benchmarks/real_models.py [--size default|small] [--models gpt2 lstm ...]
[--repeats 3] [--budgets 0.5] [--no-compile] [--json PATH]``. ``--size small`` runs in well under a minute.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import dataclasses
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import memplan
from memplan.bench import interleaved_medians
from memplan.steps import step_fn
from memplan.testing import assert_equivalent

__all__ = ["MODELS", "Case", "Row", "Check", "build", "main"]

MIB = 2**20
#: The fraction of per-block checkpointing's peak that check (c) asks memplan to reach at no more time.
CHECK_C_RATIO = 0.8


# ------------------------------------------------------------------------------------------------
# models


@dataclasses.dataclass
class Case:
    """One model at one size: the model, its per-block checkpointed twin (same parameter values), inputs."""

    name: str
    size: str  # what was built, in a few words
    model: nn.Module
    checkpointed: nn.Module
    inputs: tuple
    checkpointing: str  # how the twin checkpoints, in a few words


class _Loss(nn.Module):
    """A Hugging Face model called with its arguments by name; returns the loss it computes (``.loss``), so
    that a step's backward starts from the loss and the logits are not outputs kept to the end."""

    def __init__(self, model: nn.Module, *names: str, labels_from: str | None = None):
        super().__init__()
        self.model, self.names, self.labels_from = model, names, labels_from

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        kwargs = dict(zip(self.names, args))
        if self.labels_from is not None:
            kwargs["labels"] = kwargs[self.labels_from]
        return self.model(**kwargs).loss


class _Checkpointed(nn.Module):
    """``block`` run under ``torch.utils.checkpoint`` (non-reentrant): only its inputs are kept for the
    backward, and it runs again there."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False)


def _checkpoint_each(model: nn.Module, block_type: type) -> nn.Module:
    """A copy of ``model`` with every submodule of ``block_type`` wrapped in :class:`_Checkpointed`."""
    twin = copy.deepcopy(model)
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, block_type):
                setattr(parent, name, _Checkpointed(child))
    return twin


def _hf_checkpointed(model: nn.Module) -> nn.Module:
    """A copy of a Hugging Face model with the library's own per-layer checkpointing on."""
    twin = copy.deepcopy(model)
    twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return twin.train()


def _transformers():
    import transformers  # ImportError: the caller skips the model

    transformers.logging.set_verbosity_error()
    return transformers


def gpt2(size: str, vocab: int) -> Case:
    t = _transformers()
    layers, width, heads, seq, batch = (4, 256, 4, 256, 4) if size == "default" else (2, 64, 2, 64, 2)
    config = t.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=seq,
                          use_cache=False, attn_implementation="sdpa")
    model = t.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, vocab, (batch, seq))
    return Case("gpt2", f"{layers} layers, width {width}, seq {seq}, batch {batch}, vocab {vocab}",
                _Loss(model, "input_ids", labels_from="input_ids"),
                _Loss(_hf_checkpointed(model), "input_ids", labels_from="input_ids"), (ids,),
                "gradient_checkpointing_enable")


def bert(size: str, vocab: int) -> Case:
    t = _transformers()
    layers, width, heads, seq, batch = (4, 256, 4, 256, 4) if size == "default" else (2, 64, 2, 64, 2)
    config = t.BertConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                          intermediate_size=4 * width, vocab_size=vocab, max_position_embeddings=seq,
                          attn_implementation="sdpa")
    model = t.BertForMaskedLM(config).train()
    ids = torch.randint(0, vocab, (batch, seq))
    labels = torch.where(torch.rand(batch, seq) < 0.15, ids, torch.full_like(ids, -100))
    return Case("bert", f"{layers} layers, width {width}, seq {seq}, batch {batch}, vocab {vocab}",
                _Loss(model, "input_ids", "labels"), _Loss(_hf_checkpointed(model), "input_ids", "labels"),
                (ids, labels), "gradient_checkpointing_enable")


def resnet(size: str, vocab: int) -> Case:
    t = _transformers()
    from transformers.models.resnet.modeling_resnet import ResNetBottleNeckLayer

    if size == "default":
        depths, hidden, pixels, batch = [3, 4, 6, 3], [256, 512, 1024, 2048], 128, 8
    else:
        depths, hidden, pixels, batch = [1, 1], [32, 64], 32, 2
    config = t.ResNetConfig(embedding_size=64 if size == "default" else 16, hidden_sizes=hidden, depths=depths,
                            layer_type="bottleneck", num_labels=10)
    model = t.ResNetForImageClassification(config).train()
    images, labels = torch.randn(batch, 3, pixels, pixels), torch.randint(0, 10, (batch,))
    return Case("resnet", f"bottleneck depths {depths}, {pixels} px, batch {batch}",
                _Loss(model, "pixel_values", "labels"),
                _Loss(_checkpoint_each(model, ResNetBottleNeckLayer), "pixel_values", "labels"),
                (images, labels), "each bottleneck layer wrapped")


def vit(size: str, vocab: int) -> Case:
    t = _transformers()
    if size == "default":
        layers, width, heads, pixels, patch, batch = 6, 384, 6, 128, 8, 4
    else:
        layers, width, heads, pixels, patch, batch = 2, 64, 2, 32, 8, 2
    config = t.ViTConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                         intermediate_size=4 * width, image_size=pixels, patch_size=patch, num_labels=10,
                         hidden_dropout_prob=0.1, attn_implementation="sdpa")
    model = t.ViTForImageClassification(config).train()
    images, labels = torch.randn(batch, 3, pixels, pixels), torch.randint(0, 10, (batch,))
    tokens = (pixels // patch) ** 2 + 1
    return Case("vit", f"{layers} layers, width {width}, {tokens} tokens, batch {batch}",
                _Loss(model, "pixel_values", "labels"), _Loss(_hf_checkpointed(model), "pixel_values", "labels"),
                (images, labels), "gradient_checkpointing_enable")


class LSTMLoop(nn.Module):
    """Two ``nn.LSTMCell`` layers unrolled in Python over the time steps of ``x`` (time first), a linear head
    on every step's top state and the mean cross-entropy of the stacked logits.

    ``segment``: run every ``segment`` steps under ``torch.utils.checkpoint`` (non-reentrant), keeping only
    the states between segments; None runs them plainly. Parameters and results are the same either way.
    """

    def __init__(self, inputs: int, hidden: int, classes: int, layers: int = 2, segment: int | None = None):
        super().__init__()
        self.cells = nn.ModuleList(nn.LSTMCell(inputs if i == 0 else hidden, hidden) for i in range(layers))
        self.head = nn.Linear(hidden, classes)
        self.segment = segment

    def _run(self, xs: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The steps of ``xs``; ``state`` is ``h, c`` of each layer. Returns the stacked top states, then
        the state after the last step."""
        state = list(state)
        tops = []
        for x in xs.unbind(0):
            for i, cell in enumerate(self.cells):
                state[2 * i], state[2 * i + 1] = cell(x, (state[2 * i], state[2 * i + 1]))
                x = state[2 * i]
            tops.append(x)
        return (torch.stack(tops), *state)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        steps, batch, _ = x.shape
        hidden = self.cells[0].hidden_size
        state = [x.new_zeros(batch, hidden) for _ in range(2 * len(self.cells))]
        if self.segment is None:
            tops = self._run(x, *state)[0]
        else:
            parts = []
            for first in range(0, steps, self.segment):
                part, *state = checkpoint(self._run, x[first:first + self.segment], *state, use_reentrant=False)
                parts.append(part)
            tops = torch.cat(parts)
        return F.cross_entropy(self.head(tops).flatten(0, 1), targets.flatten())


def lstm(size: str, vocab: int) -> Case:
    steps, batch, inputs, hidden = (128, 16, 128, 384) if size == "default" else (16, 4, 8, 16)
    model = LSTMLoop(inputs, hidden, classes=32).train()
    segment = max(1, round(math.sqrt(steps)))
    twin = LSTMLoop(inputs, hidden, classes=32, segment=segment).train()
    twin.load_state_dict(model.state_dict())
    x, targets = torch.randn(steps, batch, inputs, requires_grad=True), torch.randint(0, 32, (steps, batch))
    return Case("lstm", f"2 LSTMCell layers, T {steps}, batch {batch}, hidden {hidden}", model, twin,
                (x, targets), f"every {segment} time steps")


class EncoderStack(nn.Module):
    """Pre-norm ``nn.TransformerEncoderLayer`` blocks over embedded tokens, a token classifier and its
    mean cross-entropy. ``checkpointed``: each layer under ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, vocab: int, width: int, heads: int, layers: int, checkpointed: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.head = nn.Linear(width, vocab)
        self.checkpointed = checkpointed

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointed else layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def encoder(size: str, vocab: int) -> Case:
    layers, width, heads, seq, batch, classes = (4, 256, 4, 256, 8, 256) if size == "default" else (2, 32, 2, 32, 2, 16)
    model = EncoderStack(classes, width, heads, layers).train()
    twin = EncoderStack(classes, width, heads, layers, checkpointed=True).train()
    twin.load_state_dict(model.state_dict())
    ids, targets = torch.randint(0, classes, (batch, seq)), torch.randint(0, classes, (batch, seq))
    return Case("encoder", f"{layers} layers, width {width}, seq {seq}, batch {batch}", model, twin,
                (ids, targets), "each layer wrapped")


#: Model name -> factory ``(size, vocab) -> Case``.
MODELS: dict[str, Callable[[str, int], Case]] = {
    "gpt2": gpt2, "bert": bert, "resnet": resnet, "vit": vit, "lstm": lstm, "encoder": encoder,
}


def build(name: str, size: str, vocab: int, seed: int = 0) -> Case:
    """Model ``name`` at ``size``, its weights and inputs drawn from ``seed`` (the same in every process)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MODELS[name](size, vocab)


# ------------------------------------------------------------------------------------------------
# measuring


@dataclasses.dataclass(frozen=True)
class Row:
    """One variant of one model. ``peak`` is bytes by ``memplan.measure``, or by the resident set (``rss``)."""

    model: str
    variant: str
    peak: int | None
    peak_ratio: float | None  # over eager's peak, measured the same way
    time_ratio: float | None  # median step time over eager's in the same rounds
    seconds: float | None  # median step time
    plan_seconds: float | None = None  # memplan's first call (capture, passes, emit)
    grads: str = ""  # "equal", "differ: ...", or "" where not checked
    rss: bool = False
    note: str = ""
    memplan: bool = False


@dataclasses.dataclass(frozen=True)
class Check:
    model: str
    name: str  # "a", "b" or "c"
    passed: bool | None  # None: could not be judged (a variant is missing)
    detail: str


def _grads(model: nn.Module, opt: nn.Module, inputs: tuple) -> str:
    try:
        assert_equivalent(model, opt, *inputs)
    except AssertionError as e:
        return "differ: " + (str(e).strip().splitlines() or [""])[0][:200]
    return "equal"


def _planned(model: nn.Module, inputs: tuple, **kwargs: Any) -> tuple[nn.Module, float]:
    """``memplan.optimize(model, **kwargs)`` after its first call (which plans), with the planning seconds."""
    opt = memplan.optimize(model, **kwargs)
    step_fn(opt, inputs, train=True)()
    return opt, opt.plan.plan_seconds


def _smallest(model: nn.Module, inputs: tuple) -> tuple[nn.Module, float, int]:
    """memplan at the smallest peak it can reach: the peak a one-byte budget's error names, planned as the
    budget. Returns the module, its planning seconds and that predicted peak."""
    try:
        _planned(model, inputs, budget=1)
    except memplan.InfeasibleBudgetError as e:
        smallest = e.smallest
    else:
        raise AssertionError("a budget of one byte was met")  # nothing can be planned in one byte
    opt, seconds = _planned(model, inputs, budget=smallest)
    return opt, seconds, smallest


def _memplan_variants(case: Case, budgets: Sequence[float]) -> tuple[list[tuple[str, nn.Module, float]], list[Row]]:
    """The memplan variants that planned, as (label, module, plan seconds), and rows for budgets no plan met."""
    planned = []
    unmet = []
    opt, seconds = _planned(case.model, case.inputs)
    planned.append(("memplan default", opt, seconds))
    for budget in budgets:
        label = f"memplan budget={budget:g}"
        try:
            opt, seconds = _planned(case.model, case.inputs, budget=budget)
        except memplan.InfeasibleBudgetError as e:
            unmet.append(Row(case.name, label, None, None, None, None, memplan=True,
                             note=f"no plan fits; smallest predicted {_mib(e.smallest)} MiB"))
            continue
        planned.append((label, opt, seconds))
    opt, seconds, _ = _smallest(case.model, case.inputs)
    planned.append(("memplan smallest", opt, seconds))
    return planned, unmet


def measure_model(case: Case, budgets: Sequence[float], repeats: int, progress: Callable[[str], None]) -> list[Row]:
    """Every in-process variant of ``case``: peaks by the ruler, times interleaved, gradients checked."""
    progress(f"{case.name}: planning")
    planned, unmet = _memplan_variants(case, budgets)
    variants = [("eager", case.model, None), ("checkpoint per block", case.checkpointed, None)] + planned
    steps, peaks = [], []
    for label, module, _ in variants:
        step = step_fn(module, case.inputs, train=True)
        step()  # warm-up: kernels, the allocator
        steps.append(step)
        peaks.append(memplan.measure(step).peak)
    progress(f"{case.name}: checking gradients")
    grads = [_grads(case.model, module, case.inputs) if label.startswith("memplan") else ""
             for label, module, _ in variants]
    progress(f"{case.name}: timing {len(steps)} variants x {repeats}")
    seconds = interleaved_medians(steps, repeats, torch.device("cpu"))
    rows = []
    for (label, _, plan_seconds), peak, median, grad in zip(variants, peaks, seconds, grads):
        rows.append(Row(case.name, label, peak, peak / peaks[0], median / seconds[0], median, plan_seconds, grad,
                        memplan=label.startswith("memplan")))
    order = [label for label, _, _ in variants[:3]] + [f"memplan budget={b:g}" for b in budgets] + ["memplan smallest"]
    return sorted(rows + unmet, key=lambda r: order.index(r.variant))


# ------------------------------------------------------------------------------------------------
# torch.compile, in a process of its own


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_peak(step: Callable[[], Any]) -> int:
    """Bytes the resident set grew by during ``step`` at its highest: VmHWM after the step, reset to the
    resident set just before it (``/proc/self/clear_refs``), minus that resident set."""
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the high-water mark to the current resident set
    step()
    return (_rss_kib("VmHWM") - before) * 1024


def _compile_worker(name: str, size: str, vocab: int, budget: float, backend: str, repeats: int) -> dict[str, Any]:
    """Eager and ``torch.compile`` under ``activation_memory_budget=budget``, peaks by RSS (median of three)."""
    import statistics

    torch.set_num_threads(1)
    from torch._functorch import config as functorch_config

    functorch_config.activation_memory_budget = budget
    case = build(name, size, vocab)
    eager = step_fn(case.model, case.inputs, train=True)
    start = time.perf_counter()
    compiled = step_fn(torch.compile(case.model, backend=backend), case.inputs, train=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled()
        compile_seconds = time.perf_counter() - start
        compiled()
    eager()
    eager()
    peaks = {label: statistics.median(rss_peak(step) for _ in range(3)) for label, step in
             (("eager", eager), ("compiled", compiled))}
    eager_seconds, compiled_seconds = interleaved_medians([eager, compiled], repeats, torch.device("cpu"))
    return {"eager_rss": peaks["eager"], "compiled_rss": peaks["compiled"], "eager_seconds": eager_seconds,
            "compiled_seconds": compiled_seconds, "compile_seconds": compile_seconds}


def measure_compiled(name: str, size: str, vocab: int, budget: float, backend: str, repeats: int,
                     timeout: float) -> Row:
    label = f"compile budget={budget:g} (RSS)"
    if backend == "inductor" and shutil.which(os.environ.get("CXX", "g++")) is None:
        return Row(name, label, None, None, None, None, rss=True, note="no C++ compiler for inductor")
    env = dict(os.environ)
    # Big blocks from mmap and back to the system on free, so the resident set follows live tensors.
    env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1")
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--compile-worker", name, "--size", size,
               "--vocab", str(vocab), "--compile-budget", str(budget), "--compile-backend", backend,
               "--repeats", str(repeats)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Row(name, label, None, None, None, None, rss=True, note=f"compile step over {timeout:.0f} s")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Row(name, label, None, None, None, None, rss=True, note=f"failed: {last[:160]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return Row(name, label, int(out["compiled_rss"]), out["compiled_rss"] / out["eager_rss"],
               out["compiled_seconds"] / out["eager_seconds"], out["compiled_seconds"], rss=True,
               note=f"eager by RSS {_mib(out['eager_rss'])} MiB; compiling {out['compile_seconds']:.0f} s")


# ------------------------------------------------------------------------------------------------
# checks and the table


def checks(rows: Sequence[Row]) -> list[Check]:
    """The three checks against per-block checkpointing, for one model's rows (ruler peaks only)."""
    model = rows[0].model
    by = {r.variant: r for r in rows}
    hand = by.get("checkpoint per block")
    default = by.get("memplan default")
    ours = [r for r in rows if r.memplan and r.peak is not None]
    if hand is None or default is None or not ours:
        return [Check(model, name, None, "a variant is missing") for name in "abc"]
    out = []
    dominated = default.peak > hand.peak and default.time_ratio > hand.time_ratio
    out.append(Check(model, "a", not dominated,
                     f"default {_mib(default.peak)} MiB at {default.time_ratio:.2f}x vs checkpoint "
                     f"{_mib(hand.peak)} MiB at {hand.time_ratio:.2f}x"
                     + (" (more memory and more time)" if dominated else "")))
    lowest = min(ours, key=lambda r: r.peak)
    out.append(Check(model, "b", lowest.peak < hand.peak,
                     f"{lowest.variant} {_mib(lowest.peak)} MiB vs checkpoint {_mib(hand.peak)} MiB "
                     f"({lowest.peak / hand.peak:.2f}x)"))
    in_time = [r for r in ours if r.time_ratio <= hand.time_ratio]
    if not in_time:
        fastest = min(ours, key=lambda r: r.time_ratio)
        out.append(Check(model, "c", False, f"no memplan variant within checkpoint's {hand.time_ratio:.2f}x "
                                            f"(fastest: {fastest.variant} at {fastest.time_ratio:.2f}x)"))
    else:
        best = min(in_time, key=lambda r: r.peak)
        out.append(Check(model, "c", best.peak <= CHECK_C_RATIO * hand.peak,
                         f"{best.variant} {_mib(best.peak)} MiB at {best.time_ratio:.2f}x = "
                         f"{best.peak / hand.peak:.2f}x checkpoint's {_mib(hand.peak)} MiB at "
                         f"{hand.time_ratio:.2f}x (needs <= {CHECK_C_RATIO:g})"))
    return out


CHECK_TEXT = {
    "a": "memplan default not dominated by checkpoint per block",
    "b": "memplan smallest peak below checkpoint per block's",
    "c": f"at checkpoint's time or less, memplan's peak <= {CHECK_C_RATIO:g}x checkpoint's",
}


def _mib(nbytes: float) -> str:
    """Mebibytes with three significant figures at least: ``"412.3"``, ``"1.25"``, ``"0.031"``."""
    mib = nbytes / MIB
    return f"{mib:.1f}" if mib >= 10 else f"{mib:.2f}" if mib >= 1 else f"{mib:.3f}"


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: Sequence[Row]) -> str:
    """The markdown table, within 100 columns."""
    lines = ["| model   | variant                  |  peak MiB | peak/eager | time/eager | plan s | grads  |",
             "|---------|--------------------------|----------:|-----------:|-----------:|-------:|--------|"]
    previous = None
    for r in rows:
        name = r.model if r.model != previous else ""
        previous = r.model
        peak = "-" if r.peak is None else _mib(r.peak) + ("*" if r.rss else "")
        grads = r.grads.split(":")[0] if r.grads else ""
        lines.append(f"| {name:7s} | {r.variant:24s} | {peak:>9s} | {_cell(r.peak_ratio, '.2f'):>10s} | "
                     f"{_cell(r.time_ratio, '.2f'):>10s} | {_cell(r.plan_seconds, '.1f'):>6s} | {grads:6s} |")
    return "\n".join(lines)


def report(cases: Sequence[dict[str, Any]], rows: Sequence[Row], found: Sequence[Check],
           skipped: dict[str, str]) -> str:
    out = [table(rows), "",
           "peak: one training step's peak by memplan.measure; * by the resident set's growth in a process of its",
           "own (/eager: over eager's peak measured the same way there). time/eager: median step time over",
           "eager's in the same rounds. plan s: memplan's first call. grads: loss and gradients against eager's.",
           ""]
    for case in cases:
        out.append(f"{case['name']}: {case['size']}; checkpoint per block: {case['checkpointing']}")
    notes = [r for r in rows if r.note]
    for r in notes:
        out.append(f"{r.model} / {r.variant}: {r.note}")
    for r in rows:
        if r.grads.startswith("differ"):
            out.append(f"{r.model} / {r.variant}: gradients {r.grads}")
    for name, why in skipped.items():
        out.append(f"{name}: skipped ({why})")
    out.append("")
    for c in found:
        verdict = "n/a" if c.passed is None else "PASS" if c.passed else "FAIL"
        out.append(f"{c.model} ({c.name}) {verdict}: {CHECK_TEXT[c.name]}: {c.detail}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("default", "small"), default="default")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--vocab", type=int, default=None,
                        help="Hugging Face language models' vocabulary (default: 8192; 512 at --size small)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--budgets", type=float, nargs="*", default=[0.5], help="memplan budgets, fractions")
    parser.add_argument("--compile-budget", type=float, default=0.5,
                        help="torch._functorch.config.activation_memory_budget for torch.compile")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--compile-timeout", type=float, default=240.0, help="seconds per model")
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier step times)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="write every figure to this file")
    parser.add_argument("--compile-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.vocab is None:
        args.vocab = 8192 if args.size == "default" else 512
    if args.compile_worker is not None:
        out = _compile_worker(args.compile_worker, args.size, args.vocab, args.compile_budget,
                              args.compile_backend, args.repeats)
        print(json.dumps(out))
        return out
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # the libraries' deprecation notes; memplan's own warnings are not expected

    def progress(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    start = time.perf_counter()
    rows: list[Row] = []
    found: list[Check] = []
    cases: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for name in args.models:
        try:
            case = build(name, args.size, args.vocab)
        except ImportError as e:
            skipped[name] = f"its library is absent: {e}"
            continue
        cases.append({"name": name, "size": case.size, "checkpointing": case.checkpointing})
        model_rows = measure_model(case, args.budgets, args.repeats, progress)
        del case
        if not args.no_compile:
            progress(f"{name}: torch.compile in a process of its own")
            model_rows.append(measure_compiled(name, args.size, args.vocab, args.compile_budget,
                                               args.compile_backend, args.repeats, args.compile_timeout))
        rows += model_rows
        found += checks(model_rows)
    text = report(cases, rows, found, skipped)
    seconds = time.perf_counter() - start
    print(text)
    print(f"\n{len(cases)} models in {seconds:.0f} s on CPU, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}")
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), "size": args.size,
              "seconds": seconds, "models": cases, "skipped": skipped,
              "rows": [dataclasses.asdict(r) for r in rows], "checks": [dataclasses.asdict(c) for c in found],
              "table": text}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
