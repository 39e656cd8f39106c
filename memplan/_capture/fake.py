"""Building fake tensors fast: :func:`wrap_fake`, what ``FakeTensor(mode, meta, device)`` builds, at a
third of the cost (passes build tens of thousands of fake values on an unrolled loop)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode

__all__ = ["wrap_fake"]

_exporting = getattr(torch.compiler, "is_exporting", lambda: False)  # newer torch only

#: Per fake mode, per fake device: the normalised fake device and the attributes
#: ``FakeTensor(mode, meta, device)`` gives a new tensor (see :func:`wrap_fake`). Weak keys: a captured
#: graph's mode goes when its graph goes.
_FAKE_ATTRIBUTES: weakref.WeakKeyDictionary[
    FakeTensorMode, dict[torch.device, tuple[torch.device, dict[str, Any]]]] = weakref.WeakKeyDictionary()


def wrap_fake(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device) -> FakeTensor:
    """``FakeTensor(mode, meta, device)``, the same tensor built at about a third of the cost.

    The constructor normalises the device, checks its arguments and sets some twenty attributes
    (the mode, the device, and per-tensor memos, several through descriptors) one by one, in Python:
    about half the cost of a node copy, and passes build tens of thousands of fake values on an
    unrolled loop. Here the tensor is made as the constructor makes it (``Tensor._make_subclass`` with
    the fake device's dispatch keys, mutable data pointers guarded as the mode says) and receives, in
    one update, the attributes the constructor gave the first tensor built for this mode and device;
    the constructor itself is called for that first tensor, and whenever it would do more (a tensor
    that requires grad, fake-tensor debugging, export's leak tracking) or raise (``meta`` not on the
    meta device). ``tests/test_graphutil.py``
    checks that both give equal tensors.
    """
    if (not meta.is_meta or meta.requires_grad or FakeTensorConfig.debug or _exporting()
            or not hasattr(mode, "_allow_unsafe_data_ptr_access")):  # a torch whose constructor differs
        return FakeTensor(mode, meta, device)
    per_device = _FAKE_ATTRIBUTES.get(mode)
    if per_device is None:
        per_device = _FAKE_ATTRIBUTES[mode] = {}
    known = per_device.get(device)
    if known is None:
        made = FakeTensor(mode, meta, device)
        # ``fake_device``, not the attribute behind it: torch 2.11 keeps the device in a plain attribute
        # of that name, later versions behind a property
        per_device[device] = (made.fake_device, dict(made.__dict__))
        return made
    fake_device, attributes = known
    fake = torch.Tensor._make_subclass(FakeTensor, meta, False, dispatch_device=True,
                                       device_for_backend_keys=fake_device)
    if mode._allow_unsafe_data_ptr_access:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(fake)
    else:
        torch._C._set_throw_on_mutable_data_ptr(fake)
    fake.__dict__.update(attributes)
    return fake
