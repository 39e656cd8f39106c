"""What an operator's schema says about its arguments: which it writes, whether it only makes views,
whether it draws from the RNG.

No dependency on the rest of memplan, so capture and the passes can both use it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["BATCH_NORM_RUNNING_STATISTICS", "CONTIGUOUS_RESULTS", "GRAD_MODE_OPS", "SIZED_BY_RUNNING",
           "REDUCED_IN_RESULT", "KERNEL_DTYPE_OPS", "STORAGE_OF_INPUT", "mutated_args", "kernel_dtypes",
           "without_running_statistics", "result_storage_numel", "is_pure_view", "is_random", "is_view_op"]


def _defaults(*names: str) -> frozenset:
    """The default overloads of the aten operators ``names`` this build has (one without oneDNN has no
    ``mkldnn_rnn_layer``)."""
    return frozenset(packet.default for packet in (getattr(torch.ops.aten, name, None) for name in names)
                     if packet is not None)


# Operators whose kernels return other outputs with autograd's grad mode on than off, whatever their
# arguments say: oneDNN's LSTM layer (what ``nn.LSTM`` runs on CPU) returns the workspace its backward
# reads only with it on, and its fake kernel makes that workspace empty. Capture learns their outputs'
# sizes from the real kernel and records the grad mode of each call (``node.meta["grad_enabled"]``);
# planned code, which runs with grad mode off, calls them in the recorded mode.
GRAD_MODE_OPS = _defaults("mkldnn_rnn_layer")


# Operators whose fake kernel refuses to size the outputs (it treats them as depending on values), though
# their sizes follow from the arguments' shapes and plain values: ``_ctc_loss`` with the lengths given as
# Python ints (``nn.CTCLoss`` called with tuples of lengths; its overload taking length tensors does depend
# on their values). Capture sizes their outputs by running the real kernel once, on zeros.
SIZED_BY_RUNNING = frozenset({torch.ops.aten._ctc_loss.default})


# Operators whose kernels return a contiguous result whatever the layout of their input, where the fake
# kernel follows the input's layout (the loss backwards allocate ``zeros_like(input,
# LEGACY_CONTIGUOUS_MEMORY_FORMAT)``): the gradient of ``F.mse_loss`` of a transposed input. A plan
# traced on the fake layout would take views the real result does not allow; capture gives their
# results the real layout.
CONTIGUOUS_RESULTS = _defaults("mse_loss_backward", "smooth_l1_loss_backward", "huber_loss_backward")


# Operators whose CPU kernels give some results another dtype than their fake kernels say, for reduced-precision
# inputs (what autocast makes). Capture gives those results the kernel's dtype (see :func:`kernel_dtypes`).
#
# Normalisations given a bfloat16 or half input with float32 parameters (autocast leaves a layer norm of a
# bfloat16 activation its float32 weights) return the statistics they save for the backward (mean and
# inverse deviation, results 1 and 2) in the parameters' dtype, where the fake kernels say the input's: a
# ConvNeXt under bfloat16 autocast held 512 bytes more per layer norm than predicted. Operator -> the
# positions of its parameters (weight, bias, running statistics).
STATISTICS_IN_PARAMETER_DTYPE = {
    op: positions for name, positions in (
        ("native_layer_norm", (2, 3)), ("native_group_norm", (1, 2)), ("native_batch_norm", (1, 2, 3, 4)),
        ("_native_batch_norm_legit", (1, 2, 3, 4)), ("_native_batch_norm_legit_functional", (1, 2, 3, 4)),
        ("_native_batch_norm_legit_no_training", (1, 2, 3, 4)),
    ) for op in _defaults(name)
}
# Their backwards whose fake kernels then give the input's gradient (result 0) the float32 statistics' dtype,
# where the kernel gives it the input's (argument 1): operator -> the statistics' position.
GRADIENT_IN_INPUT_DTYPE = {op: 2 for op in _defaults("native_group_norm_backward")}
# Backwards that compute every gradient in float32 for bfloat16 inputs: oneDNN's LSTM layer (torch 2.11's fake
# kernel says bfloat16; an LSTM under autocast held twice the gradients it was predicted to).
FLOAT32_GRADIENTS = _defaults("mkldnn_rnn_layer_backward")
KERNEL_DTYPE_OPS = STATISTICS_IN_PARAMETER_DTYPE.keys() | GRADIENT_IN_INPUT_DTYPE.keys() | FLOAT32_GRADIENTS
_REDUCED_FLOATS = (torch.bfloat16, torch.float16)


def kernel_dtypes(func: Any, args: tuple, device: torch.device) -> tuple[torch.dtype, tuple[int, ...] | None] | None:
    """For an operator of :data:`KERNEL_DTYPE_OPS` called on ``args``: the dtype its CPU kernel gives some of
    its results, and which (None: all), where the fake kernel may give another; None where they agree.

    Examples
    --------
    >>> import torch
    >>> x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8)
    >>> kernel_dtypes(torch.ops.aten.native_layer_norm.default, (x, [8], w, w, 1e-5), torch.device("cpu"))
    (torch.float32, (1, 2))
    >>> torch.ops.aten.native_layer_norm(x, [8], w, w, 1e-5)[1].dtype
    torch.float32
    >>> kernel_dtypes(torch.ops.aten.native_layer_norm.default, (x, [8], None, None, 1e-5), torch.device("cpu"))
    """
    if device.type != "cpu" or not args:
        return None
    if func in FLOAT32_GRADIENTS:
        tensor = args[0]
        return (torch.float32, None) if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bfloat16 else None
    if func in GRADIENT_IN_INPUT_DTYPE:
        if len(args) < 3 or not isinstance(args[1], torch.Tensor):
            return None
        stats = args[GRADIENT_IN_INPUT_DTYPE[func]]
        reduced = args[1].dtype in _REDUCED_FLOATS and isinstance(stats, torch.Tensor) and stats.dtype != args[1].dtype
        return (args[1].dtype, (0,)) if reduced else None
    positions = STATISTICS_IN_PARAMETER_DTYPE.get(func)
    if positions is None or not isinstance(args[0], torch.Tensor) or args[0].dtype not in _REDUCED_FLOATS:
        return None
    params = [args[i] for i in positions if i < len(args) and isinstance(args[i], torch.Tensor)]
    mixed = next((p.dtype for p in params if p.dtype != args[0].dtype), None)
    return (mixed, (1, 2)) if mixed is not None else None


# The arguments of ``native_batch_norm`` that are its running statistics, which it updates in training.
BATCH_NORM_RUNNING_STATISTICS = (3, 4)


def without_running_statistics(args: tuple) -> tuple:
    """A ``native_batch_norm`` call's arguments with no running statistics to update. The kernel computes the
    batch statistics and the output from the input, weight, bias, momentum and eps alone, so the call gives
    the same statistics and output as the original, bit for bit on the CPU, and writes nothing (``rewrite``'s
    batch norm output made again, and ``remat``'s recomputed batch norm).

    Examples
    --------
    >>> without_running_statistics(("x", "w", "b", "mean", "var", True, 0.1, 1e-5))
    ('x', 'w', 'b', None, None, True, 0.1, 1e-05)
    """
    return tuple(None if i in BATCH_NORM_RUNNING_STATISTICS else a for i, a in enumerate(args))


# Operators whose kernels make their result in storage allocated like their first argument, then resized
# down: ``col2im`` (``F.fold``, the backward of ``F.unfold``) keeps storage as large as its input, up to
# the kernel's area times its result. Capture gives their results a storage of that size, so the plan
# counts what the kernel holds.
STORAGE_OF_INPUT = _defaults("col2im")


# Losses whose CPU kernels, with a reduction (``"mean"``, ``"sum"``), write the elementwise loss into
# their result's storage and then reduce it in place: the 0-d loss keeps a storage of the broadcast
# inputs' size for as long as it lives (through the backward, in training). ``F.mse_loss``,
# ``F.smooth_l1_loss``, ``F.soft_margin_loss``, ``F.binary_cross_entropy``; ``huber_loss`` does not.
# Capture gives their results that storage (see :func:`result_storage_numel`). CUDA kernels are left as
# the fake kernel says (not measured).
REDUCED_IN_RESULT = _defaults("mse_loss", "smooth_l1_loss", "soft_margin_loss", "binary_cross_entropy")
_REDUCTION_ARG = {"mse_loss": 2, "smooth_l1_loss": 2, "soft_margin_loss": 2, "binary_cross_entropy": 3}


def result_storage_numel(func: Any, args: tuple, kwargs: dict, out: Any) -> int | None:
    """Elements of the storage the real kernel gives ``out`` (a tensor result of ``func`` called on
    ``args``), where it is known to differ from the result's own elements; None otherwise.

    Examples
    --------
    >>> import torch
    >>> a, b = torch.randn(8, 4), torch.randn(8, 4)
    >>> result_storage_numel(torch.ops.aten.mse_loss.default, (a, b), {}, torch.ops.aten.mse_loss(a, b))
    32
    >>> result_storage_numel(torch.ops.aten.mse_loss.default, (a, b, 0), {}, torch.ops.aten.mse_loss(a, b, 0)) is None
    True
    """
    if not isinstance(out, torch.Tensor):
        return None
    if func in STORAGE_OF_INPUT:
        return args[0].numel()
    if func in REDUCED_IN_RESULT and out.device.type == "cpu":
        index = _REDUCTION_ARG[func._opname]
        reduction = args[index] if len(args) > index else kwargs.get("reduction", 1)
        if reduction == 0 or not all(isinstance(a, torch.Tensor) for a in args[:2]):
            return None
        return torch.broadcast_shapes(args[0].shape, args[1].shape).numel()
    return None


# Passes ask these of every node again and again (hundreds of thousands of times on an unrolled loop),
# so each operator's schema is read once. Keyed by ``id(target)``: an OpOverload hashes in Python (and
# schemas with list defaults are unhashable), a dict keyed by its id does not; the target is kept
# beside its facts so its id cannot be reused.
_WRITTEN: dict[int, tuple[Any, tuple[tuple[int, str], ...]]] = {}
_VIEWS: dict[int, tuple[Any, bool]] = {}


# Operators that write into arguments their schema does not mark as written: the batch norms update
# the running statistics (``running_mean``, ``running_var``) in place when ``training`` is true. By
# name: ``(written positions, the position of the flag that makes them write)``.
_UNMARKED_WRITES = {
    "aten::native_batch_norm": ((3, 4), 5),
    "aten::cudnn_batch_norm": ((3, 4), 5),
    "aten::miopen_batch_norm": ((3, 4), 5),
    "aten::batch_norm_update_stats": ((1, 2), None),
}
_WRITES_WHEN: dict[int, tuple[Any, tuple[int, str]]] = {}  # id(target) -> (target, the flag argument)


def _written_arguments(target: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of the arguments an operator writes into (none for a target without a schema)."""
    known = _WRITTEN.get(id(target))
    if known is None or known[0] is not target:
        schema = getattr(target, "_schema", None)
        arguments = () if schema is None else schema.arguments
        written = tuple((i, arg.name) for i, arg in enumerate(arguments)
                        if arg.alias_info is not None and arg.alias_info.is_write)
        unmarked = _UNMARKED_WRITES.get(schema.name) if schema is not None and schema.overload_name == "" else None
        if unmarked is not None:
            positions, flag = unmarked
            written += tuple((i, arguments[i].name) for i in positions)
            if flag is not None:
                _WRITES_WHEN[id(target)] = (target, (flag, arguments[flag].name))
        known = _WRITTEN[id(target)] = (target, written)
    return known[1]


def mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The argument nodes an op writes into, from its schema (``add_``'s ``self``, an ``out=``)."""
    target = node.target
    known = _WRITTEN.get(id(target))  # the common case, inlined: this runs for every node of every walk
    if known is not None and known[0] is target:
        written = known[1]
    elif isinstance(target, str):
        return []  # a placeholder, attribute or method name: no schema
    else:
        written = _written_arguments(target)
    if not written:
        return []
    gate = _WRITES_WHEN.get(id(target))
    if gate is not None and gate[0] is target:
        position, name = gate[1]
        if not (node.args[position] if position < len(node.args) else node.kwargs.get(name, False)):
            return []  # a batch norm in evaluation: it only reads the running statistics
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


def is_random(node: torch.fx.Node) -> bool:
    """True for ops that draw from the RNG (their values change if they run twice).

    Fused attention (``scaled_dot_product_attention``'s kernels) is tagged as drawing, for its
    dropout, but with ``dropout_p=0`` it draws nothing and runs the same every time. Its backward
    (tagged too, on CUDA's memory-efficient and cuDNN kernels) draws nothing either way: it takes the
    forward's draw as arguments (``philox_seed``, ``philox_offset``) and makes the same mask again.

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> q = torch.randn(1, 2, 4, 8)
    >>> g = capture(lambda q, p: torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=p),
    ...             q, 0.0, train=False)
    >>> [is_random(n) for n in g.gm.graph.nodes if n.op == "call_function" and "attention" in str(n.target)]
    [False]
    """
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    schema = getattr(node.target, "_schema", None)
    arguments = schema.arguments if schema is not None else ()
    if any(argument.name == "philox_seed" for argument in arguments):
        return False  # replays the draw it is given
    for i, argument in enumerate(arguments):
        if argument.name == "dropout_p":
            p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", argument.default_value)
            return not (isinstance(p, (int, float)) and p == 0)
    return True


def is_view_op(target: Any) -> bool:
    """True when the operator ``target`` only makes aliases of its arguments (see :func:`is_pure_view`).

    Examples
    --------
    >>> is_view_op(torch.ops.aten.t.default), is_view_op(torch.ops.aten.exp.default), is_view_op(len)
    (True, False, False)
    """
    if isinstance(target, str):
        return False  # a placeholder, attribute or method name: no schema
    known = _VIEWS.get(id(target))
    if known is None or known[0] is not target:
        schema = getattr(target, "_schema", None)
        views = schema is not None and bool(schema.returns) and not _written_arguments(target) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        known = _VIEWS[id(target)] = (target, views)
    return known[1]
