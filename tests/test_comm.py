"""Autograd collectives on 2 and 4 gloo ranks: forward and backward equal the single-process math."""
import pytest
import torch

from megalysses import comm
from megalysses.testing import run_distributed


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def _comm_worker(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 4 * world, 2 * world, 5, generator=g)          # same on every rank
    per_rank = torch.randn(world, 3, 4 * world, 5, generator=g)           # rank r uses per_rank[r]
    weights = torch.randn(world, 3, 4 * world, 2 * world, 5, generator=g)
    checks = {}

    # copy_to_tp: identity forward, backward sums the upstream gradients of all ranks
    x = full.clone().requires_grad_()
    (comm.copy_to_tp(x, group) * weights[rank]).sum().backward()
    checks["copy_fwd_bwd"] = _close(x.grad, weights.sum(0))

    # reduce_from_tp: sum forward, identity backward
    x = per_rank[rank].clone().requires_grad_()
    y = comm.reduce_from_tp(x, group)
    (y * weights[rank, ..., 0, :]).sum().backward()
    checks["reduce_fwd"] = _close(y, per_rank.sum(0))
    checks["reduce_bwd"] = _close(x.grad, weights[rank, ..., 0, :])

    # scatter_to_tp (last dim): own chunk forward, all-gather backward
    x = full.clone().requires_grad_()
    y = comm.scatter_to_tp(x, group, dim=2)
    w_chunks = [weights[r].chunk(world, dim=2)[r] for r in range(world)]
    (y * w_chunks[rank]).sum().backward()
    checks["scatter_fwd"] = _close(y, full.chunk(world, dim=2)[rank])
    checks["scatter_bwd"] = _close(x.grad, torch.cat(w_chunks, dim=2))

    # gather_from_tp: all-gather forward, own chunk of the gradient backward
    x = full.chunk(world, dim=2)[rank].clone().requires_grad_()
    y = comm.gather_from_tp(x, group, dim=2)
    (y * weights[0]).sum().backward()
    checks["gather_fwd"] = _close(y, full)
    checks["gather_bwd"] = _close(x.grad, weights[0].chunk(world, dim=2)[rank])

    # reduce_scatter_to_tp (sequence dim 1): sum then own chunk; backward all-gathers
    x = per_rank[rank].clone().requires_grad_()
    y = comm.reduce_scatter_to_tp(x, group, dim=1)
    up = [weights[r, ..., 0, :].chunk(world, dim=1)[r] for r in range(world)]
    (y * up[rank]).sum().backward()
    checks["rs_fwd"] = _close(y, per_rank.sum(0).chunk(world, dim=1)[rank])
    checks["rs_bwd"] = _close(x.grad, torch.cat(up, dim=1))

    # all_gather_from_tp (sequence dim 1): gather forward, reduce-scatter backward
    x = full.chunk(world, dim=1)[rank].clone().requires_grad_()
    y = comm.all_gather_from_tp(x, group, dim=1)
    (y * weights[rank]).sum().backward()
    checks["ag_fwd"] = _close(y, full)
    checks["ag_bwd"] = _close(x.grad, weights.sum(0).chunk(world, dim=1)[rank])

    # Ulysses all-to-all: (B, S/P, H, D) -> (B, S, H/P, D); backward is the inverse all-to-all
    x = full.chunk(world, dim=1)[rank].clone().requires_grad_()
    y = comm.all_to_all(x, group, scatter_dim=2, gather_dim=1)
    w = weights[0].chunk(world, dim=2)[rank]
    (y * w).sum().backward()
    checks["a2a_fwd"] = _close(y, full.chunk(world, dim=2)[rank])
    checks["a2a_bwd"] = _close(x.grad, weights[0].chunk(world, dim=1)[rank])
    back = comm.all_to_all(y, group, scatter_dim=1, gather_dim=2)
    checks["a2a_round_trip"] = _close(back, x)

    # non-contiguous input: the same data laid out as (B, H, S/P, D) and transposed
    xt = full.chunk(world, dim=1)[rank].transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert not xt.is_contiguous()
    yt = comm.all_to_all(xt, group, scatter_dim=2, gather_dim=1)
    (yt * w).sum().backward()
    checks["a2a_noncontig"] = _close(yt, y) and _close(xt.grad, x.grad)

    # pipeline p2p: every rank sends to the next and receives from the previous (a ring)
    buf = torch.empty(4)
    comm.send_recv(sends=[(torch.full((4,), float(rank)), (rank + 1) % world)],
                   recvs=[(buf, (rank - 1) % world)])
    checks["p2p_ring"] = bool((buf == (rank - 1) % world).all())
    return checks


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_single_process(tmp_path, world):
    for rank, checks in enumerate(run_distributed(_comm_worker, world, tmp_path)):
        failed = [k for k, ok in checks.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


def test_single_process_is_identity():
    x = torch.randn(2, 4, 6, requires_grad=True)
    for f in (comm.copy_to_tp, comm.reduce_from_tp):
        assert f(x, None) is x
    assert comm.all_to_all(x, None, 2, 1) is x


def _failing_worker(rank, world):
    if rank == 1:
        raise RuntimeError("boom on rank one")
    return rank


def test_harness_reports_failing_rank(tmp_path):
    from megalysses.testing import DistributedTestError

    with pytest.raises(DistributedTestError, match="(?s)rank 1 raised.*boom on rank one"):
        run_distributed(_failing_worker, 2, tmp_path)
