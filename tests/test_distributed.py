"""memplan under DistributedDataParallel and FSDP2: two processes on this machine (gloo), gradients as one
process's.

What DDP must keep: the averaged gradients of every parameter, ``no_sync()`` accumulation, ``static_graph``.
FSDP2: ``fully_shard`` over planned blocks and the root, each block planned once though FSDP swaps its
parameters in and out around every call; a plan that recomputes in the backward makes no extra all-gather
or reduce-scatter. ``memplan.distributed.check_plans``: silent when the ranks' plans agree, a
``PlanMismatchError`` on every rank when they do not.
Overlap under DDP: a plan's backward runs in stages where torch.distributed is initialized (see
``memplan.emit.run_training``), so each bucket's all-reduce starts while the backward goes on, as under eager.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memplan

pytestmark = pytest.mark.skipif(not dist.is_available() or sys.platform == "win32",
                                reason="needs torch.distributed with gloo")

WORLD = 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 48)
        self.b = nn.Linear(48, 48)
        self.c = nn.Linear(48, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        for _ in range(3):  # a loop the planner may checkpoint
            h = torch.tanh(self.b(h)) + h
        return self.c(h).logsumexp(-1)


def _batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(WORLD * 6, 10, generator=generator) for _ in range(steps)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _group(rank: int, port: int, out: dict):
    """This process as ``rank`` of a gloo group of :data:`WORLD` on this machine; ``out[("done", rank)]`` is
    set once the body and a barrier after it have run, before the group is torn down."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        yield
        dist.barrier()
        out[("done", rank)] = True
    finally:
        dist.destroy_process_group()


def _spawn(worker, *args) -> dict:
    """What each of :data:`WORLD` processes running ``worker(rank, port, *args, out)`` put in ``out``.

    A process that aborts after every rank finished its work and the barrier after it (gloo's teardown
    under FSDP2 on a loaded machine, about one run in ten: "terminate called without an active exception")
    does not fail the test: everything the test checks was made before. An abort before that does."""
    with mp.Manager() as manager:
        out = manager.dict()
        try:
            mp.spawn(worker, args=(_free_port(), *args, out), nprocs=WORLD, join=True)
        except mp.ProcessExitedException:
            if not all(out.get(("done", rank)) for rank in range(WORLD)):
                raise
        return {k: v for k, v in out.items() if not (isinstance(k, tuple) and k[0] == "done")}


class _Log(TorchDispatchMode):
    """Every op dispatched while it is on, in order, beside the marks of DDP's bucket hook."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.events.append(func)
        return func(*args, **(kwargs or {}))


def _logged_buckets(ddp, events: list) -> None:
    """Mark in ``events`` each bucket DDP's reducer finds ready, then all-reduce it as DDP does."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        events.append("bucket")
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, hook)


MODES = ("plain", "static", "no_sync")


def _worker(rank: int, port: int, state: dict, out: dict) -> None:
    with _group(rank, port, out):  # one group for the three modes: each spawn costs seconds
        for mode in MODES:
            _ddp_mode(rank, state, mode, out)


def _ddp_mode(rank: int, state: dict, mode: str, out: dict) -> None:
    model = Net()
    model.load_state_dict(state)
    # buckets of a few KiB: one per layer, each all-reduced once its gradients are ready
    ddp = nn.parallel.DistributedDataParallel(memplan.optimize(model), static_graph=(mode == "static"),
                                              bucket_cap_mb=0.004)
    events: list = []
    _logged_buckets(ddp, events)
    batches = _batches(_steps(mode))
    if mode == "no_sync":  # two micro-batches, the all-reduce on the second
        with ddp.no_sync():
            ddp(batches[0][rank::WORLD]).sum().backward()
        ddp(batches[1][rank::WORLD]).sum().backward()
    else:
        for batch in batches:  # three steps, gradients accumulating in .grad
            loss = ddp(batch[rank::WORLD]).sum()
            events.clear()
            with _Log(events):
                loss.backward()
    out[f"{mode}{rank}"] = {name: p.grad.clone() for name, p in model.named_parameters()}
    out[f"{mode}planned{rank}"] = ddp.module.plan is not None
    # the last backward: where each bucket's all-reduce started among the backward's ops
    out[f"{mode}events{rank}"] = [e if isinstance(e, str) else str(e) for e in events]
    if mode == "plain":  # the step's peak, DDP alone and over a plan, at a batch whose activations count
        wide = torch.randn(512, 10, generator=torch.Generator().manual_seed(rank))
        for variant, module in (("ddp", model), ("memplan", memplan.optimize(model))):
            wrapped = nn.parallel.DistributedDataParallel(module)

            def step():
                model.zero_grad(set_to_none=True)
                wrapped(wide).sum().backward()

            step()
            out[f"peak_{variant}{rank}"] = memplan.measure(step).peak


