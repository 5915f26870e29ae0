"""ParallelGrid arithmetic (no process group) and group creation on real gloo ranks."""
import itertools

import pytest

from megalysses.data.loader import LoaderRank
from megalysses.degrees import Degrees
from megalysses.grid import FINE_AXES, GROUP_AXES, GridLayout, LayoutError, ParallelGrid
from megalysses.parallel.sequence_layout import SequenceLayout
from megalysses.plan.communicators import GRADIENT_KINDS, KINDS, MESH_KINDS, axis_sizes, communicators
from megalysses.testing import run_distributed

DEGREES = (1, 2, 4)
LAYOUTS = [(tp, sp, pp, dp, ring) for tp, sp, pp, dp in itertools.product(DEGREES, repeat=4) if tp * sp * pp * dp <= 16
           for ring in DEGREES if sp % ring == 0]


@pytest.mark.parametrize("tp,sp,pp,dp,ring", LAYOUTS)
def test_groups_partition_world(tp, sp, pp, dp, ring):
    world = tp * sp * pp * dp
    layout = GridLayout(Degrees.of_world(world, tp=tp, sp=sp, pp=pp, ring=ring))
    u = sp // ring
    assert (layout.degrees.dp, layout.degrees.ulysses) == (dp, u)
    sizes = {"tp": tp, "sp": sp, "ulysses": u, "ring": ring, "dp": dp, "pp": pp, "grad": dp * sp, "mp": pp * tp}
    for kind in GROUP_AXES:
        groups = layout.groups(kind)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), f"{kind} groups do not partition the world"
        assert all(len(g) == sizes[kind] for g in groups), kind
    # tp ranks are contiguous (innermost, inside a node); then Ulysses; then the ring; sp = both
    for g in layout.groups("tp"):
        assert g == list(range(g[0], g[0] + tp))
    for g in layout.groups("ulysses"):
        assert g == list(range(g[0], g[0] + u * tp, tp))
    for g in layout.groups("ring"):
        assert g == list(range(g[0], g[0] + sp * tp, u * tp))
    for g in layout.groups("sp"):
        assert g == list(range(g[0], g[0] + sp * tp, tp))
    # coordinates agree with group membership
    for rank in range(world):
        c = layout.coords(rank)
        assert rank == ((c["pp"] * dp + c["dp"]) * sp + c["sp"]) * tp + c["tp"]
        assert c["sp"] == c["ring"] * u + c["ulysses"]
        for kind, axes in GROUP_AXES.items():
            g = layout.group_of(kind, rank)
            assert sorted(layout.coords(other)[axes[-1]] for other in g) == list(range(sizes[axes[-1]])) or \
                len(axes) > 1
            for other in g:
                oc = layout.coords(other)
                assert all(oc[a] == c[a] for a in FINE_AXES if a not in axes)
    # embedding group: first and last stage of the same (dp, sp, tp) position
    for g in layout.groups("embed"):
        cs = [layout.coords(r) for r in g]
        assert {x["pp"] for x in cs} == ({0, pp - 1})
        assert len({(x["dp"], x["sp"], x["tp"]) for x in cs}) == 1
    assert len(layout.groups("embed")) == dp * sp * tp


@pytest.mark.parametrize("world,tp,sp,pp", [(6, 4, 1, 1), (8, 2, 2, 3), (4, 0, 1, 1), (12, 8, 1, 1)])
def test_bad_layout_message_lists_every_factor(world, tp, sp, pp):
    with pytest.raises(LayoutError) as e:
        Degrees.of_world(world, tp=tp, sp=sp, pp=pp)
    msg = str(e.value)
    for part in (f"world={world}", f"tp={tp}", f"sp={sp}", f"pp={pp}", "dp="):
        assert part in msg
    with pytest.raises(LayoutError, match="ring=3 does not divide sp=4"):
        Degrees.of_world(8, sp=4, ring=3)


def test_the_grid_and_the_sequence_layout_read_one_set_of_degrees():
    """Degrees are the one copy: the grid's arithmetic, the sequence layout and the loader's sizes read them."""
    d = Degrees.of_world(16, tp=2, sp=4, ring=2)
    assert (d.dp, d.ulysses, d.world) == (2, 2, 16) and GridLayout(d).world == 16
    assert d.summary() == {"tp": 2, "sp": 4, "pp": 1, "dp": 2}
    assert (SequenceLayout(d).tp_shard, SequenceLayout(d, tp_sequence_parallel=True).tp_shard) == (1, 2)
    assert SequenceLayout(d, True).multiple == 8 and LoaderRank(layout=SequenceLayout(d)).dp_size == 2
    with pytest.raises(LayoutError, match="virtual_stages=0 must be >= 1"):
        Degrees(virtual_stages=0)


GRIDS = [dict(tp=2, sp=2, pp=2), dict(tp=1, sp=4, pp=2, ring=2)]   # 8 ranks: the second has ulysses 2 x ring 2


def _grid_worker(rank, world, grids):
    import torch
    import torch.distributed as dist

    results = []
    for dims in grids:
        grid = ParallelGrid(Degrees.of_world(world, **dims))
        out = {"coords": (grid.pp_rank, grid.dp_rank, grid.sp_rank, grid.tp_rank, grid.ring_rank, grid.ulysses_rank)}
        for kind in list(GROUP_AXES) + ["embed"]:
            # the group really connects the ranks the arithmetic says
            t = torch.tensor([float(rank)])
            if len(grid.group_ranks(kind)) > 1:
                dist.all_reduce(t, group=grid.group(kind))
            else:
                assert grid.group(kind) is None
            out[kind] = (grid.group_ranks(kind), t.item())
        # the grid's device mesh: (pp, tp, grad) in grid order, each sub-mesh a real group
        mesh = grid.device_mesh(torch.device("cpu"))
        sub = mesh["tp", "grad"]
        out["mesh"] = (mesh.mesh.tolist(), sub.mesh.tolist(), mesh.get_local_rank("grad"))
        out["communicators"] = grid.communicators
        results.append(out)
    return results


