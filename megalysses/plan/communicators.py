"""Which of a run's process groups share a communicator, and the device memory the communicators take.

    comms = communicators(axis_sizes(tp=8, ulysses=8, ring=1, dp=1, pp=1), grad_apart=True)
    reserve = sum(c.bytes for c in comms)                 # counted in Hardware.usable_bytes's reserve
    comms = run_communicators(plan)                       # the busiest rank's (the first stage's) of a RunPlan

Every group of the grid (grid.py) is named for its purpose, but a communicator (with NCCL, its buffers and
connections) belongs to a set of ranks: kinds whose groups hold the same ranks share one process group.
A group's ranks differ along some of the grid's axes (FINE_AXES), so two kinds share when the axes of size
above one that their groups vary along are the same: sp, Ulysses and WORLD when tp = pp = dp = 1 and ring = 1
(the gradient group too, where its collectives do not overlap the step's), tp and mp when pp = 1, the device
mesh's dimensions and the grid's groups of the same axes.

One exception, a "lane" of its own: the gradient group's collectives run beside the step's other collectives
(FSDP's prefetching all-gathers and reduce-scatters on their own streams, ZeRO-1's bucket reduce-scatters
during the backward) where the plan overlaps them (RunPlan.grad_overlap). One communicator runs its
collectives in the order they were issued, on one stream, so an all-to-all of Ulysses (or a tp all-reduce)
issued after a bucket's reduce-scatter on a shared communicator would wait for it: the gradient group (and the
mesh's grad dimension, which is the same group) keeps a communicator of its own even where the step's groups
hold the same ranks. WORLD's own collectives (object broadcasts, barriers, a checkpoint's planning) run
between steps, never beside another, so WORLD is shared with the step's groups of all ranks.

The memory figures are stated, not measured (no GPU has measured them here): an NCCL communicator allocates
NCCL_BUFFSIZE (4 MiB) per channel, peer and protocol for each connection it sets up, lazily, when a kind of
collective first uses it (NCCL_RUNTIME_CONNECT): ring and tree connections for all-reduce, all-gather,
reduce-scatter and broadcast, point-to-point connections to every peer an all-to-all or a send reaches.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Mapping

from megalysses.plan.types import RunPlan

MIB = 2**20

FINE_AXES = ("pp", "dp", "ring", "ulysses", "tp")
"""The grid's axes, slowest first: sp split into its ring and Ulysses parts (Ulysses fastest)."""

GROUP_AXES = {
    "tp": ("tp",),
    "sp": ("ring", "ulysses"),
    "ulysses": ("ulysses",),
    "ring": ("ring",),
    "dp": ("dp",),
    "pp": ("pp",),
    "grad": ("dp", "ring", "ulysses"),
    "mp": ("pp", "tp"),
}
"""Which axes vary inside one group of each kind (embed, the first and last stage, is apart)."""

MESH_KINDS = {"mesh.pp": "pp", "mesh.tp": "tp", "mesh.grad": "grad"}
"""The device mesh's dimensions (checkpoints' DTensors, FSDP) and the grid's kind each is made from. Unlike a
grid group, a mesh dimension of one rank needs a process group too."""

KINDS = tuple(GROUP_AXES) + ("embed",) + tuple(MESH_KINDS)
"""Every kind, in the order the grid creates them (WORLD, "world", exists before)."""

GRADIENT_KINDS = ("grad", "mesh.grad")
"""The kinds whose collectives may overlap the step's (their own lane when RunPlan.grad_overlap)."""

USES = {"world": "collective", "tp": "collective", "ulysses": "all_to_all", "ring": "p2p", "pp": "p2p",
        "grad": "collective", "mp": "collective", "embed": "collective", "mesh.grad": "collective"}
"""The kind of collective each kind runs (sp, dp, mesh.pp and mesh.tp run none: their ranks are arithmetic,
or a DTensor's placement)."""

BASE_MIB = 32
"""Every communicator: its device-side state and the proxy's, before any connection (stated, unmeasured)."""
RING_TREE_MIB = 128
"""The ring and tree connections of all-reduce, all-gather, reduce-scatter and broadcast: 4 MiB x 16 channels
(NVLink on an H100) x the two ring neighbours (stated, unmeasured)."""
P2P_PEER_MIB = 16
"""Point-to-point buffers per peer reached (every other rank for an all-to-all, the two neighbours of a ring or
a pipeline): 4 MiB x 2 channels x send and receive (stated, unmeasured)."""


