"""The 4-D process grid: rank <-> (pp, dp, sp, tp) coordinates and every process group by purpose.

Ranks are laid out as `arange(world).view(pp, dp, sp, tp)`: tp varies fastest (keep it inside a
node), then sp, then dp, then pp. `GridLayout` is the pure arithmetic (no process group needed);
`ParallelGrid` adds the torch.distributed groups and is passed explicitly to whoever needs them.

Groups by purpose:
    tp     tensor-parallel shards of weights
    sp     Ulysses all-to-all (sequence-sharded <-> head-sharded)
    dp     different samples; the data loader shards over this group
    pp     pipeline neighbours
    grad   dp x sp: weights are replicated over both, so gradients, the global loss and the
           global token count are reduced here, and optimizer state is sharded here
    mp     pp x tp: the ranks that together hold one copy of the model (global grad norm)
    embed  first + last pipeline stage (tied input/output embeddings)
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import Optional

import torch
import torch.distributed as dist

AXES = ("pp", "dp", "sp", "tp")
# which axes vary inside one group of each kind
GROUP_AXES = {
    "tp": ("tp",),
    "sp": ("sp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "grad": ("dp", "sp"),
    "mp": ("pp", "tp"),
}


class LayoutError(ValueError):
    """An impossible (world, tp, sp, dp, pp) combination."""


@dataclass(frozen=True)
class GridLayout:
    """Pure rank arithmetic of the (pp, dp, sp, tp) grid."""

    world: int
    tp: int = 1
    sp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        sizes = (("world", self.world), ("tp", self.tp), ("sp", self.sp), ("pp", self.pp))
        bad = [f"{n}={v}" for n, v in sizes if v < 1]
        mp = self.tp * self.sp * self.pp
        if bad or self.world % mp:
            rule = f"{', '.join(bad)} must be >= 1" if bad else f"world must be a multiple of tp*sp*pp = {mp}"
            raise LayoutError(
                f"invalid parallel layout: world={self.world}, tp={self.tp}, sp={self.sp}, pp={self.pp}, "
                f"dp=world/(tp*sp*pp)={self.world / max(mp, 1):g}: {rule} (world = tp*sp*dp*pp)")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.sp * self.pp)

    @cached_property
    def ranks(self) -> torch.Tensor:
        """(pp, dp, sp, tp) tensor of world ranks."""
        return torch.arange(self.world).view(self.pp, self.dp, self.sp, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        idx = (self.ranks == rank).nonzero()[0].tolist()
        return dict(zip(AXES, idx))

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of one kind, as sorted rank lists that partition the world (embed excepted)."""
        if kind == "embed":
            first, last = self.ranks[0].reshape(-1), self.ranks[-1].reshape(-1)
            return [sorted({int(a), int(b)}) for a, b in zip(first, last)]
        vary = GROUP_AXES[kind]
        keep = [a for a in AXES if a not in vary]
        perm = [AXES.index(a) for a in keep] + [AXES.index(a) for a in vary]
        t = self.ranks.permute(*perm)
        return [sorted(g.tolist()) for g in t.reshape(-1, t.shape[len(keep):].numel())]

    def group_of(self, kind: str, rank: int) -> list[int]:
        for g in self.groups(kind):
            if rank in g:
                return g
        raise KeyError(f"rank {rank} has no {kind} group")


class ParallelGrid:
    """This rank's coordinates and process groups. Build once after init_process_group; pass it around."""

    def __init__(self, tp: int = 1, sp: int = 1, pp: int = 1, world: Optional[int] = None,
                 rank: Optional[int] = None, timeout_seconds: Optional[float] = None) -> None:
        self.world = dist.get_world_size() if world is None else world
        self.rank = dist.get_rank() if rank is None else rank
        # every group ends a collective that waits longer than this (parallel.timeout_seconds);
        # None leaves torch's default (30 minutes on gloo)
        self.timeout = None if timeout_seconds is None else timedelta(seconds=timeout_seconds)
        self.layout = GridLayout(self.world, tp, sp, pp)
        c = self.layout.coords(self.rank)
        self.pp_rank, self.dp_rank, self.sp_rank, self.tp_rank = c["pp"], c["dp"], c["sp"], c["tp"]
        self._groups: dict[str, Optional[dist.ProcessGroup]] = {}
        self._ranks: dict[str, list[int]] = {}
        # every rank creates every group in the same order; a group of one is None (collectives skip it)
        for kind in list(GROUP_AXES) + ["embed"]:
            for ranks in self.layout.groups(kind):
                group = dist.new_group(ranks, timeout=self.timeout) if len(ranks) > 1 else None
                if self.rank in ranks:
                    self._groups[kind], self._ranks[kind] = group, ranks

    @classmethod
    def single(cls) -> "ParallelGrid":
        """A world of one with no process groups (single-process references, tools, tests)."""
        return cls(world=1, rank=0)

    # sizes and coordinates
    tp_size = property(lambda self: self.layout.tp)
    sp_size = property(lambda self: self.layout.sp)
    pp_size = property(lambda self: self.layout.pp)
    dp_size = property(lambda self: self.layout.dp)

    @property
    def grad_rank(self) -> int:
        """Rank inside the grad (dp x sp) group."""
        return self._ranks["grad"].index(self.rank)

    @property
    def grad_size(self) -> int:
        return self.layout.dp * self.layout.sp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    def group(self, kind: str) -> Optional[dist.ProcessGroup]:
        return self._groups[kind]

    def group_ranks(self, kind: str) -> list[int]:
        return self._ranks[kind]

    @property
    def tp_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["tp"]

    @property
    def sp_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["sp"]

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
        return self._groups["embed"]

    def stage_rank(self, pp_rank: int) -> int:
        """World rank of the same (dp, sp, tp) position at pipeline stage `pp_rank`."""
        return int(self.layout.ranks[pp_rank, self.dp_rank, self.sp_rank, self.tp_rank])

    def __repr__(self) -> str:
        return (f"ParallelGrid(rank={self.rank}/{self.world}, pp={self.pp_rank}/{self.pp_size}, "
                f"dp={self.dp_rank}/{self.dp_size}, sp={self.sp_rank}/{self.sp_size}, "
                f"tp={self.tp_rank}/{self.tp_size})")
