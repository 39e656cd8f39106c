"""Operators that memplan's rewrites put into graphs, registered with PyTorch under ``memplan::``.

``torch.ops.memplan.grouped_addmm_(out, cols, values, dense, per_group, scatter, workspace)``
    A product of a sparse matrix with a dense one, added into ``out`` in place. The sparse matrix has
    ``nnz`` entries in groups of ``per_group``: entry ``e`` lies in group ``e // per_group``, at column
    ``cols[e]``, with value ``values[e]``.

    * ``scatter=False``: ``out[e // per_group] += values[e] * dense[cols[e]]`` (one row of ``out`` per
      group: the gradient of the rows a selection was taken for);
    * ``scatter=True``: ``out[cols[e]] += values[e] * dense[e // per_group]`` (one row of ``dense`` per
      group, added where the group's entries point: the gradient of what was selected).

    Repeated columns add up. ``cols`` is int32 or int64. ``workspace`` is a contiguous int64 tensor of
    shape ``(2, block)``, any ``block >= 1``, that the operator overwrites: the entries are taken
    ``block`` at a time, their coordinates written into it. It returns ``out``.

    Why an operator: this is the gradient of a selection (the entries a ``max`` over a matrix product
    kept), and every dense way to write it holds a temporary of ``nnz x k`` (the gathered or the
    weighted rows) before a sum or a scatter-add. PyTorch's CPU kernel for ``addmm_`` with a sparse COO
    first operand walks the entries one ``axpy`` at a time and allocates nothing, so the selection costs
    only its columns, values and a workspace of fixed size, tensors of the graph that memplan's analyses
    count: the operator writes a block of coordinates into the workspace, views them with the block's
    values as a sparse matrix (no copy) and calls that kernel, so memplan's graphs, analyses and
    generated code see dense tensors only, and the writes are declared in the schema (``Tensor(a!)``)
    like any ATen in-place op's.

    Without ``scatter`` and with int32 columns, each block is a compressed-row matrix instead (its row
    offsets in the workspace, the columns and values as they are), which MKL multiplies without a copy
    and several times faster.

    Groups are positions, not stored row numbers: a chunk of consecutive groups is the same operator on
    the matching slices of the entries and of the grouped side (``out`` or ``dense``), which is how the
    chunk pass splits it.

    On CUDA the same call goes through cuSPARSE, which converts the matrix to compressed rows inside
    the call; the CUDA ruler (the allocator's own peak) sees that workspace, the CPU ruler has nothing
    to see. Results equal a dense ``index_add_`` up to summation order.

Examples
--------
>>> import torch, memplan.ops
>>> dense = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
>>> cols, values = torch.tensor([1, 0, 1, 1]), torch.tensor([1.0, 2.0, -1.0, 3.0])
>>> workspace = torch.empty(2, 3, dtype=torch.int64)
>>> torch.ops.memplan.grouped_addmm_(torch.zeros(2, 2), cols, values, dense, 2, False, workspace)
tensor([[5., 8.],
        [6., 8.]])
>>> torch.ops.memplan.grouped_addmm_(torch.zeros(2, 2), cols, values, dense, 2, True, workspace)
tensor([[ 2.,  4.],
        [ 7., 10.]])

The host tier: four operators that the ``offload`` pass (:mod:`memplan.passes.offload`) puts around a
saved activation, so that it waits in host memory between the forward and the backward.

``host = torch.ops.memplan.offload(x)``
    Starts copying ``x`` into a new host tensor of the same shape and strides (pinned, for a CUDA ``x``)
    on a side stream that first waits for the current one, and returns it. ``x`` must stay alive until
    ``offload_wait_``.
``host = torch.ops.memplan.offload_wait_(host, x)``
    Makes the current stream wait for that copy; after it, ``x`` may be freed and its memory reused.
    Returns ``host`` (the copy is done: declared as a write).
``dev = torch.ops.memplan.prefetch(host, device)``
    Allocates ``dev`` on ``device`` (on the current stream) and starts copying ``host`` into it on another
    side stream, after the work already queued on the current one.
``dev = torch.ops.memplan.prefetch_wait_(dev)``
    Makes the current stream wait for that copy; every reader reads its result.

Between a copy's start and its wait, the current stream runs the graph's other ops: the transfer
overlaps them. On a CPU there are no streams: the copies are made at once and the waits do nothing
(the emulated host tier, which :mod:`memplan.measure` and memplan's analyses do not count as memory
of the device).

>>> x = torch.arange(4.0)
>>> host = torch.ops.memplan.offload_wait_(torch.ops.memplan.offload(x), x)
>>> torch.ops.memplan.prefetch_wait_(torch.ops.memplan.prefetch(host, torch.device("cpu")))
tensor([0., 1., 2., 3.])

A draw made again: two operators that the ``rewrite`` pass puts around a dropout's noise (``empty_like(x)
.bernoulli_(q)``, what ``F.dropout`` runs on a CPU), so that the backward draws it again instead of keeping it
(:mod:`memplan.passes._rewrite.noise_replay`).

``state = torch.ops.memplan.rng_state(like)``
    A copy of the state of the default generator of ``like``'s device (a CPU ``uint8`` tensor). Tagged as
    drawing from the RNG, so that no pass moves it across another draw: taken right before the draw it
    belongs to, it is the state that draw started from.
``out = torch.ops.memplan.replay_bernoulli_(out, p, state)``
    ``out.bernoulli_(p)`` drawn from ``state``, the generator then put back to the state it had: the same
    bits as the draw that started from ``state``, on a tensor of the same shape and strides, and no draw
    after it moves. Not tagged as drawing: it runs the same every time.

>>> noise = torch.empty(6)
>>> state = torch.ops.memplan.rng_state(noise)
>>> first = noise.bernoulli_(0.5).clone()
>>> after = torch.rand(2)  # later draws go on from where the first left the generator
>>> again = torch.ops.memplan.replay_bernoulli_(torch.empty(6), 0.5, state)
>>> torch.equal(again, first)
True
"""

