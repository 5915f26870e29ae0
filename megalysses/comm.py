"""Autograd-aware collectives. Each is a small named autograd.Function; the docstring says what the
forward and the backward do. Every function is the identity on a group of one.

Tensor-parallel region maps (Megatron's f / g operators and friends):
    copy_to_tp            fwd identity            bwd all-reduce
    reduce_from_tp        fwd all-reduce          bwd identity
    scatter_to_tp         fwd keep own chunk      bwd all-gather         (along a dim)
    gather_from_tp        fwd all-gather          bwd keep own chunk     (along a dim)
    reduce_scatter_to_tp  fwd reduce-scatter      bwd all-gather         (TP sequence sharding)
    all_gather_from_tp    fwd all-gather          bwd reduce-scatter     (TP sequence sharding)
Ulysses:
    all_to_all            fwd scatter one dim / gather another   bwd the inverse all-to-all
Pipelines (no autograd; the schedule drives the backward):
    send_recv             batched isend/irecv to pipeline neighbours
Ring attention (no autograd; ring attention's own autograd.Function drives the backward):
    ring_exchange         post sends to the next rank of a group and receives from the previous one;
                          returns at once, `.wait()` hands over what arrived (overlap with compute)
Plain collectives for the trainer (no autograd): all_reduce_, reduce_scatter_into, all_gather_into.

A group of None stands for a group of one (never the default world group; `world()` names that one).
Every tensor handed to a collective here is checked first: one on a device the group has no backend for
(a CPU tensor on an NCCL group, a meta tensor on gloo or NCCL) raises at once with a message naming the
collective, instead of NCCL's "No backend type associated with device type cpu" (or, for meta tensors on
gloo, silently nothing). The group's backend says which devices it takes (torch's BackendConfig of it: gloo
CPU and CUDA, NCCL CUDA, a backend given per device those it names).
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

Group = Optional[dist.ProcessGroup]

# torch >= 2.13 renames the tensor-form collectives; older releases only have the old names
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Group) -> int:
    """Size of `group`; None means no group (a group of one), never the default world group."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


def world() -> Group:
    """The default group when there is more than one process, else None (a group of one)."""
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


def check_device(op: str, group: Group, *tensors: Tensor) -> None:
    """Raise if a tensor cannot take part in a collective of `group`: on a device its backend has none for."""
    backend = dist.get_backend(group)
    devices = _backend_devices(backend)
    for t in tensors:
        if t.device.type not in devices:
            raise RuntimeError(f"{op}: a tensor on {t.device} was handed to a {backend} collective; every "
                               f"tensor that reaches a collective must be on the run's device (create it with "
                               f"device=...)")


def collective_device_type(device: torch.device, group: Group = None) -> str:
    """The device type `group`'s collectives (default: the world's) take for tensors on `device`: its own where the
    group's backend has one for it, else the host's (a build of shapes on a device no backend has: the dry run's)."""
    return device.type if device.type in _backend_devices(dist.get_backend(group)) else "cpu"


@functools.lru_cache(maxsize=None)
def _backend_devices(backend: str) -> frozenset[str]:
    """The device types a group of `backend` (dist.get_backend's name) has a backend for."""
    return frozenset(dist.BackendConfig(dist.Backend(backend)).get_device_backend_map())


def all_reduce_(x: Tensor, group: Group, op: str = "sum", async_op: bool = False) -> Optional[dist.Work]:
    """In-place all-reduce of x over `group` (op: sum, max, min); nothing on a group of one."""
    if group_size(group) == 1:
        return None
    check_device("all_reduce", group, x)
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    return dist.all_reduce(x, op=reduce_op, group=group, async_op=async_op)


def reduce_scatter_into(out: Tensor, x: Tensor, group: Group, async_op: bool = False) -> Optional[dist.Work]:
    """out (n,) = this rank's chunk of the sum over `group` of x (G*n,), flat and contiguous."""
    check_device("reduce_scatter", group, out, x)
    return reduce_scatter_tensor(out, x, group=group, async_op=async_op)


def all_gather_into(out: Tensor, x: Tensor, group: Group, async_op: bool = False) -> Optional[dist.Work]:
    """out (G*n,) = every rank's x (n,) concatenated in rank order."""
    check_device("all_gather", group, out, x)
    return all_gather_tensor(out, x, group=group, async_op=async_op)


# ----------------------------------------------------------------------------- raw (no autograd)

def _all_reduce(x: Tensor, group: Group) -> Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous().clone()
    all_reduce_(x, group)
    return x


def _all_gather(x: Tensor, dim: int, group: Group) -> Tensor:
    """Concatenate every rank's `x` along `dim` (rank order)."""
    world = group_size(group)
    if world == 1:
        return x
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((world * x0.shape[0],) + tuple(x0.shape[1:]))
    all_gather_into(out, x0, group)
    return out.movedim(0, dim)


