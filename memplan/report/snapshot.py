"""A predicted timeline as a PyTorch memory snapshot, for PyTorch's memory visualizer.

The snapshot is the dictionary ``torch.cuda.memory._snapshot()`` returns, pickled: what
https://pytorch.org/memory_viz and ``python -m torch.cuda._memory_viz`` (``trace_plot``, ``segment_plot``,
``stats``, ``trace``, ``memory``, ``segments``) read. memplan writes it from a captured graph on any
machine, CUDA or not: nothing runs; the allocations are the predicted ones.

What is in it
-------------
- ``device_traces[d]``: one ``alloc`` per storage the call allocates (a storage and all its views and
  aliases are one allocation), then ``free_requested`` and ``free_completed`` where it dies, in the
  order of the simulated run (:class:`~memplan.analysis.peak.PeakSimulation`). Replayed, the running sum
  of allocated minus freed bytes reaches exactly the predicted peak. ``d`` is the index of the graph's
  CUDA device, 0 for a CPU graph.
- ``segments``: the memory at the end of the call. The storages that exist before it (parameters,
  buffers, inputs) are blocks of a first segment, allocated before the trace; the call's storages live
  in a second one, and those still alive at the end (outputs, gradients) are its active blocks. A
  segment is as large as its blocks need (no caching allocator is modelled), so "reserved" in
  PyTorch's tools is what first-fit placement of the predicted allocations needs.
- ``frames`` of each allocation, innermost first: the op that made it (node name, aten op and what the
  storage is: a saved activation, a temporary, a gradient, an output), torch's line beneath the user's
  (``nn/modules/linear.py``) where the op ran inside a torch layer, the user's line, and the module path
  of the layer (``module:0:encoder.layers.1.mlp``).
- ``memplan``: what the snapshot shows (``label``, ``peak``, the device planned for), a key PyTorch's
  tools ignore.

Stages
------
(1) Walk ``Liveness.order``: at each position allocate the storages born there (by storage id), then
    free those whose interval ends there, as :class:`~memplan.analysis.peak.PeakSimulation` does.
(2) Give each allocation an address: first fit in one segment, blocks aligned to 512 bytes (the CUDA
    caching allocator's smallest block), freed blocks merged with free neighbours, so addresses are
    reused and a free names the address of its alloc.
(3) Lay out the end state: the pre-existing storages back to back in the first segment, the call's
    segment tiled by its live blocks and the free gaps between them (PyTorch's tools read a block's
    address as the sum of the sizes before it).

Event sizes are the storages' exact bytes, as memplan counts them; on a CUDA device the real allocator
rounds each up, so its own snapshot of the same step shows slightly more.
"""

from __future__ import annotations

import bisect
import os
import pickle
from collections.abc import Iterable

import torch

from memplan.analysis.groups import storage_origins
from memplan.analysis.liveness import Liveness
from memplan.analysis.manager import AnalysisManager
from memplan.analysis.peak import PeakSimulation
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, SourceLine
from memplan.graphutil import graph_device

__all__ = ["ALIGN", "to_snapshot", "save_snapshot", "snapshot_paths", "replay_peak"]

