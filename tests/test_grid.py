"""ParallelGrid arithmetic (no process group) and group creation on real gloo ranks."""
import itertools

import pytest

from megalysses.grid import GROUP_AXES, GridLayout, LayoutError, ParallelGrid
from megalysses.testing import run_distributed

DEGREES = (1, 2, 4)
LAYOUTS = [(tp, sp, pp, dp) for tp, sp, pp, dp in itertools.product(DEGREES, repeat=4) if tp * sp * pp * dp <= 16]


@pytest.mark.parametrize("tp,sp,pp,dp", LAYOUTS)
def test_groups_partition_world(tp, sp, pp, dp):
    world = tp * sp * pp * dp
    layout = GridLayout(world, tp=tp, sp=sp, pp=pp)
    assert layout.dp == dp
    sizes = {"tp": tp, "sp": sp, "dp": dp, "pp": pp, "grad": dp * sp, "mp": pp * tp}
    for kind in GROUP_AXES:
        groups = layout.groups(kind)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), f"{kind} groups do not partition the world"
        assert all(len(g) == sizes[kind] for g in groups), kind
    # tp ranks are contiguous (innermost, inside a node); sp next
    for g in layout.groups("tp"):
        assert g == list(range(g[0], g[0] + tp))
    for g in layout.groups("sp"):
        assert g == list(range(g[0], g[0] + sp * tp, tp))
    # coordinates agree with group membership
    for rank in range(world):
        c = layout.coords(rank)
        assert rank == ((c["pp"] * dp + c["dp"]) * sp + c["sp"]) * tp + c["tp"]
        for kind, axes in GROUP_AXES.items():
            g = layout.group_of(kind, rank)
            for other in g:
                oc = layout.coords(other)
                assert all(oc[a] == c[a] for a in c if a not in axes)
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


def _grid_worker(rank, world, tp, sp, pp):
    import torch
    import torch.distributed as dist

    grid = ParallelGrid(tp=tp, sp=sp, pp=pp)
    out = {"coords": (grid.pp_rank, grid.dp_rank, grid.sp_rank, grid.tp_rank)}
    for kind in list(GROUP_AXES) + ["embed"]:
        # the group really connects the ranks the arithmetic says
        t = torch.tensor([float(rank)])
        if len(grid.group_ranks(kind)) > 1:
            dist.all_reduce(t, group=grid.group(kind))
        else:
            assert grid.group(kind) is None
        out[kind] = (grid.group_ranks(kind), t.item())
    return out


def test_grid_groups_on_8_ranks(tmp_path):
    tp, sp, pp = 2, 2, 2
    results = run_distributed(_grid_worker, 8, tmp_path, args=(tp, sp, pp))
    layout = GridLayout(8, tp=tp, sp=sp, pp=pp)
    for rank, out in enumerate(results):
        c = layout.coords(rank)
        assert out["coords"] == (c["pp"], c["dp"], c["sp"], c["tp"])
        for kind in list(GROUP_AXES) + ["embed"]:
            ranks, total = out[kind]
            assert ranks == layout.group_of(kind, rank)
            assert total == sum(ranks)