def _steps(mode: str) -> int:
    # DDP rebuilds its buckets after the first step, under static_graph after the second: the third
    # backward runs with the buckets of the rest of training
    return 2 if mode == "no_sync" else 3


def _expected(state: dict, mode: str) -> dict:
    # one process over every rank's data: DDP averages the ranks' gradients, each from half the batch
    reference = Net()
    reference.load_state_dict(state)
    for batch in _batches(_steps(mode)):
        (reference(batch).sum() / WORLD).backward()
    return {name: p.grad for name, p in reference.named_parameters()}


def test_ddp_over_a_plan_gives_one_processs_gradients_and_overlaps_its_backward():
    torch.manual_seed(0)
    state = copy.deepcopy(Net().state_dict())
    found = _spawn(_worker, state)
    for mode in MODES:
        expected = _expected(state, mode)
        assert found[f"{mode}planned0"] and found[f"{mode}planned1"]
        for rank in range(WORLD):
            for name, grad in expected.items():
                torch.testing.assert_close(found[f"{mode}{rank}"][name], grad,
                                           msg=lambda m, name=name: f"{mode} rank {rank} {name}: {m}")
            if mode == "no_sync":
                continue
            events = found[f"{mode}events{rank}"]
            buckets = [i for i, e in enumerate(events) if e == "bucket"]
            assert len(buckets) >= 2, str([(i, e) for i, e in enumerate(events) if e == "bucket" or "mm" in e])
            # Communication overlaps the backward: the plan's backward goes on computing gradients (matrix
            # products) after the first bucket's all-reduce started, as eager's does; with one autograd node
            # for the whole backward, every bucket was ready only after its last op.
            products = [i for i, e in enumerate(events) if e.startswith("aten.mm")]
            assert buckets[0] < products[-1], (mode, events)
    for rank in range(WORLD):
        assert found[f"peak_memplan{rank}"] < found[f"peak_ddp{rank}"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.l(x)) * x + x


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).logsumexp(-1)


def _fsdp_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(WORLD * 4, 16, generator=generator) for _ in range(2)]


def _fsdp_worker(rank: int, port: int, state: dict, out: dict) -> None:
    from torch.distributed.fsdp import fully_shard

    with _group(rank, port, out):
        model = Blocks()
        model.load_state_dict(state)
        # the order users follow: plan each block's activations, then shard each block and the root
        for i, block in enumerate(model.blocks):
            model.blocks[i] = memplan.optimize(block)
            fully_shard(model.blocks[i])
        fully_shard(model)
        for batch in _fsdp_batches():
            model(batch[rank::WORLD]).sum().backward()
        out[rank] = {name.replace(".model.", "."): p.grad.full_tensor().clone() for name, p in model.named_parameters()}
        out[f"plans{rank}"] = [len(block._plans) for block in model.blocks]