#: Alignment of every block's address (the CUDA caching allocator's smallest block).
ALIGN = 512
# Where the first segment starts: an address shaped like a device pointer, so the viewer's hex labels
# read as they do in a real snapshot.
_BASE = 0x7F0000000000
# The call's segment begins on a 2 MiB boundary, as the caching allocator's large segments do.
_SEGMENT_ALIGN = 2 * 1024 * 1024


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def to_snapshot(graph: CapturedGraph, am: AnalysisManager | None = None, *, label: str = "eager") -> dict:
    """The predicted timeline of ``graph`` as a memory snapshot (see the module docstring).

    ``label`` names what the graph is (``"eager"``: the model as written; ``"plan"``: memplan's plan).

    Examples
    --------
    >>> import torch
    >>> from memplan.capture import capture
    >>> snap = to_snapshot(capture(torch.nn.Linear(256, 256), torch.randn(64, 256), train=False))
    >>> [(e["action"], e["size"]) for e in snap["device_traces"][0]]
    [('alloc', 65536)]
    >>> replay_peak(snap) == snap["memplan"]["peak"] == 65536
    True
    """
    am = am or AnalysisManager(graph)
    tensors, liveness, sim = am.get(Tensors), am.get(Liveness), am.get(PeakSimulation)
    device = graph_device(graph)
    index = (device.index or 0) if device.type == "cuda" else 0
    counted = [sid for sid, s in tensors.storages.items() if not s.external and s.nbytes > 0]
    origins = storage_origins(graph, am, tuple(counted))
    frames = {sid: _frames(graph, sid, tensors, origins[sid]) for sid in counted}

    # Step 1: the order of allocations and frees.
    born: dict[int, list[int]] = {}
    dies: dict[int, list[int]] = {}
    for sid in counted:
        interval = liveness.intervals[sid]
        born.setdefault(interval.start, []).append(sid)
        if interval.end < liveness.end:
            dies.setdefault(interval.end, []).append(sid)

    # Step 3 (first half): the storages that exist before the call, back to back in their own segment.
    before = _pre_existing(graph, tensors)
    first_size = sum(_round_up(n, ALIGN) for _, n, _ in before)
    step_base = _BASE + _round_up(max(first_size, 1), _SEGMENT_ALIGN)

    # Step 2: addresses, first fit.
    heap = _FirstFit()
    address: dict[int, int] = {}
    trace: list[dict] = []
    for position in range(len(liveness.order)):
        for sid in born.get(position, ()):
            nbytes = tensors.storages[sid].nbytes
            address[sid] = step_base + heap.allocate(_round_up(nbytes, ALIGN))
            trace.append(_entry("alloc", address[sid], nbytes, frames[sid]))
        for sid in dies.get(position, ()):
            nbytes = tensors.storages[sid].nbytes
            trace.append(_entry("free_requested", address[sid], nbytes, frames[sid]))
            trace.append(_entry("free_completed", address[sid], nbytes, frames[sid]))
            heap.free(address[sid] - step_base, _round_up(nbytes, ALIGN))

    # Step 3: the end state.
    segments = [_segment(index, _BASE, first_size, [
        (offset, nbytes, fr) for offset, nbytes, fr in _back_to_back(before)
    ])] if before else []
    alive = sorted((address[sid] - step_base, tensors.storages[sid].nbytes, frames[sid])
                   for sid in counted if liveness.intervals[sid].end >= liveness.end)
    step_size = max(heap.high_water, ALIGN)
    segments.append(_segment(index, step_base, step_size, alive))
    return {
        "segments": segments,
        "device_traces": [[] for _ in range(index)] + [trace],
        "memplan": {
            "label": label,
            "peak": sim.peak,
            "peak_node": liveness.order[sim.peak_index] if sim.peak_index >= 0 else None,
            "device": str(device),
            "training": graph.training,
            "before_call": sum(n for _, n, _ in before),
        },
    }


def save_snapshot(snapshot: dict, path: str | os.PathLike) -> str:
    """Pickle ``snapshot`` to ``path`` (what ``torch.cuda.memory._dump_snapshot`` writes); returns the path."""
    path = os.fspath(path)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    return path


def snapshot_paths(path: str | os.PathLike) -> tuple[str, str]:
    """The two files written for one ``--snapshot`` path when a plan is there too: the model as written
    and the plan, ``.eager`` and ``.plan`` put before the extension.

    Examples
    --------
    >>> snapshot_paths("out/step.pickle")
    ('out/step.eager.pickle', 'out/step.plan.pickle')
    >>> snapshot_paths("step")
    ('step.eager.pickle', 'step.plan.pickle')
    """
    root, ext = os.path.splitext(os.fspath(path))
    ext = ext or ".pickle"
    return f"{root}.eager{ext}", f"{root}.plan{ext}"


def replay_peak(snapshot: dict, device: int | None = None) -> int:
    """The most bytes allocated at once when the trace of ``snapshot`` is replayed (``alloc`` adds, a
    completed free subtracts), counting only what the trace allocates; ``device`` defaults to the last
    device with a trace. Raises ``ValueError`` when a free names an address with no allocation there."""
    traces = snapshot["device_traces"]
    if device is None:
        device = max((i for i, t in enumerate(traces) if t), default=0)
    live: dict[int, int] = {}
    total = peak = 0
    for entry in traces[device] if device < len(traces) else ():
        action, addr = entry["action"], entry["addr"]
        if action == "alloc":
            if addr in live:
                raise ValueError(f"alloc at {addr:#x}, where a block of {live[addr]} bytes is still allocated")
            live[addr] = entry["size"]
            total += entry["size"]
            peak = max(peak, total)
        elif action == "free_completed":
            if live.get(addr) != entry["size"]:
                raise ValueError(f"free of {entry['size']} bytes at {addr:#x}, which holds {live.get(addr)}")
            total -= live.pop(addr)
    return peak


