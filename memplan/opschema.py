"""What an operator's schema says about its arguments: which it writes, whether it only makes views.

No dependency on the rest of memplan, so capture and the passes can both use it.
"""

from __future__ import annotations

import torch
import torch.fx

__all__ = ["mutated_args", "is_pure_view"]


def mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The argument nodes an op writes into, from its schema (``add_``'s ``self``, an ``out=``)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    mutated = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
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
    if node.op != "call_function" or schema is None or not schema.returns:
        return False
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
