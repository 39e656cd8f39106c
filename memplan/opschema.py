"""What an operator's schema says about its arguments: which it writes, whether it only makes views.

No dependency on the rest of memplan, so capture and the passes can both use it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["mutated_args", "is_pure_view", "is_view_op"]


# Passes ask these of every node again and again (hundreds of thousands of times on an unrolled loop),
# so each operator's schema is read once. Keyed by the operator: schemas with list defaults are unhashable.
_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}
_VIEWS: dict[Any, bool] = {}


def _written_arguments(target: Any, schema: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of the arguments an operator writes into."""
    written = _WRITTEN.get(target)
    if written is None:
        written = tuple((i, arg.name) for i, arg in enumerate(schema.arguments)
                        if arg.alias_info is not None and arg.alias_info.is_write)
        _WRITTEN[target] = written
    return written


def _only_views(target: Any, schema: Any) -> bool:
    """Whether every return of an operator aliases an argument it does not write (a pure view)."""
    views = _VIEWS.get(target)
    if views is None:
        views = bool(schema.returns) and not _written_arguments(target, schema) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        _VIEWS[target] = views
    return views


# The arguments each target writes, by ``id(target)`` (an OpOverload hashes in Python, a dict keyed by
# its id does not); the target is kept beside them so its id cannot be reused.
_WRITTEN_BY_ID: dict[int, tuple[Any, tuple[tuple[int, str], ...]]] = {}


def mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The argument nodes an op writes into, from its schema (``add_``'s ``self``, an ``out=``)."""
    target = node.target
    if isinstance(target, str):
        return []  # a placeholder, attribute or method name: no schema
    known = _WRITTEN_BY_ID.get(id(target))
    if known is None or known[0] is not target:
        schema = getattr(target, "_schema", None)
        known = _WRITTEN_BY_ID[id(target)] = (target, () if schema is None else _written_arguments(target, schema))
    written = known[1]
    if not written:
        return []
    mutated = []
    for i, name in written:
        value = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        if isinstance(value, torch.fx.Node):
            mutated.append(value)
    return mutated


def is_pure_view(node: torch.fx.Node) -> bool:
    """True when ``node`` only makes aliases of an argument (``select``, ``t``, ``view``): reads no data.

    Examples
    --------
    >>> g = torch.fx.Graph()
    >>> x = g.placeholder("x")
    >>> [is_pure_view(g.call_function(op, (x, 0))) for op in (torch.ops.aten.select.int, torch.ops.aten.add.Tensor)]
    [True, False]
    """
    if node.op != "call_function":
        return False
    return is_view_op(node.target)


def is_view_op(target: Any) -> bool:
    """True when the operator ``target`` only makes aliases of its arguments (see :func:`is_pure_view`).

    Examples
    --------
    >>> is_view_op(torch.ops.aten.t.default), is_view_op(torch.ops.aten.exp.default), is_view_op(len)
    (True, False, False)
    """
    known = _VIEWS_BY_ID.get(id(target))
    if known is None or known[0] is not target:
        schema = getattr(target, "_schema", None)
        known = (target, schema is not None and _only_views(target, schema))
        if not isinstance(target, str):
            _VIEWS_BY_ID[id(target)] = known
    return known[1]


# Whether each target only makes views, by ``id(target)`` (see ``_WRITTEN_BY_ID``).
_VIEWS_BY_ID: dict[int, tuple[Any, bool]] = {}