from __future__ import annotations

import math
import warnings

import torch

__all__ = ["grouped_addmm_", "grouped_addmm_blocks", "grouped_addmm_into", "offload", "offload_wait_", "prefetch", "prefetch_wait_",
           "HOST_OPS", "TIER_OPS", "rng_state", "replay_bernoulli_", "rng_state_bytes"]

_LIBRARY = torch.library.Library("memplan", "DEF")
_LIBRARY.define(
    "grouped_addmm_(Tensor(a!) out, Tensor cols, Tensor values, Tensor dense, int per_group, bool scatter, "
    "Tensor(b!) workspace) -> Tensor(a!)"
)


def _check(out: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, dense: torch.Tensor, per_group: int,
           scatter: bool, workspace: torch.Tensor) -> None:
    def fail(what: str) -> None:
        raise ValueError(f"memplan::grouped_addmm_: {what}")

    if out.dim() != 2 or dense.dim() != 2 or out.shape[1] != dense.shape[1]:
        fail(f"out {tuple(out.shape)} and dense {tuple(dense.shape)} must be matrices with the same number of columns")
    nnz = cols.numel()
    if cols.shape != (nnz,) or cols.dtype not in (torch.int32, torch.int64) or not cols.is_contiguous():
        fail(f"cols must be a contiguous 1-d int32 or int64 tensor, got {cols.dtype} {tuple(cols.shape)}")
    if values.shape != (nnz,) or values.dtype != out.dtype or dense.dtype != out.dtype or not values.is_contiguous():
        fail(f"values {values.dtype} {tuple(values.shape)} must be contiguous, ({nnz},), and share the dtype of "
             f"out ({out.dtype}) and dense ({dense.dtype})")
    groups = dense.shape[0] if scatter else out.shape[0]
    if per_group < 1 or groups * per_group != nnz:
        fail(f"{nnz} entries are not {groups} groups of {per_group}")
    if workspace.dim() != 2 or workspace.shape[0] != 2 or workspace.shape[1] < 1 or workspace.dtype != torch.int64 \
            or not workspace.is_contiguous():
        fail(f"workspace must be a contiguous int64 tensor of shape (2, block), got {workspace.dtype} "
             f"{tuple(workspace.shape)}")


_CSR_WARNED = False


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """A compressed-row view of the three tensors. PyTorch warns once per process that CSR support is in
    beta; memplan uses one operation of it (tested), so the first construction hides that warning."""
    global _CSR_WARNED
    if _CSR_WARNED:
        return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
        matrix = torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)
    _CSR_WARNED = True
    return matrix


def grouped_addmm_blocks(out: torch.Tensor, cols: torch.Tensor, scatter: bool, workspace: torch.Tensor) -> tuple[int, int]:
    """How ``grouped_addmm_`` splits its work, from the shapes alone (fake tensors too): ``(groups, blocks)``.
    ``groups`` > 0: the compressed-row path, ``groups`` rows of ``out`` a block (the workspace's int32 view
    holds their offsets); 0: the coordinate path, ``workspace.shape[1]`` entries a block. Each block is a
    few ops from Python (the time model prices them: :mod:`memplan.analysis.cost`)."""
    block = max(1, int(workspace.shape[1]))
    if not scatter and cols.dtype == torch.int32 and out.is_contiguous():
        groups = 4 * block - 1  # int64 (2, block) viewed as int32: groups + 1 offsets
        return groups, math.ceil(int(out.shape[0]) / groups)
    return 0, math.ceil(int(cols.numel()) / block)