def _reduce_scatter(x: Tensor, dim: int, group: Group) -> Tensor:
    """Sum over ranks, then keep this rank's chunk of `dim`."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"reduce-scatter: size {x.shape[dim]} of dim {dim} is not divisible by group size {world}")
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // world,) + tuple(x0.shape[1:]))
    reduce_scatter_into(out, x0, group)
    return out.movedim(0, dim)


def _split(x: Tensor, dim: int, group: Group) -> Tensor:
    """This rank's contiguous chunk of `dim`."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"split: size {x.shape[dim]} of dim {dim} is not divisible by group size {world}")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def _all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group: Group) -> Tensor:
    """Split `x` into P chunks along scatter_dim, send chunk i to rank i, concat received along gather_dim."""
    world = group_size(group)
    if world == 1:
        return x
    if x.shape[scatter_dim] % world:
        raise ValueError(f"all-to-all: size {x.shape[scatter_dim]} of scatter dim {scatter_dim} "
                         f"is not divisible by group size {world}")
    scatter_dim %= x.dim()
    gather_dim %= x.dim()
    # (P, ..., chunk, ...): chunk i of scatter_dim goes to rank i; contiguous for the collective
    send = torch.stack(x.chunk(world, dim=scatter_dim), dim=0).contiguous()
    recv = torch.empty_like(send)
    check_device("all_to_all", group, send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[i] came from rank i: place it as chunk i of gather_dim
    return torch.cat(recv.unbind(0), dim=gather_dim)


# ----------------------------------------------------------------------------- autograd functions

class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient over the group (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce (sum) over the group (output of a row-parallel layer). Backward: identity."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    """Forward: keep this rank's chunk of `dim`. Backward: all-gather the gradient along `dim`."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: Group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _all_gather(g, ctx.dim, ctx.group), None, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: all-gather along `dim`. Backward: keep this rank's chunk of the gradient (no reduction)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: Group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _split(g, ctx.dim, ctx.group), None, None


class _ReduceScatterToTP(torch.autograd.Function):
    """Forward: reduce-scatter along `dim` (row-parallel output into the sequence-sharded stream).
    Backward: all-gather the gradient along `dim`."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: Group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _all_gather(g, ctx.dim, ctx.group), None, None


class _AllGatherFromTP(torch.autograd.Function):
    """Forward: all-gather along `dim` (sequence-sharded stream into a column-parallel layer).
    Backward: reduce-scatter the gradient along `dim` (each rank's partial gradient is summed)."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: Group) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _reduce_scatter(g, ctx.dim, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    """Forward: split along `scatter_dim` across the group and concatenate what arrives along `gather_dim`
    (Ulysses: sequence-sharded -> head-sharded). Backward: the inverse all-to-all (gather_dim scattered,
    scatter_dim gathered). Non-contiguous inputs are fine."""

    @staticmethod
    def forward(ctx, x: Tensor, scatter_dim: int, gather_dim: int, group: Group) -> Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, g: Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(g, gather_dim, scatter_dim, ctx.group), None, None, None


def copy_to_tp(x: Tensor, group: Group) -> Tensor:
    return _CopyToTP.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp(x: Tensor, group: Group) -> Tensor:
    return _ReduceFromTP.apply(x, group) if group_size(group) > 1 else x


def scatter_to_tp(x: Tensor, group: Group, dim: int = -1) -> Tensor:
    return _ScatterToTP.apply(x, dim, group) if group_size(group) > 1 else x


def gather_from_tp(x: Tensor, group: Group, dim: int = -1) -> Tensor:
    return _GatherFromTP.apply(x, dim, group) if group_size(group) > 1 else x


def reduce_scatter_to_tp(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    return _ReduceScatterToTP.apply(x, dim, group) if group_size(group) > 1 else x


def all_gather_from_tp(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    return _AllGatherFromTP.apply(x, dim, group) if group_size(group) > 1 else x


def all_to_all(x: Tensor, group: Group, scatter_dim: int, gather_dim: int) -> Tensor:
    return _AllToAll.apply(x, scatter_dim, gather_dim, group) if group_size(group) > 1 else x


# ----------------------------------------------------------------------------- pipeline p2p

def send_recv(sends: Sequence[tuple[Tensor, int]] = (), recvs: Sequence[tuple[Tensor, int]] = (),
              group: Group = None) -> None:
    """Post every send (tensor, dst world rank) and receive (buffer, src world rank) at once, then wait.

    Batching both directions in one call avoids the deadlock of two neighbours each blocking on a send.
    """
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer, group) for buf, peer in recvs]
    if not ops:
        return
    check_device("send_recv", group, *(op.tensor for op in ops))
    for req in dist.batch_isend_irecv(ops):
        req.wait()


# ----------------------------------------------------------------------------- ring p2p

class PendingExchange:
    """Receives posted by `ring_exchange`; `wait()` blocks until every send and receive is done and returns
    the received tensors (in the order of the tensors that were sent)."""

    def __init__(self, works: list, sent: list[Tensor], received: list[Tensor]) -> None:
        self._works, self._sent, self._received = works, sent, received   # the sent buffers live until wait()

    def wait(self) -> list[Tensor]:
        for work in self._works:
            work.wait()
        return self._received


def ring_exchange(tensors: Sequence[Tensor], group: Group) -> PendingExchange:
    """Send each tensor to the next rank of `group` ((rank + 1) % size) and receive a tensor of the same
    shape and dtype from the previous one, all as one batch of isend/irecv, without waiting: compute can
    run while the blocks travel. The sent tensors must not be modified until `wait()` returns."""
    size, me = group_size(group), group_rank(group)
    if size == 1:
        raise ValueError("ring_exchange needs a group of at least two ranks")
    nxt = dist.get_global_rank(group, (me + 1) % size)
    prev = dist.get_global_rank(group, (me - 1) % size)
    sends = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in sends]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in sends]
    ops += [dist.P2POp(dist.irecv, buf, prev, group) for buf in received]
    check_device("ring_exchange", group, *sends)
    return PendingExchange(dist.batch_isend_irecv(ops), sends, received)
