"""The five workloads of the user reports, written as ordinary PyTorch models.

Each workload reproduces one report in ``shared/seeds`` and comes in two sizes: ``"small"`` (a CPU training step
in well under a second, tens of MB) and ``"full"`` (the report's sizes, which run out of memory on the GPUs the
reports used). All of them can be captured with ``make_fx(..., tracing_mode="fake")``: control flow depends only on
shapes.

========================  ======  =================================================================
name                      report  what exhausts memory
========================  ======  =================================================================
``"chain_product"``       000     log-space tree product of many ``c x c`` blocks per batch element
``"broadcast_matmul"``    001     ``@`` broadcasts a small weight over the batch and saves the copy
``"maxsim"``              002     ``einsum`` materialises a 4-d similarity before a ``max``
``"latent_gru"``          003     a Python-unrolled recurrent cell keeps every step for backward
``"seq2seq"``             004     unrolled encoder/decoder plus a vocabulary-sized generator
========================  ======  =================================================================

Examples
--------
>>> from memplan.examples import make
>>> workload = make("maxsim")
>>> [tuple(x.shape) for x in workload.inputs]
[(16, 64, 32), (20, 60, 32)]
>>> workload.model(*workload.inputs).shape
torch.Size([16, 20])
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memplan.examples import broadcast_matmul, chain_product, latent_gru, maxsim, seq2seq
from memplan.examples._workload import SIZES, Workload, check_size

__all__ = ["SIZES", "WORKLOADS", "Workload", "make"]

#: Builders by name, in the order of the user reports. Each takes ``(size, device, dtype, seed)``.
WORKLOADS: dict[str, Callable[..., Workload]] = {
    "chain_product": chain_product.make,
    "broadcast_matmul": broadcast_matmul.make,
    "maxsim": maxsim.make,
    "latent_gru": latent_gru.make,
    "seq2seq": seq2seq.make,
}


def make(
    name: str,
    *,
    size: str = "small",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Workload:
    """Build the workload ``name``.

    Parameters
    ----------
    name : str
        One of the keys of :data:`WORKLOADS`.
    size : {"small", "full"}
        ``"small"`` for tests and CPU benchmarks, ``"full"`` for the sizes of the user report.
    device : torch.device or str
        Where the model and inputs live. ``"meta"`` builds them without allocating memory.
    dtype : torch.dtype
        Floating dtype of the parameters and floating inputs (token ids stay int64).
    seed : int
        Seed of torch's RNG, set before anything is built.

    Returns
    -------
    Workload

    Raises
    ------
    ValueError
        If ``name`` or ``size`` is unknown; the message lists the valid choices.

    Examples
    --------
    >>> make("resnet")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    ValueError: unknown workload 'resnet'; valid names are: 'chain_product', 'broadcast_matmul', 'maxsim', ...
    """
    if name not in WORKLOADS:
        valid = ", ".join(repr(n) for n in WORKLOADS)
        raise ValueError(f"unknown workload {name!r}; valid names are: {valid}")
    check_size(size)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    return WORKLOADS[name](size=size, device=device, dtype=dtype, seed=seed)