@dataclass(frozen=True)
class Communicator:
    """One process group of a rank: the axes its ranks differ along, its size, and the kinds that use it."""

    axes: tuple[str, ...]     # FINE_AXES of size > 1 it varies along; ("embed",) for the first and last of pp > 2
    size: int
    kinds: tuple[str, ...]
    apart: bool = False       # the gradients' own, beside a step group of the same ranks (see the module)

    @property
    def uses(self) -> set[str]:
        return {USES[k] for k in self.kinds if k in USES}

    @property
    def bytes(self) -> int:
        """Its device memory, from the stated per-communicator figures and the collectives its kinds run."""
        if self.size < 2:
            return BASE_MIB * MIB
        peers = max((self.size - 1 if u == "all_to_all" else min(2, self.size - 1) if u == "p2p" else 0)
                    for u in self.uses | {""})
        ring_tree = RING_TREE_MIB if "collective" in self.uses else 0
        return (BASE_MIB + ring_tree + P2P_PEER_MIB * peers) * MIB

    def record(self, ranks: list[int]) -> dict:
        """runtime.json's entry: the ranks, the kinds, and why it is kept apart where it is."""
        out = {"ranks": ranks, "kinds": list(self.kinds), "mib": self.bytes // MIB}
        if self.apart:
            out["kept_apart"] = ("the gradients' collectives overlap the step's (FSDP's prefetch and reduce-scatter, "
                                 "ZeRO-1's bucket reduce-scatters during the backward)")
        return out


def axis_sizes(tp: int, ulysses: int, ring: int, dp: int, pp: int) -> dict[str, int]:
    """{axis: size} of a layout, FINE_AXES's keys."""
    return {"pp": pp, "dp": dp, "ring": ring, "ulysses": ulysses, "tp": tp}


def group_axes(kind: str, sizes: Mapping[str, int]) -> tuple[str, ...] | None:
    """The axes of size > 1 a group of `kind` varies along (the key its communicator is shared by), or None where a
    grid kind's group is a single rank (no process group: collectives skip it)."""
    if kind == "world":
        return tuple(a for a in FINE_AXES if sizes[a] > 1)
    if kind == "embed":
        return None if sizes["pp"] == 1 else ("pp",) if sizes["pp"] == 2 else ("embed",)
    axes = tuple(a for a in FINE_AXES if a in GROUP_AXES[MESH_KINDS.get(kind, kind)] and sizes[a] > 1)
    return axes if axes or kind in MESH_KINDS else None


def lane(kind: str, grad_apart: bool) -> str:
    """"gradients" for the gradient kinds where their collectives overlap the step's, else "step"."""
    return "gradients" if grad_apart and kind in GRADIENT_KINDS else "step"


def communicators(sizes: Mapping[str, int], grad_apart: bool, embed: bool = True) -> list[Communicator]:
    """A rank's communicators, WORLD's first, in the order the grid creates them: one per (lane, set of ranks).
    `embed`: the rank is on the first or last pipeline stage (it holds a copy of a tied embedding)."""
    shared: dict[tuple[str, tuple[str, ...]], list[str]] = {("step", group_axes("world", sizes)): ["world"]}
    for kind in KINDS:
        axes = group_axes(kind, sizes)
        if axes is not None and (kind != "embed" or embed):
            shared.setdefault((lane(kind, grad_apart), axes), []).append(kind)
    return [Communicator(axes, 2 if axes == ("embed",) else prod(sizes[a] for a in axes), tuple(kinds),
                         apart=key_lane == "gradients" and ("step", axes) in shared)
            for (key_lane, axes), kinds in shared.items()]


CHECKPOINT_APART = ("a background checkpoint is completed (gathered, checksummed, its latest moved) on the saver's own "
                    "thread while training's collectives run: gloo, in host memory, no device buffers")
"""Why the background saver's process group (checkpoint.async_save) is kept apart from WORLD's, which holds the
same ranks."""


def checkpoint_record(world: int) -> dict:
    """runtime.json's entry for the background saver's process group: gloo over every rank, kept apart."""
    return {"ranks": list(range(world)), "kinds": ["checkpoint"], "mib": 0, "backend": "gloo",
            "kept_apart": CHECKPOINT_APART}


def run_communicators(plan: RunPlan) -> list[Communicator]:
    """The communicators of the busiest rank of a RunPlan (the first pipeline stage's: it has the embed group)."""
    d = plan.degrees
    return communicators(axis_sizes(d.tp, d.ulysses, d.ring, d.dp, d.pp), plan.grad_overlap)


def communicator_bytes(plan: RunPlan) -> int:
    """What the communicators of a RunPlan's busiest rank take of the device (the reserve's share for them)."""
    return sum(c.bytes for c in run_communicators(plan))
