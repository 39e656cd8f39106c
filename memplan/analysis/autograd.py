"""What autograd's backward needs from the forward: the saved-for-backward set.

In a captured training graph the backward is traced through autograd itself, so a storage created by
a forward node and read by a backward node is exactly a tensor autograd saved. For each one we record
the backward nodes that read it and the forward op whose derivative needs it (the forward node with
the reader's autograd sequence number).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from memplan.analysis.manager import Analysis, AnalysisManager
from memplan.analysis.tensors import Tensors
from memplan.capture import CapturedGraph, Phase
from memplan.graphutil import packet_name

__all__ = ["SavedTensor", "SavedForBackward"]

_METADATA_ONLY_OPS = {"ones_like", "zeros_like", "empty_like", "full_like", "new_ones", "new_zeros", "new_empty"}
_ALIAS_OPS = {"detach", "view", "t", "expand", "alias", "_unsafe_view", "reshape", "transpose", "permute"}


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """A forward storage the backward reads."""

    storage: int
    nbytes: int
    node: str  # the forward node that created it
    readers: tuple[str, ...]  # backward nodes that read it, graph order
    needed_by: str | None  # the forward op whose backward needs it


@dataclasses.dataclass(frozen=True)
class SavedForBackward(Analysis):
    """Storages kept from forward to backward, keyed by storage id."""

    name = "saved_for_backward"
    saved: Mapping[int, SavedTensor]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.saved.values())

    @classmethod
    def compute(cls, graph: CapturedGraph, am: AnalysisManager) -> "SavedForBackward":
        if not graph.training:
            return cls(saved={})
        tensors = am.get(Tensors)
        # The forward op behind each sequence number: its first compute node, else its first alias node.
        forward_by_seq: dict[int, str] = {}
        alias_by_seq: dict[int, str] = {}
        for node in graph.gm.graph.nodes:
            if graph.phases.get(node.name) is not Phase.FORWARD or node.name not in graph.seq_nr:
                continue
            seq = graph.seq_nr[node.name]
            if packet_name(node) in _ALIAS_OPS:
                alias_by_seq.setdefault(seq, node.name)
            else:
                forward_by_seq.setdefault(seq, node.name)
        for seq, name in alias_by_seq.items():
            forward_by_seq.setdefault(seq, name)
        by_name = {n.name: n for n in graph.gm.graph.nodes}
        order = {n.name: i for i, n in enumerate(graph.gm.graph.nodes)}
        saved: dict[int, SavedTensor] = {}
        for sid, storage in tensors.storages.items():
            if storage.external or graph.phases.get(storage.creator) is not Phase.FORWARD:
                continue
            readers: list[str] = []
            for member in storage.members:
                for user in by_name[member].users:
                    if packet_name(user) in _METADATA_ONLY_OPS:
                        continue  # reads the shape, not the values
                    if graph.phases.get(user.name) is Phase.BACKWARD and user.name not in readers:
                        readers.append(user.name)
            if not readers:
                continue
            readers.sort(key=order.__getitem__)
            needed_by = None
            for reader in readers:
                seq = graph.seq_nr.get(reader)
                if seq in forward_by_seq:
                    needed_by = forward_by_seq[seq]
                    break
            saved[sid] = SavedTensor(sid, storage.nbytes, storage.creator, tuple(readers), needed_by)
        return cls(saved=saved)