def _grouped_addmm_(out: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, dense: torch.Tensor,
                    per_group: int, scatter: bool, workspace: torch.Tensor) -> torch.Tensor:
    _check(out, cols, values, dense, per_group, scatter, workspace)
    nnz, block = cols.numel(), workspace.shape[1]
    flat = workspace.view(-1)
    groups, _ = grouped_addmm_blocks(out, cols, scatter, workspace)
    if groups:
        # compressed rows: offsets of `groups` rows in the workspace (as int32), columns and values as
        # they are (check_invariants=False: no pass over the indices; the columns are in range by
        # construction of the graphs that call this, and the kernel reads only those)
        offsets = flat.view(torch.int32)
        for first in range(0, out.shape[0], groups):
            n = min(groups, out.shape[0] - first)
            lo, hi = first * per_group, (first + n) * per_group
            crow = offsets[: n + 1]
            torch.arange(0, n * per_group + 1, per_group, out=crow)
            matrix = _csr(crow, cols[lo:hi], values[lo:hi], (n, dense.shape[0]))
            out[first : first + n].addmm_(matrix, dense)
        return out
    for lo in range(0, nnz, block):
        n = min(block, nnz - lo)
        coords = flat[: 2 * n].view(2, n)
        group, column = (coords[1], coords[0]) if scatter else (coords[0], coords[1])
        torch.arange(lo, lo + n, out=group)
        group.floor_divide_(per_group)
        column.copy_(cols[lo : lo + n])
        # a sparse view of the workspace and the values (no copy; check_invariants=False skips a bounds
        # check that reduces over the indices, the kernel checks each coordinate as it goes)
        matrix = torch.sparse_coo_tensor(coords, values[lo : lo + n], (out.shape[0], dense.shape[0]), check_invariants=False)
        out.addmm_(matrix, dense)
    return out


def _grouped_addmm_fake(out: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, dense: torch.Tensor,
                        per_group: int, scatter: bool, workspace: torch.Tensor) -> torch.Tensor:
    _check(out, cols, values, dense, per_group, scatter, workspace)
    return out


_LIBRARY.impl("grouped_addmm_", _grouped_addmm_, "CompositeExplicitAutograd")
_LIBRARY.impl("grouped_addmm_", _grouped_addmm_fake, "Meta")

grouped_addmm_ = torch.ops.memplan.grouped_addmm_.default

# The same write with nothing returned, for graphs handed to a compiler (memplan.inductor): torch's
# functionalization turns a custom op that writes its arguments into a functional call only where the op
# returns no alias of them.
_LIBRARY.define(
    "grouped_addmm_into(Tensor(a!) out, Tensor cols, Tensor values, Tensor dense, int per_group, bool scatter, "
    "Tensor(b!) workspace) -> ()"
)


def _grouped_addmm_into(out: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, dense: torch.Tensor,
                        per_group: int, scatter: bool, workspace: torch.Tensor) -> None:
    _grouped_addmm_(out, cols, values, dense, per_group, scatter, workspace)


_LIBRARY.impl("grouped_addmm_into", _grouped_addmm_into, "CompositeExplicitAutograd")
_LIBRARY.impl("grouped_addmm_into", _check, "Meta")  # checks, and returns nothing

grouped_addmm_into = torch.ops.memplan.grouped_addmm_into.default


# ----------------------------------------------------------------------------------------------
# the host tier (see the module docstring)

_LIBRARY.define("offload(Tensor x) -> Tensor")
_LIBRARY.define("offload_wait_(Tensor(a!) host, Tensor x) -> Tensor(a!)")
_LIBRARY.define("prefetch(Tensor host, Device device) -> Tensor")
_LIBRARY.define("prefetch_wait_(Tensor(a!) x) -> Tensor(a!)")

# a copy in flight: (device, data pointer of its destination) -> the event recorded after it
_PENDING: dict[tuple[str, int], torch.cuda.Event] = {}
_SIDE_STREAMS: dict[tuple[torch.device, str], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, direction: str) -> torch.cuda.Stream:
    """One side stream per device and direction (to the host, from it): copies in one direction run
    one after another, as the copy engines do."""
    key = (device, direction)
    stream = _SIDE_STREAMS.get(key)
    if stream is None:
        stream = _SIDE_STREAMS[key] = torch.cuda.Stream(device)
    return stream


