"""The device's allocator: how many bytes an allocation of ``n`` bytes costs where the graph runs.

Every analysis that counts allocated bytes (:class:`~memplan.analysis.tensors.Tensors` for the storages of
a graph, :class:`~memplan.analysis.memory_model.MemoryModel` for the sizes a what-if invents,
:func:`~memplan.analysis.peak.step_margin` for a step's loss scalars) asks :func:`allocator_for` with the
storage's device, and charges what :meth:`AllocatorModel.charge` says. This module is the one place that
knows a device's rounding.

CPU (and meta): exact bytes
---------------------------
The ruler (:func:`memplan.measure.measure`) counts ``nbytes()`` of each storage a dispatched op allocates, so
a CPU prediction is the exact sum of storage sizes: ``charge(n) == n``. Nothing here changes a CPU figure.

CUDA: PyTorch's caching allocator, as ``torch.cuda.memory_allocated()`` counts it
--------------------------------------------------------------------------------
What is modelled:

* Block rounding. The caching allocator (``c10/cuda/CUDACachingAllocator.cpp``, ``round_size``) serves every
  request with a block whose size is the request rounded up to a multiple of 512 bytes
  (``kMinBlockSize``), at least 512; ``memory_allocated()`` and ``max_memory_allocated()`` count blocks, so
  a 4-byte scalar costs 512 bytes and a 1000-byte tensor 1024. An empty tensor (0 bytes) allocates nothing.
  The same in every PyTorch 2.x release.
* The cuBLAS workspace (:meth:`CudaCachingAllocator.workspace`). cuBLAS gets a workspace per (handle,
  stream) from the caching allocator at its first call on a stream, and keeps it: a step that runs a
  matrix product on a fresh process allocates it, and it stays allocated after. cuBLAS handles are per CPU
  thread, and autograd runs a CUDA backward on a thread of its own: a training step whose forward and
  backward both multiply matrices holds two workspaces (the main thread's and the backward's), an
  inference call one. Its size is
  ``CUBLAS_WORKSPACE_CONFIG`` when set (``:SIZE_KiB:COUNT`` pairs, summed), else PyTorch's default:
  ``:4096:2:16:8`` (8 MiB + 128 KiB) on most GPUs, 4096 KiB x 8 = 32 MiB on Hopper (and, in the newest
  releases, Blackwell) GPUs (``aten/src/ATen/cuda/CublasHandlePool.cpp``). In recent releases cuBLASLt's
  workspace is carved out of the cuBLAS one unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``, so it adds
  nothing. The GPU is not known on a machine without one, so the workspace assumed is the larger default,
  32 MiB, unless ``CUBLAS_WORKSPACE_CONFIG`` says otherwise. It is not part of a step's predicted peak
  (once allocated by an earlier step it is not allocated again); :mod:`memplan.fit` adds it to what a
  GPU must hold.

What is not modelled (each makes the real figure higher than predicted, never lower):

* Large blocks served whole. A request of more than 1 MiB taken from a cached free block is split off only
  when more than 1 MiB would remain (``should_split``); otherwise the whole block is handed out and counted,
  up to 1 MiB more than the rounded request. Which cached block serves a request depends on the history of
  the process, so no static plan can know it.
* Segments and fragmentation. The allocator reserves memory from the driver in segments (2 MiB for
  requests of at most 1 MiB, 20 MiB for requests under 10 MiB, larger requests rounded up to 2 MiB) and
  cannot hand out a block that spans two segments: ``memory_reserved()`` can exceed the allocated peak by
  the fragmentation of the process's history, and an allocation can fail with free memory split across
  segments. ``PYTORCH_CUDA_ALLOC_CONF`` (``expandable_segments``, ``roundup_power2_divisions``,
  ``max_split_size_mb``) changes both; the model follows the defaults.
* Memory outside the allocator: the CUDA context (several hundred MiB per process, per device), cuDNN's
  and cuFFT's workspaces (sized by the algorithm cuDNN picks on the GPU), NCCL buffers, and kernels'
  own temporaries (e.g. the sort inside ``embedding_dense_backward``).

Examples
--------
>>> allocator_for("cpu").charge(1000)
1000
>>> cuda = allocator_for("cuda")
>>> cuda.charge(4), cuda.charge(1000), cuda.charge(1024), cuda.charge(0)
(512, 1024, 1024, 0)
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable

import numpy as np
import torch

__all__ = ["AllocatorModel", "CudaCachingAllocator", "EXACT", "CUDA_CACHING", "allocator_for",
           "cublas_workspace_bytes", "uses_cublas"]


@dataclasses.dataclass(frozen=True)
class AllocatorModel:
    """How a device's allocator charges an allocation: requests rounded up to a multiple of ``block`` bytes.

    ``block == 1`` charges exact bytes (the CPU ruler's count).
    """

    name: str
    block: int = 1

    @property
    def exact(self) -> bool:
        return self.block == 1

    def charge(self, nbytes: int) -> int:
        """Bytes the allocator counts for a request of ``nbytes`` (0 for 0)."""
        if self.block == 1 or nbytes <= 0:
            return nbytes
        return -(-nbytes // self.block) * self.block

    def charge_array(self, nbytes: np.ndarray) -> np.ndarray:
        """:meth:`charge` of each entry of an int64 array (the array itself when exact)."""
        if self.block == 1:
            return nbytes
        return np.where(nbytes > 0, -(-nbytes // self.block) * self.block, nbytes)

    def workspace(self, *threads: Iterable[str]) -> int:
        """Bytes of library workspaces the device keeps allocated once a step has run, on each CPU thread,
        the aten operators named in ``threads`` (one iterable per thread: the forward's, the backward's);
        none on the CPU."""
        return 0

    def describe(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class CudaCachingAllocator(AllocatorModel):
    """PyTorch's CUDA caching allocator (see the module docstring for what is and is not modelled)."""

    name: str = "CUDA caching allocator (blocks of 512 bytes)"
    block: int = 512

    def workspace(self, *threads: Iterable[str]) -> int:
        """One cuBLAS workspace (:func:`cublas_workspace_bytes`) per thread whose operators call cuBLAS.

        Examples
        --------
        >>> CUDA_CACHING.workspace(["mm", "relu"], ["mm"]) == 2 * cublas_workspace_bytes()
        True
        >>> CUDA_CACHING.workspace(["relu"])
        0
        """
        return cublas_workspace_bytes() * sum(1 for ops in threads if uses_cublas(ops))


#: Exact bytes: CPU and meta tensors.
EXACT = AllocatorModel("exact bytes")
#: The CUDA caching allocator's rounding.
CUDA_CACHING = CudaCachingAllocator()


def allocator_for(device: torch.device | str | None, target: torch.device | None = None) -> AllocatorModel:
    """The allocator model of ``device``: :data:`CUDA_CACHING` for CUDA devices, :data:`EXACT` otherwise.

    ``target``: the device a graph traced on a stand-in runs on (``CapturedGraph.target_device``): its
    values on the stand-in (``meta``) are charged as ``target`` charges them.
    """
    if device is None:
        return EXACT
    device = torch.device(device)
    if target is not None and device.type == "meta":
        device = target
    return CUDA_CACHING if device.type == "cuda" else EXACT


# aten operators that call cuBLAS on CUDA (matrix products; the fused attention kernels and cuDNN's
# convolutions do not)
_CUBLAS_OPS = frozenset({
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "mv", "dot", "vdot", "addr", "matmul", "linear",
    "_addmm_activation", "_scaled_mm", "_int_mm", "einsum", "tensordot", "chain_matmul", "linalg_multi_dot",
})


def uses_cublas(ops: Iterable[str]) -> bool:
    """Whether any of the aten operator names ``ops`` (``"mm"``, ``"addmm"``...) calls cuBLAS on CUDA."""
    return any(op in _CUBLAS_OPS for op in ops)


#: PyTorch's default ``CUBLAS_WORKSPACE_CONFIG`` on Hopper and Blackwell (4096 KiB x 8), the larger of its
#: two defaults; on earlier GPUs it is ``:4096:2:16:8``, 8 MiB + 128 KiB.
CUBLAS_DEFAULT_WORKSPACE = 4096 * 1024 * 8
CUBLAS_PRE_HOPPER_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8


def cublas_workspace_bytes(config: str | None = None) -> int:
    """Bytes of one cuBLAS workspace: ``config`` (default: the environment's ``CUBLAS_WORKSPACE_CONFIG``)
    read as PyTorch reads it (the sum of SIZE KiB x COUNT over its ``:SIZE:COUNT`` pairs), else
    :data:`CUBLAS_DEFAULT_WORKSPACE`.

    Examples
    --------
    >>> cublas_workspace_bytes(":4096:8")
    33554432
    >>> cublas_workspace_bytes(":4096:2:16:8")
    8519680
    """
    if config is None:
        config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return CUBLAS_DEFAULT_WORKSPACE