# ----------------------------------------------------------------------------------------------
# frames and blocks


def _frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


def _source_frame(source: SourceLine) -> dict:
    return _frame(source.filename, source.lineno, source.function)


# A storage's kind (:data:`memplan.analysis.groups.KINDS`, plural) said of one storage.
_ONE_OF_KIND = {"saved activations": "saved activation", "parameter gradients": "parameter gradient",
                "input gradients": "input gradient", "temporaries": "temporary", "outputs": "output"}


def _frames(graph: CapturedGraph, sid: int, tensors: Tensors, origin) -> list[dict]:
    """Innermost first: the op, torch's line, the user's line, the module path (see the module docstring)."""
    creator = tensors.storages[sid].creator
    node = graph.node(creator)
    op = str(node.target) if isinstance(node.target, torch._ops.OpOverload) else getattr(node.target, "__name__", str(node.target))
    kind = _ONE_OF_KIND.get(origin.kind, origin.kind)
    frames = [_frame("memplan", 0, f"{creator} = {op} ({kind}, {graph.phases[creator].value})")]
    if origin.library_source is not None:
        frames.append(_source_frame(origin.library_source))
    if origin.source is not None:
        frames.append(_source_frame(origin.source))
    if origin.module is not None:
        frames.append(_frame("module", 0, origin.module or "(model)"))
    return frames


def _pre_existing(graph: CapturedGraph, tensors: Tensors) -> list[tuple[str, int, list[dict]]]:
    """``(name, bytes, frames)`` of each storage that exists before the call, in graph order."""
    specs = {spec.node: spec for spec in graph.inputs}
    found = []
    for sid, storage in sorted(tensors.storages.items()):
        if not storage.external or storage.nbytes == 0:
            continue
        spec = specs.get(storage.creator)
        kind, name = (spec.kind, spec.path) if spec is not None else ("constant", storage.creator)
        found.append((name, storage.nbytes, [_frame(kind, 0, name)]))
    return found


def _back_to_back(before: Iterable[tuple[str, int, list[dict]]]) -> list[tuple[int, int, list[dict]]]:
    placed, offset = [], 0
    for _, nbytes, frames in before:
        placed.append((offset, nbytes, frames))
        offset += _round_up(nbytes, ALIGN)
    return placed


def _segment(device: int, address: int, total_size: int, alive: list[tuple[int, int, list[dict]]]) -> dict:
    """A segment tiled by its active blocks (``(offset, bytes, frames)``, by offset) and the gaps between."""
    blocks = []
    offset = 0
    for start, nbytes, frames in alive:
        if start > offset:
            blocks.append({"address": address + offset, "size": start - offset, "requested_size": 0,
                           "state": "inactive", "frames": []})
        size = _round_up(nbytes, ALIGN)
        blocks.append({"address": address + start, "size": size, "requested_size": nbytes,
                       "state": "active_allocated", "frames": frames})
        offset = start + size
    if offset < total_size:
        blocks.append({"address": address + offset, "size": total_size - offset, "requested_size": 0,
                       "state": "inactive", "frames": []})
    allocated = sum(b["requested_size"] for b in blocks if b["state"] == "active_allocated")
    return {
        "device": device,
        "address": address,
        "total_size": total_size,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": allocated,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }


def _entry(action: str, addr: int, size: int, frames: list[dict]) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames}


class _FirstFit:
    """Offsets in one growing segment: the lowest free gap that fits, freed gaps merged with neighbours."""

    def __init__(self) -> None:
        self.starts: list[int] = []  # free gaps, sorted by start
        self.sizes: list[int] = []
        self.high_water = 0

    def allocate(self, size: int) -> int:
        for i, gap in enumerate(self.sizes):
            if gap >= size:
                start = self.starts[i]
                if gap == size:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += size
                    self.sizes[i] -= size
                return start
        # no gap fits: grow, taking a free gap that ends at the top
        start = self.high_water
        if self.starts and self.starts[-1] + self.sizes[-1] == self.high_water:
            start = self.starts.pop()
            self.sizes.pop()
        self.high_water = start + size
        return start

    def free(self, start: int, size: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.sizes.insert(i, size)
        if i + 1 < len(self.starts) and start + size == self.starts[i + 1]:  # merge with the next gap
            self.sizes[i] += self.sizes.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == start:  # and with the previous one
            self.sizes[i - 1] += self.sizes.pop(i)
            self.starts.pop(i)
