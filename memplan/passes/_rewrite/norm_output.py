"""Batch norm's output made again in the backward from the input its own backward keeps.

What it does
------------
In training, ``y, mean, invstd = native_batch_norm(x, w, b, running_mean, running_var, True, ...)`` updates the
running statistics in place, so no pass may run it again as it is; its backward keeps ``x`` (and ``mean``,
``invstd``). When the backward also reads ``y``, or ``relu(y)`` (the next convolution's weight gradient and
the ReLU's own backward read it: conv, batch norm, ReLU, conv), two tensors of the activation's size are held
from the forward to the backward where one would do. The rewrite makes the value again where the backward
first reads it: ``native_batch_norm(x, w, b, None, None, True, ...)``, the same kernel on the same input with
no running statistics to update, then ``relu_`` where the forward applied a ReLU, and points the backward's
readers at it. The forward's value then dies after its last forward reader.

Why the bits are the same: the kernel computes the batch statistics and the output from ``x``, ``w``, ``b``,
``momentum`` and ``eps`` alone; the running statistics are only written. The same call on the same
values gives the same statistics and output (checked for contiguous and channels-last inputs), as long as
the backward runs with the forward's number of threads (the channels-last statistics are summed per
thread): a training step's does. CPU only: CUDA runs cuDNN's batch norm, whose bits were not checked here.

Soundness conditions (each with the counterexample the finder refuses)
--------------------------------------------------------------------
* Training mode on a CPU tensor, and the backward reads ``x`` itself (batch norm's backward does): otherwise
  keeping it instead of ``y`` saves nothing.
* ``x`` keeps its values until the backward: no write into its storage after the batch norm.
  Counterexample: ``y = bn(h); h.add_(1)``.
* The value the backward reads is ``y``, or ``relu(y)``/``relu_(y)``, read as it is (no view of it is read by
  the backward), never written after, and not an output. Counterexample: ``y[0] = 0`` after the ReLU.
* The remade value has the read value's shape, strides and dtype.
* Kept only if the simulated peak does not rise.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from memplan.analysis.manager import AnalysisManager
from memplan.analysis.tensors import Tensors, last_writes
from memplan.capture import CapturedGraph, Phase
from memplan.opschema import mutated_args, without_running_statistics
from memplan.passes._chunk.graphs import fake_mode_of, refresh_aliases
from memplan.passes._rewrite.remade import Remade, undo

__all__ = ["NormOutput", "find_norm_outputs", "apply_norm_outputs"]

_NORM = torch.ops.aten.native_batch_norm.default
_RELUS = (torch.ops.aten.relu.default, torch.ops.aten.relu_.default)


@dataclasses.dataclass(frozen=True)
class NormOutput:
    """``read`` (``output``, or a ReLU of it) made again in the backward from batch norm ``norm``'s input and statistics."""

    norm: str
    output: str  # getitem 0
    mean: str  # getitem 1
    invstd: str  # getitem 2
    read: str  # what the backward reads: ``output`` or the ReLU node
    relu: bool

    def claimed(self) -> set[str]:
        return {self.norm, self.output, self.read}

    def __str__(self) -> str:
        return f"batch norm {self.norm}: its output made again in the backward from its input"


def find_norm_outputs(graph: CapturedGraph) -> list[NormOutput]:
    """The training batch norms whose output (or its ReLU) the backward reads (see the module docstring)."""
    if not graph.training:
        return []
    phases = graph.phases
    tensors: Tensors | None = None
    last_write: dict[int, int] = {}
    position: dict[torch.fx.Node, int] = {}
    found = []
    for node in graph.gm.graph.nodes:
        if node.target is not _NORM or phases.get(node.name) is not Phase.FORWARD or node.args[5] is not True:
            continue
        items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if set(items) != {0, 1, 2} or len(items) != len(node.users):
            continue
        x, output, mean, invstd = node.args[0], items[0], items[1], items[2]
        value = output.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.dim() < 2:
            continue
        if not all(_read_backward(n, phases) for n in (x, mean, invstd)):
            continue
        read = output
        users = list(output.users)
        if len(users) == 1 and users[0].target in _RELUS and phases.get(users[0].name) is Phase.FORWARD:
            read = users[0]
        if not _read_backward(read, phases):
            continue
        if tensors is None:
            tensors = AnalysisManager(graph).get(Tensors)
            position = {n: i for i, n in enumerate(graph.gm.graph.nodes)}
            last_write = last_writes(graph, tensors)
        if any(last_write.get(sid, -1) > position[node] for sid in tensors.storages_of(x.name)):
            continue  # x written after the batch norm
        storages = tensors.storages_of(read.name)
        if len(storages) != 1 or last_write.get(storages[0], -1) > position[read]:
            continue  # written after the value the backward reads
        members = [graph.node(m) for m in tensors.storages[storages[0]].members]
        if any(u.op == "output" for m in members for u in m.users):
            continue
        if any(phases.get(u.name) is Phase.BACKWARD and m is not read for m in members for u in m.users):
            continue  # the backward reads another alias (a view) of it
        if any(read in mutated_args(u) for u in read.users):
            continue
        found.append(NormOutput(node.name, output.name, mean.name, invstd.name, read.name, read is not output))
    return found


def _read_backward(node: object, phases: dict) -> bool:
    return isinstance(node, torch.fx.Node) and any(phases.get(u.name) is Phase.BACKWARD for u in node.users)


def apply_norm_outputs(graph: CapturedGraph, patterns: list[NormOutput], state: dict) -> list[Remade]:
    """Make each pattern's value again before its first backward reader and point the backward's readers
    at it (edits ``graph`` and ``state``); what each added, for :func:`~memplan.passes._rewrite.remade.undo`. A pattern whose
    remade value would not have the read value's layout is left as it was."""
    order = {n: i for i, n in enumerate(graph.gm.graph.nodes)}
    done = []
    for pattern in patterns:
        norm, read = graph.node(pattern.norm), graph.node(pattern.read)
        readers = [u for u in read.users if state["phases"].get(u.name) is Phase.BACKWARD]
        first = min(readers, key=order.__getitem__)
        remade = Remade(graph, state)
        # the same kernel on the same input, without running statistics to update: the same statistics
        # and the same output, bit for bit
        again = remade.insert(first, _NORM, without_running_statistics(norm.args))
        again = remade.insert(first, operator.getitem, (again, 0))
        if pattern.relu:
            again = remade.insert(first, torch.ops.aten.relu_.default, (again,))
        held, value = read.meta["val"], again.meta["val"]
        if (value.shape, value.stride(), value.dtype) != (held.shape, held.stride(), held.dtype):
            undo([remade])
            continue
        for reader in readers:
            remade.redirect(reader, read, again)
        refresh_aliases(graph.gm.graph, [again], fake_mode_of(graph.gm.graph))
        done.append(remade)
    return done
