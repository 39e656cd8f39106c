"""Autograd's formulas as eager runs them, where a dispatch mode would change them.

Several of PyTorch's backward formulas make a gradient by writing into a tensor of zeros: ``max`` and ``min``
over a dimension, ``kthvalue``, ``mode``, ``median``, ``sort`` and ``topk`` scatter the incoming gradient
into zeros at the selected indices, ``gather`` scatter-adds it, ``index_select`` index-adds it, indexing
puts it, ``masked_select`` masked-scatters it, ``cummax`` and ``cummin`` scatter-add it. Eager writes in
place (``zeros.scatter_(...)``): one gradient-sized tensor. Under a tensor subclass or a dispatch mode
(``isTensorSubclassLike`` in ``FunctionsManual.cpp``) the formula takes its out-of-place form
(``zeros.scatter(...)``), two such tensors at once. memplan traces over fake tensors (a subclass) and
measures under a dispatch mode, so both would see the out-of-place form: on an H100, eager's maxsim step
peaked at 1004 MiB where the trace of it said 1.90 GiB.

:class:`EagerFormulas` puts the in-place form back: given each op a mode sees, it names the in-place op
to run instead when the op is the out-of-place write of one of those formulas into zeros the same
formula made and nothing has read since. The tracer (``memplan/_capture/tracer.py``) records that op, so
the captured graph is eager's program, and the ruler (:func:`memplan.measure.measure`) runs it, so it
measures eager's step; ``allocator_peak``, which needs no mode, checks both (``tests/test_formulas.py``).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["EagerFormulas"]

aten = torch.ops.aten

#: The out-of-place writes those formulas take under a mode, and the in-place op eager runs.
_IN_PLACE = {
    aten.scatter.src: aten.scatter_.src,
    aten.scatter.value: aten.scatter_.value,
    aten.scatter_add.default: aten.scatter_add_.default,
    aten.index_add.default: aten.index_add_.default,
    aten.index_put.default: aten.index_put_.default,
    aten._unsafe_index_put.default: aten.index_put_.default,
    aten.masked_scatter.default: aten.masked_scatter_.default,
}

_ZEROS = frozenset({aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default})

#: The autograd nodes (generated names without their overload number) whose formulas write into zeros in
#: place in eager; no other node's ops are touched, nor a custom Function's backward.
_NODES = frozenset({
    "MaxBackward", "MinBackward", "KthvalueBackward", "ModeBackward", "MedianBackward", "NanmedianBackward",
    "SortBackward", "TopkBackward", "GatherBackward", "IndexSelectBackward", "IndexBackward",
    "MaskedSelectBackward", "CummaxBackward", "CumminBackward",
})

_NUMBERED = re.compile(r"\d+$")


def _formula_node() -> Any:
    """The autograd node running now when it is one of :data:`_NODES`, else None."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    return node if _NUMBERED.sub("", type(node).__name__) in _NODES else None


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _whole(tensor: torch.Tensor) -> bool:
    """``tensor`` is its storage, all of it, in order."""
    return (tensor.storage_offset() == 0 and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes())


class EagerFormulas:
    """Per call (one trace, one measurement): the zeros those formulas made and nothing has read yet.

    ``in_place(func, args)`` before each op: the in-place op to run instead of ``func`` (None: run
    ``func``); ``made(func, out)`` after it.
    """

    def __init__(self) -> None:
        self._fresh: dict[int, Any] = {}  # storage key -> the autograd node whose formula made the zeros

    def in_place(self, func: Any, args: tuple, kwargs: dict | None = None) -> Any:
        if not self._fresh:
            return None
        current = _formula_node()
        if any(node is not current for node in self._fresh.values()):  # made by a formula that has returned
            self._fresh = {key: node for key, node in self._fresh.items() if node is current}
        target = _IN_PLACE.get(func)
        if target is not None and args and isinstance(args[0], torch.Tensor):
            key = _key(args[0])
            if key in self._fresh and _whole(args[0]):
                del self._fresh[key]
                return target
        for leaf in tree_leaves((args, kwargs)):  # anything else that reads them: they are not fresh anymore
            if isinstance(leaf, torch.Tensor):
                self._fresh.pop(_key(leaf), None)
        return None

    def made(self, func: Any, out: Any) -> None:
        if func in _ZEROS and isinstance(out, torch.Tensor):
            node = _formula_node()
            if node is not None and _whole(out):
                self._fresh[_key(out)] = node
