"""Capture for another device than the model's: a plan for a GPU, made on a machine without one.

``capture(model, *inputs, target_device="cuda")`` traces the model as if its parameters, buffers and inputs
were on the target device, wherever they really are (the CPU, or the meta device for a model too big for
the machine), and gives a graph whose every value on the model's device is a fake tensor on the target, and
whose every device argument (``torch.zeros(..., device=x.device)``) names it.

What a CPU-only build of PyTorch allows
---------------------------------------
``FakeTensorMode`` makes fake ``cuda:0`` tensors on a CPU-only build, and runs their forward ops (the meta
kernels know their output sizes). It cannot run autograd over them: every autograd node records its
inputs' stream through the device's guard, which a CPU-only build has none of for CUDA (torch's
``_ensureCUDADeviceGuardSet`` installs a fake one only on a CUDA build without a GPU); PyTorch then aborts
the process (``terminate called``: "PyTorch is not linked with support for cuda devices"), and its backward
engine refuses a device without an accelerator even with a guard installed. A training step cannot be
traced over fake CUDA tensors on this build.

So where the target is CUDA and the build has no usable GPU, the trace runs over fake tensors on a
*stand-in* device, ``meta``, which autograd handles like the CPU. The graph records the target
(``CapturedGraph.target_device``): analyses charge its values as the target's allocator would, the passes
run on it as it is (their own traces run autograd too), and :func:`memplan.capture.on_target` moves every
value on the stand-in, and every device argument naming it, to the target (:func:`retarget`) where a graph
leaves the planner: ``memplan.analyze``'s result, a plan's emitted code. The stand-in is not the CPU so that the tensors
the model makes on the CPU (``torch.tensor(2.0)``, ``torch.arange(n)`` without ``device=``) stay on the CPU,
as they do in an eager run on the GPU: a 0-dim one mixes with the target's tensors there, a larger one fails
there as it fails in the trace. Where CUDA is available the trace runs on fake CUDA tensors directly (what
the fake mode supports), and nothing is moved.

Where CUDA's program differs from the stand-in's
------------------------------------------------
A composite operator that chooses its kernels by the device (``input.is_cuda()``) chooses the stand-in's
path; :func:`tracing_for` makes the CUDA choice where the CPU build knows its kernels' sizes (their meta
kernels), and refuses, with the user's line and a fix, where it does not. It intercepts the functions with a
torch function mode, so whatever name the model calls them by (``F.scaled_dot_product_attention``, an
imported alias, ``torch._VF.lstm_cell`` inside ``nn.LSTMCell``), and attention in ``torch.nn.functional``'s
namespace too (``nn.MultiheadAttention`` calls it where the mode is off):

* ``F.scaled_dot_product_attention``: on CUDA, PyTorch runs a fused kernel (flash attention for fp16/bf16
  on Ampere and later, else the memory-efficient kernel) where the arguments allow one, never holding the
  ``L x S`` scores. Its composite asks a per-device stub for the choice (``_fused_sdp_choice_stub``), which
  has no entry for the meta device, nor for CUDA in a CPU-only build (a fake CUDA tensor gets the math path
  too): a trace on this build runs the math path, which holds the scores. The trace asks for the memory-efficient
  kernel where its constraints hold (4-d query, key and value of one floating dtype among fp32/fp16/bf16,
  equal heads, head dims a multiple of 16 bytes' worth of elements) and the math path otherwise. Flash
  attention cannot be traced on the stand-in (its composite branch is taken only for CUDA tensors), so fp16
  and bf16 attention is planned as the memory-efficient kernel, whose saved log-sum-exp has its rows
  padded to a multiple of 32 where flash's does not.
* ``nn.LSTMCell``: CUDA runs the fused ``_thnn_fused_lstm_cell`` (saving one ``4 x hidden`` workspace per
  step), the stand-in the composite of matmuls and pointwise ops; the trace calls the fused kernel, as
  ``at::lstm_cell`` does on CUDA.
* Dropout (``F.dropout``, ``nn.Dropout``, ``torch.dropout``) in training: CUDA runs the fused
  ``native_dropout``, which saves a one-byte ``bool`` mask, where the stand-in draws a ``float`` noise tensor
  (``bernoulli_``, ``div_``, ``mul``) and saves it, four bytes an element; the trace calls ``native_dropout``,
  as ``at::dropout`` does for a CUDA tensor with ``0 < p < 1`` (in place, ``dropout_``, it does not fuse).
* Refused: ``nn.GRUCell`` (CUDA's fused ``_thnn_fused_gru_cell`` has no meta kernel in the CPU build, so its
  workspace is unknown), ``nn.LSTM``/``nn.GRU``/``nn.RNN`` (cuDNN sizes their workspace and reserve), and
  ``torch.autocast("cuda")`` (a CPU-only build turns it off, so the trace would run in float32 where the
  GPU runs in half precision); a tensor made with an explicit ``device="cuda"`` (the trace's tensors are on
  the stand-in; and autograd over a fake CUDA tensor would abort the process).

Code that asks the device (``x.is_cuda``, ``x.device.type == "cuda"``, ``torch.cuda.is_available()``) gets
the stand-in's answer and takes its non-CUDA branch. Kernels' own temporaries and cuDNN's workspaces are
outside the graph on every device (see :mod:`memplan.analysis.allocator`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from memplan._capture.fake import wrap_fake

__all__ = ["Target", "TargetError", "resolve_target", "tracing_for", "watching", "retarget", "sdp_choice"]

aten = torch.ops.aten
_META = torch.device("meta")


class TargetError(RuntimeError):
    """Raised inside a trace for a target device when the model does something this build cannot plan for
    that device; capture turns it into a :class:`~memplan.errors.CaptureError` naming the user's line."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a plan runs (``device``) and where its trace's fake tensors live (``trace_device``)."""

    device: torch.device
    trace_device: torch.device

    @property
    def stand_in(self) -> bool:
        """Whether the trace runs on a stand-in device, its values moved to ``device`` afterwards."""
        return self.trace_device != self.device


def resolve_target(device: torch.device | str | None) -> Target | None:
    """The :class:`Target` of ``device`` (None for None): CUDA without a usable GPU traces on the meta stand-in.

    Examples
    --------
    >>> resolve_target("cpu")
    Target(device=device(type='cpu'), trace_device=device(type='cpu'))
    """
    if device is None:
        return None
    device = torch.device(device)
    if device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(f"device={str(device)!r}: memplan plans for 'cpu' and 'cuda' (or 'cuda:N') devices")
    if device.type == "cuda":
        if torch.cuda.is_available():
            index = torch.cuda.current_device() if device.index is None else device.index
            device = torch.device("cuda", index)
            return Target(device, device)
        return Target(torch.device("cuda", device.index or 0), _META)
    return Target(device, device)


# ----------------------------------------------------------------------------------------------
# the CUDA choices of composite operators


#: ``torch.nn.attention.SDPBackend``'s values, as ``_fused_sdp_choice`` returns them.
_SDP_MATH, _SDP_EFFICIENT = 0, 2
_SDPA = torch._C._nn.scaled_dot_product_attention
_VF = torch._C._VariableFunctions


def sdp_choice(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
               enable_gqa: bool = False) -> int:
    """The kernel ``F.scaled_dot_product_attention`` is planned with for CUDA: the memory-efficient kernel
    (2) where its constraints hold (see the module docstring), else the math path (0).

    Examples
    --------
    >>> q = torch.empty(2, 4, 128, 64, device="meta")
    >>> sdp_choice(q, q, q), sdp_choice(q.double(), q.double(), q.double())
    (2, 0)
    """
    tensors = (query, key, value)
    dtype = query.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16) or any(t.dim() != 4 or t.dtype != dtype for t in tensors):
        return _SDP_MATH
    alignment = 16 // query.element_size()
    if query.shape[-1] != key.shape[-1] or query.shape[-1] % alignment or value.shape[-1] % alignment:
        return _SDP_MATH
    if not (query.shape[0] == key.shape[0] == value.shape[0] and query.shape[1] == key.shape[1] == value.shape[1]):
        return _SDP_MATH  # grouped-query attention, or broadcast batches: the math path
    if attn_mask is not None and (attn_mask.dtype not in (torch.bool, dtype) or attn_mask.dim() > 4):
        return _SDP_MATH
    return _SDP_EFFICIENT


def _efficient_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The attention mask as CUDA's ``scaled_dot_product_attention`` hands it to the memory-efficient kernel:
    a boolean mask made additive (``convert_boolean_attn_mask``), expanded to ``(B, H, L, S)`` and, where its
    last dimension's stride is not a multiple of 16, padded to one and sliced back (``preprocess_mask``,
    ``pad_bias``), which allocates the whole expanded mask."""
    if mask.dtype == torch.bool:
        mask = torch.where(mask.logical_not(), torch.tensor(-float("inf"), dtype=query.dtype),
                           torch.tensor(0.0, dtype=query.dtype))
    mask = mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if mask.stride(-1) % 16:
        size = mask.shape[-1]
        return torch.nn.functional.pad(mask, (0, 16 - size % 16))[..., :size]
    if any(stride % 16 or stride == 0 for stride in mask.stride()[:3]):
        return mask.contiguous()
    return mask


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as CUDA's composite runs it where :func:`sdp_choice` picks the
    memory-efficient kernel (the log-sum-exp computed only when autograd will need it), else as the
    stand-in runs it (the math path)."""
    if sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa) == _SDP_MATH:
        with torch._C.DisableTorchFunction():  # the function itself, not this one again (see tracing_for)
            return _SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None:
        attn_mask = _efficient_mask(attn_mask, query, key)
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    out, *_ = aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, lse, dropout_p, is_causal,
                                                           scale=scale)
    return out


def _fused_lstm_cell(input: torch.Tensor, hx: Any, w_ih: torch.Tensor, w_hh: torch.Tensor,
                     b_ih: torch.Tensor | None = None, b_hh: torch.Tensor | None = None) -> tuple[Any, Any]:
    """``lstm_cell`` as ``at::lstm_cell`` computes it for CUDA tensors: two matrix products and the fused cell."""
    h, c = hx
    igates = torch.matmul(input, w_ih.t())
    hgates = torch.matmul(h, w_hh.t())
    hy, cy, _ = aten._thnn_fused_lstm_cell(igates, hgates, c, b_ih, b_hh)
    return hy, cy


_F_DROPOUT = torch.nn.functional.dropout


def _fused_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``F.dropout`` as ``at::dropout`` runs it for a CUDA tensor: the fused ``native_dropout`` in training
    (out of place, ``0 < p < 1``, at least one element, on the stand-in), the composite otherwise."""
    if training and not inplace and 0.0 < p < 1.0 and input.numel() > 0 and input.device.type != "cpu":
        return aten.native_dropout(input, p, True)[0]
    return _F_DROPOUT(input, p, training, inplace)