def _copy_async(dst: torch.Tensor, src: torch.Tensor, cuda: torch.device, direction: str) -> None:
    """``dst.copy_(src)`` on a side stream of ``cuda`` that first waits for the work queued on the current
    stream (which made ``src`` and last used ``dst``'s memory); the event after it waits in ``_PENDING``."""
    side = _side_stream(cuda, direction)
    side.wait_stream(torch.cuda.current_stream(cuda))
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    _PENDING[(str(dst.device), dst.data_ptr())] = event


def _wait(tensor: torch.Tensor, cuda: torch.device) -> None:
    event = _PENDING.pop((str(tensor.device), tensor.data_ptr()), None)
    if event is not None:
        torch.cuda.current_stream(cuda).wait_event(event)


def _offload(x: torch.Tensor) -> torch.Tensor:
    host = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu", pin_memory=x.is_cuda)
    if x.is_cuda:
        _copy_async(host, x, x.device, "to host")
    else:
        host.copy_(x)
    return host


def _offload_wait_(host: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        _wait(host, x.device)
    return host


def _prefetch(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    dev = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    if dev.is_cuda:
        _copy_async(dev, host, dev.device, "from host")
    else:
        dev.copy_(host)
    return dev


def _prefetch_wait_(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        _wait(x, x.device)
    return x


def _offload_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")


def _prefetch_fake(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


def _returns_first(first: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    return first


_LIBRARY.impl("offload", _offload, "CompositeExplicitAutograd")
_LIBRARY.impl("offload_wait_", _offload_wait_, "CompositeExplicitAutograd")
_LIBRARY.impl("prefetch", _prefetch, "CompositeExplicitAutograd")
_LIBRARY.impl("prefetch_wait_", _prefetch_wait_, "CompositeExplicitAutograd")
# fake kernels that run under the fake mode itself: the copies change device, which a meta kernel
# (its output on its inputs' device) cannot say
torch.library.register_fake("memplan::offload", _offload_fake, lib=_LIBRARY)
torch.library.register_fake("memplan::prefetch", _prefetch_fake, lib=_LIBRARY)
_LIBRARY.impl("offload_wait_", _returns_first, "Meta")
_LIBRARY.impl("prefetch_wait_", _returns_first, "Meta")

offload = torch.ops.memplan.offload.default
offload_wait_ = torch.ops.memplan.offload_wait_.default
prefetch = torch.ops.memplan.prefetch.default
prefetch_wait_ = torch.ops.memplan.prefetch_wait_.default

#: The operator whose result lives in host memory: analyses and the ruler do not count it on the device.
HOST_OPS = frozenset({offload})
#: Every operator of the host tier.
TIER_OPS = frozenset({offload, offload_wait_, prefetch, prefetch_wait_})


# ----------------------------------------------------------------------------------------------
# a draw made again (see the module docstring)

_LIBRARY.define("rng_state(Tensor like) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
_LIBRARY.define("replay_bernoulli_(Tensor(a!) self, float p, Tensor state) -> Tensor(a!)")


def _generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device``: the one an op called without ``generator=`` draws from."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


def _rng_state(like: torch.Tensor) -> torch.Tensor:
    return _generator(like.device).get_state()


def _replay_bernoulli_(out: torch.Tensor, p: float, state: torch.Tensor) -> torch.Tensor:
    generator = _generator(out.device)
    current = generator.get_state()
    generator.set_state(state)
    try:
        out.bernoulli_(p)
    finally:
        generator.set_state(current)
    return out


def rng_state_bytes(device: torch.device) -> int:
    """Bytes of the state of ``device``'s default generator (a fake tensor's device may have no generator
    on this machine: CUDA's state is a seed and an offset)."""
    try:
        return _generator(device).get_state().numel()
    except (RuntimeError, AssertionError, AttributeError):
        return 16


def _rng_state_fake(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(rng_state_bytes(like.device), dtype=torch.uint8, device="cpu")


_LIBRARY.impl("rng_state", _rng_state, "CompositeExplicitAutograd")
_LIBRARY.impl("replay_bernoulli_", _replay_bernoulli_, "CompositeExplicitAutograd")
torch.library.register_fake("memplan::rng_state", _rng_state_fake, lib=_LIBRARY)
_LIBRARY.impl("replay_bernoulli_", _returns_first, "Meta")

rng_state = torch.ops.memplan.rng_state.default
replay_bernoulli_ = torch.ops.memplan.replay_bernoulli_.default
