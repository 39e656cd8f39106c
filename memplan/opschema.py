"""What an operator's schema says about its arguments: which it writes, whether it only makes views.

No dependency on the rest of memplan, so capture and the passes can both use it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx

__all__ = ["mutated_args", "is_pure_view"]


@functools.lru_cache(maxsize=None)
def _written_arguments(schema: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of the arguments a schema writes into. Passes ask this of every node again
    and again (hundreds of thousands of times on an unrolled loop), so each schema is read once."""
    return tuple((i, arg.name) for i, arg in enumerate(schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write)


@functools.lru_cache(maxsize=None)
def _only_views(schema: Any) -> bool:
    """Whether every return of a schema aliases an argument it does not write (a pure view)."""
    if not schema.returns or _written_arguments(schema):
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The argument nodes an op writes into, from its schema (``add_``'s ``self``, an ``out=``)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    mutated = []
    for i, name in _written_arguments(schema):
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
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return False
    return _only_views(schema)