def _fused_vf_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``torch.dropout`` (what ``F.dropout`` calls) as ``at::dropout`` runs it for a CUDA tensor."""
    return _fused_dropout(input, p, train)


def _refusing(what: str, why: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise TargetError(f"{what}: {why}")

    return refuse


_CUDNN_FIX = ("Fix: plan on a machine with a GPU, or plan the layer unrolled over its steps "
              "(nn.LSTMCell in a Python loop is planned for CUDA).")

#: torch functions a stand-in trace for CUDA runs as CUDA's composites run them, or refuses.
_CUDA_CHOICES: dict[Any, Callable[..., Any]] = {
    _SDPA: _attention,
    _VF.lstm_cell: _fused_lstm_cell,
    _F_DROPOUT: _fused_dropout,
    _VF.dropout: _fused_vf_dropout,
    _VF.gru_cell: _refusing(
        "nn.GRUCell runs CUDA's fused kernel _thnn_fused_gru_cell", "this CPU-only build of PyTorch has no size "
        "rule (meta kernel) for it, so the workspace it saves cannot be predicted. Fix: plan on a machine with a "
        "GPU, or write the cell's gates with tensor ops (two matmuls, sigmoid, tanh), which are planned for CUDA."),
    **{getattr(_VF, name): _refusing(f"nn.{label} runs cuDNN on CUDA", "cuDNN sizes its workspace and reserve "
                                     f"on the GPU, which a CPU-only build cannot predict. {_CUDNN_FIX}")
       for name, label in (("lstm", "LSTM"), ("gru", "GRU"), ("rnn_tanh", "RNN"), ("rnn_relu", "RNN"))},
}


class _CudaChoices(TorchFunctionMode):
    """Runs the functions of :data:`_CUDA_CHOICES` their CUDA way; every other function as it is."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        choice = _CUDA_CHOICES.get(func)
        return (choice or func)(*args, **(kwargs or {}))