def test_grid_groups_and_mesh_on_8_ranks(tmp_path):
    results = run_distributed(_grid_worker, 8, tmp_path, args=(GRIDS,))
    for i, dims in enumerate(GRIDS):
        layout = GridLayout(Degrees.of_world(8, **dims))
        for rank, per_grid in enumerate(results):
            out = per_grid[i]
            c = layout.coords(rank)
            assert out["coords"] == (c["pp"], c["dp"], c["sp"], c["tp"], c["ring"], c["ulysses"])
            for kind in list(GROUP_AXES) + ["embed"]:
                ranks, total = out[kind]
                assert ranks == layout.group_of(kind, rank)
                assert total == sum(ranks)
            full, sub, grad_index = out["mesh"]
            assert full == layout.ranks.permute(0, 3, 1, 2).reshape(layout.degrees.pp, layout.degrees.tp, -1).tolist()
            assert sub == full[c["pp"]] and grad_index == layout.group_of("grad", rank).index(rank)
            check_communicators(layout, rank, out["communicators"], grad_apart=True)


def check_communicators(layout: GridLayout, rank: int, comms: list, grad_apart: bool) -> None:
    """A rank's communicators ({ranks, kinds[, kept_apart]}, as runtime.json lists them) against the grid's arithmetic:
    every kind of one holds its ranks, each kind is in one, and no two hold the same ranks except the gradients'
    kept apart (one of the two)."""
    on_embed = layout.coords(rank)["pp"] in (0, layout.degrees.pp - 1)
    saver = [c for c in comms if c["kinds"] == ["checkpoint"]]      # the background saver's (checkpoint.async_save)
    assert all(c["ranks"] == list(range(layout.world)) and c["backend"] == "gloo" and c["kept_apart"]
               for c in saver) and len(saver) <= 1, saver
    comms = [c for c in comms if c not in saver]
    for c in comms:
        assert all(layout.group_of(k, rank) == c["ranks"] for k in c["kinds"]), c
    kinds = [k for c in comms for k in c["kinds"]]
    want = {k for k in KINDS if k in MESH_KINDS or (k != "embed" or on_embed) and len(layout.group_of(k, rank)) > 1}
    assert sorted(kinds) == sorted(want | {"world"}), kinds
    by_ranks: dict[tuple, list] = {}
    for c in comms:
        by_ranks.setdefault(tuple(c["ranks"]), []).append(c)
    for same in by_ranks.values():
        apart = [c for c in same if c.get("kept_apart")]
        assert len(same) == 1 or (grad_apart and len(same) == 2 and len(apart) == 1
                                  and set(apart[0]["kinds"]) <= set(GRADIENT_KINDS)), same


@pytest.mark.parametrize("grad_apart", [True, False])
def test_one_communicator_per_set_of_ranks(grad_apart):
    """plan/communicators.py's list for every layout of LAYOUTS, on its first and last rank: what the grid creates."""
    for tp, sp, pp, dp, ring in LAYOUTS:
        layout = GridLayout(Degrees(tp=tp, sp=sp, pp=pp, dp=dp, ring=ring))
        for rank in (0, layout.world - 1):
            on_embed = layout.coords(rank)["pp"] in (0, pp - 1)
            comms = communicators(axis_sizes(tp, sp // ring, ring, dp, pp), grad_apart, embed=on_embed)
            check_communicators(layout, rank, [c.record(layout.group_of(c.kinds[0], rank)) for c in comms], grad_apart)
    # sp over the whole world (tp = pp = dp = 1): sp, ulysses and WORLD one communicator, the gradients' apart while
    # they overlap the step; the mesh's dimensions of one rank share a group of one
    comms = communicators(axis_sizes(1, 8, 1, 1, 1), grad_apart)
    assert [c.kinds for c in comms] == ([("world", "sp", "ulysses"), ("grad", "mesh.grad"), ("mesh.pp", "mesh.tp")]
                                        if grad_apart else
                                        [("world", "sp", "ulysses", "grad", "mesh.grad"), ("mesh.pp", "mesh.tp")])


def _fake_world_grid(world: int, rank: int, dims: dict) -> tuple[int, int]:
    """(new_group calls, groups created) of one rank building a grid and its mesh in a fake world of `world`."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    calls, made, original = [0], [0], dist.new_group

    def counted(*args, **kwargs):
        calls[0] += 1
        group = original(*args, **kwargs)
        made[0] += group is not None
        return group

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    dist.new_group = counted
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Set timeout is now only supported")
            grid = ParallelGrid(Degrees.of_world(world, **dims), timeout_seconds=60)
            grid.device_mesh(torch.device("cpu"))
        assert len(grid.communicators) == made[0] + 1          # WORLD besides those created
    finally:
        dist.new_group = original
        dist.destroy_process_group()
    return calls[0], made[0]


def test_groups_created_per_rank_do_not_grow_with_the_world():
    """A rank creates only its own groups: the same new_group calls in a world of 32, 256 or 2,048 (tp 2, ulysses 2,
    ring 2, pp 2, dp growing), not one per group of the world."""
    dims = dict(tp=2, sp=4, ring=2, pp=2)
    counts = {world: _fake_world_grid(world, world // 2 + 3, dims) for world in (32, 256, 2048)}
    assert len(set(counts.values())) == 1, counts
