"""Tensor and storage facts for every node: bytes, dtype, device, and which storage it aliases.

Two nodes alias when their fake values share one storage (views, ``detach``, in-place results).
Storage ids are numbered in graph order, so they are deterministic. A storage is *external* when a
placeholder or a constant owns it: it exists before the graph runs and is never counted as allocated.

A storage's ``nbytes`` is what its device's allocator charges for it
(:func:`memplan.analysis.allocator.allocator_for`): its exact size on the CPU, its size rounded up to the
caching allocator's 512-byte blocks on CUDA (also for the values of a graph traced for CUDA on a stand-in
device, ``CapturedGraph.target_device``). A storage in host memory (made by ``memplan::offload``,
:data:`memplan.ops.HOST_OPS`: a saved activation waiting for the backward) costs the device nothing:
``nbytes`` 0, ``host`` True. A tensor's ``nbytes`` is the bytes its view covers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.fx

from memplan.analysis.allocator import allocator_for
from memplan.analysis.manager import Analysis, AnalysisManager
from memplan.capture import CapturedGraph
from memplan.ops import HOST_OPS
from memplan.opschema import mutated_args

__all__ = ["TensorInfo", "StorageInfo", "Tensors", "tensor_values", "parameter_bytes", "last_writes"]


class TensorInfo(NamedTuple):
    """One tensor a node produces (``index`` is its position when the node returns several).

    A named tuple, not a dataclass: an unrolled loop has hundreds of thousands, made at every change of
    the graph, and a frozen dataclass costs three times as much to build.
    """

    node: str
    index: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int  # bytes this view covers (numel * element size)
    storage: int


class StorageInfo(NamedTuple):
    """One storage: its size (as its device's allocator charges it), who created it, and every node that
    aliases it (graph order).

    A named tuple, as :class:`TensorInfo`: one per storage, made at every change of the graph.
    """

    id: int
    nbytes: int
    creator: str
    external: bool
    members: tuple[str, ...]
    host: bool = False  # in host memory (``memplan::offload``): charged nothing on the device


def tensor_values(node: torch.fx.Node) -> list[tuple[int | None, torch.Tensor]]:
    """The tensors in a node's fake value, with their index (None for a single tensor)."""
    return _tensors_in(node.meta.get("val"))


def _tensors_in(value: Any) -> list[tuple[int | None, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(None, value)]
    if isinstance(value, (tuple, list)):
        return [(i, v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


_FACTS = "memplan_tensor_facts"  # node.meta key: (value, its facts), see Tensors.compute


def _facts(value: Any) -> tuple:
    """``(index, shape, dtype, device, bytes of the view, storage key, storage bytes)`` of each tensor
    of a node's value (``index`` None for a single tensor)."""
    facts = []
    for index, tensor in _tensors_in(value):
        storage = tensor.untyped_storage()
        facts.append((index, tuple(tensor.shape), tensor.dtype, tensor.device, tensor.nbytes, storage._cdata,
                      int(storage.nbytes())))
    return tuple(facts)


@dataclasses.dataclass(frozen=True)
class Tensors(Analysis):
    """Per-node tensor facts and per-storage alias groups."""

    name = "tensors"
    tensors: Mapping[str, tuple[TensorInfo, ...]]
    storages: Mapping[int, StorageInfo]

    @classmethod
    def compute(cls, graph: CapturedGraph, am: AnalysisManager) -> "Tensors":
        # One pass over every fake tensor of the graph (hundreds of thousands on an unrolled loop), so
        # the loop reads each fact once and keeps to local names.
        ids: dict[int, int] = {}  # storage address -> id (fake values keep every storage alive)
        sizes: dict[int, int] = {}
        creators: dict[int, str] = {}
        external: dict[int, bool] = {}
        members: dict[int, list[str]] = {}
        devices: dict[int, torch.device] = {}
        tensors: dict[str, tuple[TensorInfo, ...]] = {}
        host: set[int] = set()
        for node in graph.gm.graph.nodes:
            meta = node.meta
            value = meta.get("val")
            if value is None:
                continue
            # What the fake values say, read once per value: node copies share their meta's values,
            # so the facts of a value carry over to every later graph that keeps it.
            cached = meta.get(_FACTS)
            if cached is None or cached[0] is not value:
                cached = meta[_FACTS] = (value, _facts(value))
            facts = cached[1]
            if not facts:
                continue
            name = node.name
            infos = []
            for index, shape, dtype, device, view_bytes, key, nbytes in facts:
                sid = ids.get(key)
                if sid is None:
                    sid = ids[key] = len(ids)
                    creators[sid] = name
                    external[sid] = node.op in ("placeholder", "get_attr")
                    sizes[sid] = nbytes
                    devices[sid] = device
                    members[sid] = [name]
                    if node.target in HOST_OPS:
                        host.add(sid)
                else:
                    # a resize inside the graph can only grow what must be held
                    if nbytes > sizes[sid]:
                        sizes[sid] = nbytes
                    named = members[sid]
                    if named[-1] != name:
                        named.append(name)
                infos.append(TensorInfo(name, index, shape, dtype, device, view_bytes, sid))
            tensors[name] = tuple(infos)
        # What each storage's allocator charges for it: exact bytes, unless its device rounds (CUDA).
        rounding = {device: allocator_for(device, graph.target_device) for device in set(devices.values())}
        rounding = {device: allocator.charge for device, allocator in rounding.items() if not allocator.exact}
        if rounding:
            for sid, device in devices.items():
                if device in rounding:
                    sizes[sid] = rounding[device](sizes[sid])
        for sid in host:
            sizes[sid] = 0
        storages = {
            sid: StorageInfo(sid, sizes[sid], creators[sid], external[sid], tuple(members[sid]), sid in host)
            for sid in sizes
        }
        return cls(tensors=tensors, storages=storages)

    def storages_of(self, name: str) -> tuple[int, ...]:
        """Storage ids a node's value aliases (several for a multi-output node)."""
        # Asked hundreds of thousands of times per plan: the common single tensor without a generator.
        infos = self.tensors.get(name)
        if not infos:
            return ()
        if len(infos) == 1:
            return (infos[0].storage,)
        return tuple([info.storage for info in infos])

    def info(self, name: str) -> TensorInfo | None:
        """The first (usually only) tensor of a node."""
        infos = self.tensors.get(name)
        return infos[0] if infos else None


def parameter_bytes(graph: CapturedGraph) -> int:
    """Bytes of the parameters and buffers the graph reads (they exist before a step)."""
    tensors = AnalysisManager(graph).get(Tensors)
    seen: set[int] = set()
    total = 0
    for spec in graph.inputs:
        if spec.kind in ("parameter", "buffer"):
            for sid in tensors.storages_of(spec.node):
                if sid not in seen:
                    seen.add(sid)
                    total += tensors.storages[sid].nbytes
    return total


def last_writes(graph: CapturedGraph, tensors: Any) -> dict[int, int]:
    """Storage id -> graph position of the last node that writes into it in place (``tensors``: a
    :class:`Tensors`, or anything with its ``storages_of``)."""
    last: dict[int, int] = {}
    for i, node in enumerate(graph.gm.graph.nodes):
        if node.op == "call_function":
            for target in mutated_args(node):
                for sid in tensors.storages_of(target.name):
                    last[sid] = i
    return last
