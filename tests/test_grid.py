"""ParallelGrid arithmetic (no process group) and group creation on real gloo ranks."""
import itertools

import pytest

from megalysses.grid import FINE_AXES, GROUP_AXES, GridLayout, LayoutError, ParallelGrid
from megalysses.testing import run_distributed

DEGREES = (1, 2, 4)
LAYOUTS = [(tp, sp, pp, dp, ring) for tp, sp, pp, dp in itertools.product(DEGREES, repeat=4) if tp * sp * pp * dp <= 16
           for ring in DEGREES if sp % ring == 0]


@pytest.mark.parametrize("tp,sp,pp,dp,ring", LAYOUTS)
def test_groups_partition_world(tp, sp, pp, dp, ring):
    world = tp * sp * pp * dp
    layout = GridLayout(world, tp=tp, sp=sp, pp=pp, ring=ring)
    u = sp // ring
    assert (layout.dp, layout.ulysses) == (dp, u)
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
        GridLayout(world, tp=tp, sp=sp, pp=pp)
    msg = str(e.value)
    for part in (f"world={world}", f"tp={tp}", f"sp={sp}", f"pp={pp}", "dp="):
        assert part in msg
    with pytest.raises(LayoutError, match="ring=3 does not divide sp=4"):
        GridLayout(8, sp=4, ring=3)


GRIDS = [dict(tp=2, sp=2, pp=2), dict(tp=1, sp=4, pp=2, ring=2)]   # 8 ranks: the second has ulysses 2 x ring 2


def _grid_worker(rank, world, grids):
    import torch
    import torch.distributed as dist

    results = []
    for dims in grids:
        grid = ParallelGrid(**dims)
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
        results.append(out)
    return results


def test_grid_groups_and_mesh_on_8_ranks(tmp_path):
    results = run_distributed(_grid_worker, 8, tmp_path, args=(GRIDS,))
    for i, dims in enumerate(GRIDS):
        layout = GridLayout(8, **dims)
        for rank, per_grid in enumerate(results):
            out = per_grid[i]
            c = layout.coords(rank)
            assert out["coords"] == (c["pp"], c["dp"], c["sp"], c["tp"], c["ring"], c["ulysses"])
            for kind in list(GROUP_AXES) + ["embed"]:
                ranks, total = out[kind]
                assert ranks == layout.group_of(kind, rank)
                assert total == sum(ranks)
            full, sub, grad_index = out["mesh"]
            assert full == layout.ranks.permute(0, 3, 1, 2).reshape(layout.pp, layout.tp, -1).tolist()
            assert sub == full[c["pp"]] and grad_index == layout.group_of("grad", rank).index(rank)