def _refuse_cuda_autocast(init: Callable[..., None]) -> Callable[..., None]:
    """``autocast.__init__``, raising :class:`TargetError` for an enabled ``torch.autocast("cuda")``."""

    def autocast_init(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        enabled = kwargs.get("enabled", args[1] if len(args) > 1 else True)
        if device_type == "cuda" and enabled:
            raise TargetError(
                "torch.autocast('cuda') runs the step in half precision on the GPU; this CPU-only build of "
                "PyTorch has no CUDA autocast and would trace the step in the model's own precision. Fix: plan on "
                "a machine with a GPU, or plan the step in that precision by casting the model and inputs "
                "(model.to(torch.bfloat16)) and leaving autocast out.")
        init(self, device_type, *args, **kwargs)

    return autocast_init


@contextlib.contextmanager
def tracing_for(target: Target | None) -> Iterator[None]:
    """While a model is traced on a stand-in for a CUDA ``target``: composite operators make CUDA's choices
    (:data:`_CUDA_CHOICES`) or refuse, and ``torch.autocast("cuda")`` refuses (see the module docstring).
    Nothing for a trace on the target itself.

    The functions are caught by a torch function mode, whatever name the model calls them by, and
    ``F.scaled_dot_product_attention`` is also replaced in ``torch.nn.functional``'s namespace: a mode does
    not see the calls made inside a Python function of torch's that it was itself handed
    (``F.multi_head_attention_forward``, which ``nn.MultiheadAttention`` calls, runs with the mode off)."""
    if target is None or not target.stand_in or target.device.type != "cuda":
        yield
        return
    import torch.nn.functional as F
    from torch.amp import autocast_mode

    init, attention = autocast_mode.autocast.__init__, F.scaled_dot_product_attention
    autocast_mode.autocast.__init__ = _refuse_cuda_autocast(init)
    F.scaled_dot_product_attention = _attention
    try:
        with _CudaChoices():
            yield
    finally:
        autocast_mode.autocast.__init__ = init
        F.scaled_dot_product_attention = attention


Observer = Callable[[torch.fx.Node, Any], None]


def watching(target: Target | None, observer: Observer) -> Observer:
    """``observer``, refusing first any op of a stand-in trace that makes a tensor on a CUDA device (a
    factory given ``device="cuda"`` in the model's code): the trace's tensors are on the stand-in, and
    autograd over a fake CUDA tensor would abort this CPU-only build."""
    if target is None or not target.stand_in:
        return observer

    def observe(last: torch.fx.Node, out: Any) -> None:
        for value in pytree.tree_leaves(out):
            if isinstance(value, FakeTensor) and value.fake_device.type == "cuda":
                raise TargetError(
                    f"the model makes a tensor on {value.fake_device} by name (device='cuda'): a plan for "
                    f"{target.device} is traced on a stand-in device on this CPU-only build. Fix: make it on the "
                    "device of the model's tensors (device=x.device, x.new_zeros(...)), or register it as a "
                    "buffer, which model.to(device) moves")
        observer(last, out)

    return observe


# ----------------------------------------------------------------------------------------------
# moving the finished graph to the target


def retarget(gm: torch.fx.GraphModule, target: Target) -> None:
    """Move every fake value on the stand-in device, and every device argument naming it, to the target,
    in place. Storages stay shared as they were (the moved values keep their meta storages)."""
    if not target.stand_in:
        return
    stand_in, device = target.trace_device, target.device


    def moved(value: Any) -> Any:
        if isinstance(value, FakeTensor):
            if value.fake_device != stand_in:
                return value
            meta = torch.empty((0,), dtype=value.dtype, device=_META).set_(
                value.untyped_storage(), value.storage_offset(), value.shape, value.stride())
            return wrap_fake(value.fake_mode, meta, device)
        if isinstance(value, torch.device):
            return device if value == stand_in else value
        if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
            items = [moved(v) for v in value]
            if all(a is b for a, b in zip(items, value)):
                return value
            return type(value)(items)
        if isinstance(value, dict):
            items = {k: moved(v) for k, v in value.items()}
            return value if all(items[k] is v for k, v in value.items()) else items
        return value

    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = moved(node.meta["val"])
        if node.op == "call_function":
            args, kwargs = moved(node.args), moved(node.kwargs)
            if args is not node.args:
                node.args = args
            if kwargs is not node.kwargs:
                node.kwargs = kwargs
    gm.recompile()
