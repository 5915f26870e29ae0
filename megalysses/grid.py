"""The 4-D process grid: rank <-> (pp, dp, sp, tp) coordinates and every process group by purpose.

Ranks are laid out as `arange(world).view(pp, dp, sp, tp)`: tp varies fastest (keep it inside a
node), then sp, then dp, then pp. sp itself is ring x ulysses, `view(pp, dp, ring, ulysses, tp)`:
Ulysses (an all-to-all per layer) varies fastest, so it stays inside a node next to tp, and the ring
(neighbour p2p, overlapped with compute) spans the larger distances. `GridLayout` is the pure arithmetic
(no process group needed); `ParallelGrid` adds the torch.distributed groups and the device mesh and is
passed explicitly to whoever needs them.

Groups by purpose:
    tp       tensor-parallel shards of weights
    sp       every sequence shard of a sample (ulysses x ring): the loader's sequence split
    ulysses  Ulysses all-to-all (sequence-sharded <-> head-sharded)
    ring     ring attention: K/V blocks (and in the backward dK/dV) passed on to the next rank
    dp       different samples; the data loader shards over this group
    pp       pipeline neighbours
    grad     dp x sp: weights are replicated over both, so gradients, the global loss and the
             global token count are reduced here, and optimizer state is sharded here
    mp       pp x tp: the ranks that together hold one copy of the model (global grad norm)
    embed    first + last pipeline stage (tied input/output embeddings)

`device_mesh` builds the (pp, tp, grad) DeviceMesh that checkpoints and FSDP place tensors on, from the
grid's own groups.

One process group per communicator: kinds whose groups hold the same ranks share one (sp, ulysses and ring
where one factor is 1; tp and mp where pp = 1; WORLD for a kind of every rank; the mesh's dimensions), except
the gradient group, kept apart where its collectives overlap the step's (plan/communicators.py says which and
why; `communicators` lists this rank's, as runtime.json does). Each rank creates only the groups it belongs
to (new_group with use_local_synchronization), so its start-up does not grow with the number of groups in the
world; under NCCL each communicator is split from the world's (one call per communicator on every rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megalysses.comm import collective_device_type
from megalysses.degrees import Degrees, LayoutError
from megalysses.parallel.sequence_layout import SequenceLayout
from megalysses.plan import RunPlan
from megalysses.plan.communicators import (FINE_AXES, GROUP_AXES, KINDS, MESH_KINDS, Communicator, axis_sizes,
                                           communicators)

__all__ = ["AXES", "FINE_AXES", "GROUP_AXES", "GridLayout", "LayoutError", "ParallelGrid"]

AXES = ("pp", "dp", "sp", "tp")


def _set_group_timeout(timeout: timedelta, group: dist.ProcessGroup) -> None:
    """dist.set_timeout where torch has it (2.14 on); the private function it replaced before."""
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(timeout, group)
    else:
        from torch.distributed.distributed_c10d import _set_pg_timeout
        _set_pg_timeout(timeout, group)


@dataclass(frozen=True)
class GridLayout:
    """Pure rank arithmetic of the (pp, dp, sp, tp) grid of a run's degrees."""

    degrees: Degrees

    @property
    def world(self) -> int:
        return self.degrees.world

    @cached_property
    def ranks(self) -> torch.Tensor:
        """(pp, dp, sp, tp) tensor of world ranks."""
        d = self.degrees
        return torch.arange(d.world).view(d.pp, d.dp, d.sp, d.tp)

    @cached_property
    def fine_ranks(self) -> torch.Tensor:
        """(pp, dp, ring, ulysses, tp) tensor of world ranks: the same order, sp split in two."""
        d = self.degrees
        return self.ranks.view(d.pp, d.dp, d.ring, d.ulysses, d.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """{pp, dp, sp, tp, ring, ulysses} coordinates of `rank` (sp = ring * ulysses_size + ulysses)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a world of {self.world}")
        c, d = {}, self.degrees
        for axis, size in zip(FINE_AXES[::-1], (d.tp, d.ulysses, d.ring, d.dp, d.pp)):
            rank, c[axis] = divmod(rank, size)
        c["sp"] = c["ring"] * d.ulysses + c["ulysses"]
        return c

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of one kind (a grid kind, a mesh dimension or "world"), as sorted rank lists that partition
        the world (embed excepted): O(world), for arithmetic and tests; a rank's own is group_of."""
        if kind == "world":
            return [list(range(self.world))]
        if kind == "embed":
            first, last = self.ranks[0].reshape(-1), self.ranks[-1].reshape(-1)
            return [sorted({int(a), int(b)}) for a, b in zip(first, last)]
        vary = GROUP_AXES[MESH_KINDS.get(kind, kind)]
        keep = [a for a in FINE_AXES if a not in vary]
        perm = [FINE_AXES.index(a) for a in keep] + [FINE_AXES.index(a) for a in vary]
        t = self.fine_ranks.permute(*perm)
        return [sorted(g.tolist()) for g in t.reshape(-1, t.shape[len(keep):].numel())]

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The sorted ranks of `rank`'s group of `kind`, from its coordinates alone (KeyError: a middle pipeline
        stage has no embed group)."""
        c = self.coords(rank)
        if kind == "world":
            return list(range(self.world))
        if kind == "embed":
            if c["pp"] not in (0, self.degrees.pp - 1):
                raise KeyError(f"rank {rank} has no embed group (a middle pipeline stage)")
            stages = self.ranks[:, c["dp"], c["sp"], c["tp"]]
            return sorted({int(stages[0]), int(stages[-1])})
        vary = GROUP_AXES[MESH_KINDS.get(kind, kind)]
        index = tuple(slice(None) if a in vary else c[a] for a in FINE_AXES)
        return sorted(self.fine_ranks[index].reshape(-1).tolist())


class ParallelGrid:
    """This rank's coordinates and process groups. Build once after init_process_group; pass it around."""

    def __init__(self, degrees: Optional[Degrees] = None, rank: Optional[int] = None,
                 timeout_seconds: Optional[float] = None, grad_apart: bool = True) -> None:
        """The grid of `degrees` (default: every rank of the process group a dp rank), as rank `rank` (default:
        this process's)."""
        self.layout = GridLayout(Degrees(dp=dist.get_world_size()) if degrees is None else degrees)
        self.world = self.layout.world
        self.rank = dist.get_rank() if rank is None else rank
        # every group ends a collective that waits longer than this (parallel.timeout_seconds);
        # None leaves torch's default (30 minutes on gloo)
        self.timeout = None if timeout_seconds is None else timedelta(seconds=timeout_seconds)
        c = self.layout.coords(self.rank)
        self.pp_rank, self.dp_rank, self.sp_rank, self.tp_rank = c["pp"], c["dp"], c["sp"], c["tp"]
        self.ring_rank, self.ulysses_rank = c["ring"], c["ulysses"]
        # grad_apart: the gradient group keeps its own communicator (RunPlan.grad_overlap; plan/communicators.py)
        self.grad_apart = grad_apart
        self._groups: dict[str, Optional[dist.ProcessGroup]] = {}
        self._ranks: dict[str, list[int]] = {}
        self._communicators: list[tuple[Communicator, list[int]]] = []     # this rank's, with their ranks
        self._create_groups()

    def _create_groups(self) -> None:
        """One process group per communicator of plan/communicators.py (kinds of the same ranks share it), each
        created by its members alone; a grid kind's group of one rank is None (collectives skip it)."""
        L, d = self.layout, self.layout.degrees
        sizes = axis_sizes(d.tp, d.ulysses, d.ring, d.dp, d.pp)
        for comm in communicators(sizes, self.grad_apart):     # the same list, in the same order, on every rank
            first = comm.kinds[0]
            mine = [] if first == "embed" and self.pp_rank not in (0, d.pp - 1) else L.group_of(first, self.rank)
            group = self._new_group(comm, mine)
            if group is not None:
                self._communicators.append((comm, mine))
            if mine:
                self._groups.update(dict.fromkeys(comm.kinds, group))
                self._ranks.update(dict.fromkeys(comm.kinds, mine))
        for kind in KINDS:              # a grid kind of one rank (a middle stage has no embed group)
            if kind not in self._ranks and (kind != "embed" or self.pp_rank in (0, d.pp - 1)):
                self._ranks[kind], self._groups[kind] = L.group_of(kind, self.rank), None

    def _new_group(self, comm: Communicator, ranks: list[int]) -> Optional[dist.ProcessGroup]:
        """This rank's process group of `comm` (None outside it). WORLD itself where it holds the same ranks; NCCL
        splits the world's communicator (every rank calls, once per communicator, as DeviceMesh does); otherwise
        the group's members alone create it, meeting through the store among themselves."""
        if not dist.is_initialized():
            return None
        if comm.kinds[0] == "world" and dist.get_world_size() == self.world:
            if self.timeout is not None:
                _set_group_timeout(self.timeout, dist.group.WORLD)
            return dist.group.WORLD
        # torch names a group by its ranks and the number of groups the rank already has, so every rank creates one
        # group per communicator: where it is in none (a middle stage's embed, a rank standing in for another in a
        # smaller world: tests), a group of itself alone, which nothing uses
        desc, member = "+".join(comm.kinds), dist.get_rank() in ranks
        if getattr(dist.group.WORLD, "bound_device_id", None) is not None:
            split = self.layout.groups(comm.kinds[0])
            covered = {r for g in split for r in g}
            split += [[r] for r in range(dist.get_world_size()) if r not in covered]
            group = dist.split_group(split_ranks=split, timeout=self.timeout, group_desc=desc)
            return group if member else None
        group = dist.new_group(ranks if member else [dist.get_rank()], timeout=self.timeout,
                               use_local_synchronization=True, group_desc=desc if member else "unused")
        return group if member else None

    @property
    def communicators(self) -> list[dict]:
        """This rank's communicators, one per process group: its ranks, the kinds that use it, its stated device
        memory, and why it is kept apart where another of the same ranks exists (runtime.json)."""
        return [comm.record(ranks) for comm, ranks in self._communicators]

    @classmethod
    def for_plan(cls, plan: RunPlan, timeout_seconds: Optional[float] = None) -> "ParallelGrid":
        """The grid of a resolved run: the plan's degrees (sp split into ulysses x ring as the plan splits it), the
        gradient group apart where the plan overlaps its collectives with the step's."""
        return cls(plan.degrees, timeout_seconds=timeout_seconds, grad_apart=plan.grad_overlap)

    @classmethod
    def single(cls) -> "ParallelGrid":
        """A world of one with no process groups (single-process references, tools, tests)."""
        return cls(Degrees(), rank=0)

    # sizes and coordinates
    @property
    def degrees(self) -> Degrees:
        return self.layout.degrees

    tp_size = property(lambda self: self.degrees.tp)
    sp_size = property(lambda self: self.degrees.sp)
    ulysses_size = property(lambda self: self.degrees.ulysses)
    ring_size = property(lambda self: self.degrees.ring)
    pp_size = property(lambda self: self.degrees.pp)
    dp_size = property(lambda self: self.degrees.dp)

    @property
    def grad_rank(self) -> int:
        """Rank inside the grad (dp x sp) group."""
        return self._ranks["grad"].index(self.rank)

    @property
    def grad_size(self) -> int:
        return self.degrees.dp * self.degrees.sp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.degrees.pp - 1

    def group(self, kind: str) -> Optional[dist.ProcessGroup]:
        return self._groups.get(kind) if kind == "embed" else self._groups[kind]

    def group_ranks(self, kind: str) -> list[int]:
        """The ranks of this rank's group of `kind` (empty for embed on a middle pipeline stage)."""
        return self._ranks.get(kind, []) if kind == "embed" else self._ranks[kind]

    @property
    def tp_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["tp"]

    @property
    def sp_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["sp"]

    @property
    def ulysses_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["ulysses"]

    @property
    def ring_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["ring"]

    @property
    def dp_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["dp"]

    @property
    def pp_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["pp"]

    @property
    def grad_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["grad"]

    @property
    def mp_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["mp"]

    @property
    def embed_group(self) -> Optional[dist.ProcessGroup]:
        """The first and last stage's group (tied embeddings); None on a middle stage, which holds neither."""
        return self._groups.get("embed")

    def device_mesh(self, device: torch.device) -> DeviceMesh:
        """The (pp, tp, grad) device mesh of the grid (grad = dp x sp in grid order), made of the grid's own process
        groups (no communicator of its own): checkpoints place every tensor on its stage's (tp, grad) sub-mesh, FSDP
        shards over grad. Its device type is the one the groups' backend takes for `device`'s tensors
        (comm.collective_device_type: the host's for a build of shapes alone, a dry run's)."""
        d = self.degrees
        ranks = self.layout.ranks.permute(0, 3, 1, 2).reshape(d.pp, d.tp, d.dp * d.sp)
        # fresh row-major strides: torch 2.11 takes the mesh layout from them, and a size-1 dim of the
        # permuted view keeps a stride that makes mesh["tp", "grad"] fail as out of order
        kind = collective_device_type(device)
        groups = [self._groups[k] for k in MESH_KINDS]
        return DeviceMesh.from_group(groups, kind, mesh=ranks.flatten().view(ranks.shape),
                                     mesh_dim_names=("pp", "tp", "grad"))

    def sequence_layout(self, tp_sequence_parallel: bool) -> SequenceLayout:
        """Which positions of a sample each sp rank holds, and the multiple samples are padded to."""
        return SequenceLayout(self.degrees, tp_sequence_parallel)

    def stage_rank(self, pp_rank: int) -> int:
        """World rank of the same (dp, sp, tp) position at pipeline stage `pp_rank`."""
        return int(self.layout.ranks[pp_rank, self.dp_rank, self.sp_rank, self.tp_rank])

    def __repr__(self) -> str:
        return (f"ParallelGrid(rank={self.rank}/{self.world}, pp={self.pp_rank}/{self.pp_size}, "
                f"dp={self.dp_rank}/{self.dp_size}, sp={self.sp_rank}/{self.sp_size} (ring={self.ring_rank}/"
                f"{self.ring_size}, ulysses={self.ulysses_rank}/{self.ulysses_size}), "
                f"tp={self.tp_rank}/{self.tp_size})")
