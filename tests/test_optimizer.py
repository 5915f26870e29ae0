"""ZeRO-1 AdamW over the grad group equals torch AdamW on the summed gradients; LR schedules."""
import math

import pytest
import torch
from torch import nn

from megalysses.config import OptimizerConfig
from megalysses.testing import run_distributed
from megalysses.training.optimizer import ShardedAdamW, chunk_rows
from megalysses.training.schedule import lr_at

SHAPES = {"a.weight": (7, 5), "b.weight": (3, 4), "norm.weight": (6,), "c.bias": (1,)}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: nn.Parameter(torch.randn(s, generator=g)) for n, s in SHAPES.items()}


def _grads(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _zero1_worker(rank, world, clip):
    import torch.distributed as dist

    params = _params()
    for p in params.values():
        p.tp_dim = None
    opt = ShardedAdamW(params.items(), dist.group.WORLD, lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = _params()
    ref_opt = torch.optim.AdamW([{"params": [ref["a.weight"], ref["b.weight"]], "weight_decay": 0.1},
                                 {"params": [ref["norm.weight"], ref["c.bias"]], "weight_decay": 0.0}],
                                lr=0.1, betas=(0.9, 0.95), eps=1e-8)
    norms = []
    for step in range(3):
        for n, p in params.items():
            p.grad = _grads(step, rank)[n]
        norm = opt.step(max_norm=clip)
        total = {n: sum(_grads(step, r)[n] for r in range(world)) for n in SHAPES}
        ref_norm = torch.sqrt(sum(t.pow(2).sum() for t in total.values()))
        coef = min(1.0, clip / (ref_norm.item() + 1e-6)) if clip > 0 else 1.0
        for n, p in ref.items():
            p.grad = total[n] * coef
        ref_opt.step()
        norms.append((norm, ref_norm.item()))
    err = max((params[n] - ref[n]).abs().max().item() for n in SHAPES)
    return err, norms


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_zero1_matches_adamw(tmp_path, clip):
    for err, norms in run_distributed(_zero1_worker, 4, tmp_path, args=(clip,)):
        assert err < 1e-6
        for got, want in norms:
            assert math.isclose(got, want, rel_tol=1e-6)


def test_chunk_rows_matches_torch_chunk():
    for rows in range(1, 12):
        for world in range(1, 6):
            t = torch.arange(rows)
            chunks = t.chunk(world)
            for r in range(world):
                lo, hi = chunk_rows(rows, world, r)
                want = chunks[r].tolist() if r < len(chunks) else []
                assert t[lo:hi].tolist() == want


def test_schedules():
    total = 100
    for schedule in ("cosine", "linear", "constant", "wsd"):
        opt = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule=schedule, decay_fraction=0.2)
        lrs = [lr_at(s, opt, total) for s in range(total)]
        assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)       # linear warmup
        assert all(a <= b + 1e-12 for a, b in zip(lrs[:10], lrs[1:10]))
        if schedule == "constant":
            assert all(x == 1.0 for x in lrs[10:])
        else:
            assert lrs[-1] == pytest.approx(0.1, abs=0.02)
            assert all(b <= a + 1e-12 for a, b in zip(lrs[10:], lrs[11:]))          # never increases
        if schedule == "wsd":
            assert all(x == 1.0 for x in lrs[10:80]) and lrs[85] < 1.0