class GatedBlock(nn.Module):
    """A block whose activations outweigh its weights at a few hundred rows: remat recomputes its gates."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x):
        h = self.l(x)
        for _ in range(4):
            h = torch.tanh(h) * torch.sigmoid(h) + h
        return h * x


class GatedBlocks(Blocks):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([GatedBlock() for _ in range(3)])


def _wide_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(WORLD * 256, 16, generator=generator) for _ in range(2)]


class _Counted:
    """Counts the calls of torch.distributed's all-gather and reduce-scatter functions (FSDP2's collectives,
    under whichever name this torch calls them)."""

    NAMES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.saved = {}

    def __enter__(self):
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self.saved[name] = original

            def counted(*args, _original=original, _name=name, **kwargs):
                kind = "all_gather" if "gather" in _name else "reduce_scatter"
                self.calls[kind] = self.calls.get(kind, 0) + 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


def _collectives_worker(rank: int, port: int, state: dict, out: dict) -> None:
    from torch.distributed.fsdp import fully_shard

    with _group(rank, port, out):
        for planned in (False, True):
            model = GatedBlocks()
            model.load_state_dict(state)
            for i, block in enumerate(model.blocks):
                if planned:  # recompute what it can: the backward runs the blocks' forward ops again
                    model.blocks[i] = memplan.optimize(block, passes="remat", max_overhead=10.0)
                fully_shard(model.blocks[i])
            fully_shard(model)
            batches = _wide_batches()
            model(batches[0][rank::WORLD]).sum().backward()  # the first step plans
            with _Counted() as counted:
                model(batches[1][rank::WORLD]).sum().backward()
            out[f"{planned}{rank}"] = counted.calls
            if planned:
                out[f"recomputed{rank}"] = [b.plan.records[0].changed for b in model.blocks]
                memplan.distributed.check_plans(model)  # the ranks agree: silent
                out[f"digests{rank}"] = memplan.distributed.plan_digests(model)


def test_recomputing_plans_under_fully_shard_add_no_collective():
    torch.manual_seed(0)
    found = _spawn(_collectives_worker, copy.deepcopy(GatedBlocks().state_dict()))
    for rank in range(WORLD):
        assert found[f"recomputed{rank}"] == [True, True, True]
        assert found[f"False{rank}"]["all_gather"] > 0 and found[f"False{rank}"]["reduce_scatter"] > 0
        assert found[f"True{rank}"] == found[f"False{rank}"]
    assert sorted(found["digests0"]) == ["blocks.0", "blocks.1", "blocks.2"]
    assert found["digests0"] == found["digests1"]


def _mismatch_worker(rank: int, port: int, out: dict) -> None:
    with _group(rank, port, out):
        torch.manual_seed(0)
        model = GatedBlocks()
        for i, block in enumerate(model.blocks):  # rank 1 plans the middle block with other passes
            model.blocks[i] = memplan.optimize(block, passes="" if rank and i == 1 else "remat")
        model(_wide_batches()[0][rank::WORLD]).sum().backward()
        try:
            memplan.distributed.check_plans(model)
        except memplan.distributed.PlanMismatchError as exc:
            out[rank] = str(exc)


def test_check_plans_fails_on_every_rank_when_the_ranks_plan_differently():
    found = _spawn(_mismatch_worker)
    assert found[0] == found[1]
    assert found[0].startswith("memplan's plans differ between ranks: blocks.1: rank 0 and rank 1 made different plans")
    assert "Fix: give every rank the same memplan.optimize arguments" in found[0]


def test_fully_shard_over_planned_blocks_gives_one_processs_gradients():
    torch.manual_seed(0)
    reference = Blocks()
    state = copy.deepcopy(reference.state_dict())
    found = _spawn(_fsdp_worker, state)
    for batch in _fsdp_batches():
        (reference(batch).sum() / WORLD).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    for rank in range(WORLD):
        assert found[f"plans{rank}"] == [1, 1, 1]  # each block planned once, its plan kept across steps
        assert set(found[rank]) == set(expected)
        for name, grad in expected.items():
            torch.testing.assert_close(found[rank][name], grad, msg=lambda m, name=name: f"rank {rank} {name}: {m}")


def _peaks_worker(rank: int, port: int, state: dict, out: dict) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    wrap = {"fsdp": lambda b: b, "checkpoint": checkpoint_wrapper, "memplan": memplan.optimize,
            "memplan_budget": lambda b: memplan.optimize(b, budget=0.5)}
    with _group(rank, port, out):
        for variant, wrapper in wrap.items():
            model = GatedBlocks()
            model.load_state_dict(state)
            for i, block in enumerate(model.blocks):
                model.blocks[i] = wrapper(block)
                fully_shard(model.blocks[i])
            fully_shard(model)
            batch = _wide_batches()[0][rank::WORLD]

            def step():
                for p in model.parameters():
                    p.grad = None
                model(batch).sum().backward()

            step()  # plans
            out[f"{variant}{rank}"] = memplan.measure(step).peak


def test_the_peak_per_rank_is_at_most_per_block_checkpointings_and_below_it_under_a_budget():
    torch.manual_seed(0)
    found = _spawn(_peaks_worker, copy.deepcopy(GatedBlocks().state_dict()))
    for rank in range(WORLD):
        assert found[f"checkpoint{rank}"] < found[f"fsdp{rank}"]
        assert found[f"memplan{rank}"] <= found[f"checkpoint{rank}"]
        assert found[f"memplan_budget{rank}"] < found[f"checkpoint{rank}"]
