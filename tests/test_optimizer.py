"""ZeRO-1 AdamW over the grad group equals torch AdamW on the summed gradients; LR schedules."""
import math

import pytest
import torch
from torch import nn

from megalysses.config import OptimizerConfig
from megalysses.testing import run_distributed
from megalysses.parallel.optimizer import AdamWSettings
from megalysses.parallel.zero import ReduceSettings, ShardedAdamW, chunk_rows
from megalysses.training.schedule import lr_at

ADAMW = AdamWSettings(lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
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
    opt = ShardedAdamW(params.items(), dist.group.WORLD, ADAMW)
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


@pytest.mark.parametrize("clip", [0.0, 1.0, 1e3])   # off, binding, above the norm (a coefficient of 1)
def test_zero1_matches_adamw(tmp_path, clip):
    for err, norms in run_distributed(_zero1_worker, 4, tmp_path, args=(clip,)):
        assert err < 1e-6
        for got, want in norms:
            assert math.isclose(got, want, rel_tol=1e-6)


def _overlap_worker(rank, world):
    """Two micro-batches through a small MLP stack: with overlap the buckets are reduce-scattered from
    inside the second backward, and the step equals the one that reduces everything afterwards."""
    import torch.distributed as dist

    def model():
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        for p in m.parameters():
            p.tp_dim = None
        return m

    xs = [torch.randn(3, 16, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    results = {}
    for overlap in (False, True):
        m = model()
        opt = ShardedAdamW(m.named_parameters(), dist.group.WORLD, ADAMW,
                           ReduceSettings(bucket_elements=200, overlap=overlap))
        launched_during_backward, final_at_launch = [], []
        reducer = opt.reducer
        launch = reducer._launch

        def spy(index, launch=launch, reducer=reducer, final_at_launch=final_at_launch):   # final at a launch
            final_at_launch.append(sum(v == len(xs) for v in reducer.pending.fired.values()))
            launch(index)

        reducer._launch = spy
        opt.begin_step(len(xs))
        for x in xs:
            m(x).square().sum().backward()
            launched_during_backward.append(len(reducer.pending.launched))
        norm = opt.step(max_norm=1.0)
        results[overlap] = ([p.detach().clone() for p in m.parameters()], norm, launched_during_backward,
                            len(opt.buckets), final_at_launch)
    return results


def test_zero1_overlapped_reduction(tmp_path):
    for res in run_distributed(_overlap_worker, 2, tmp_path):
        (plain, plain_norm, plain_launches, buckets, _), (ovl, ovl_norm, ovl_launches, _, final) = res[False], res[True]
        assert buckets == 4
        assert plain_launches == [0, 0]                 # nothing in flight before step()
        assert ovl_launches == [0, buckets]             # all buckets launched by the last backward
        assert final == [2, 4, 6, 8]                    # each as soon as its layer's 2 gradients were final
        assert ovl_norm == plain_norm
        for a, b in zip(ovl, plain):
            assert torch.equal(a, b)


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


def _one_rank_with_first_grads() -> tuple[dict, dict, ShardedAdamW]:
    """One rank's parameters (not tp-sharded), a copy of them, and a ZeRO-1 AdamW over them with the first
    gradients in place."""
    params = _params()
    for p in params.values():
        p.tp_dim = None
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = ShardedAdamW(params.items(), None, ADAMW)
    for n, p in params.items():
        p.grad = _grads(0, 0)[n]
    return params, before, opt


def test_nonfinite_gradient_norm_changes_nothing():
    """A non-finite norm, decided on the device: weights, moments and AdamW's step count stay as they were, so the
    next step is exactly a first step of a fresh optimizer. A guarded finite step is bit for bit the unguarded
    one."""
    params, before, opt = _one_rank_with_first_grads()
    params["b.weight"].grad[1, 2] = float("inf")
    norm = opt.step(max_norm=1.0)
    assert isinstance(norm, torch.Tensor) and math.isinf(norm)
    for n, p in params.items():
        assert torch.equal(p, before[n]) and p.grad is None, n
    assert all(not st["exp_avg"].any() and not st["exp_avg_sq"].any() and st["step"] == 0
               for st in opt.optimizer.state.values())
    fresh = {n: nn.Parameter(t.clone()) for n, t in before.items()}
    for p in fresh.values():
        p.tp_dim = None
    fresh_opt = ShardedAdamW(fresh.items(), None, ADAMW)
    for ps in (params, fresh):
        for n, p in ps.items():
            p.grad = _grads(1, 0)[n]
    assert math.isfinite(opt.step(max_norm=1.0))
    fresh_opt.step(max_norm=1.0, guard=False)
    for n in params:
        assert not torch.equal(params[n], before[n]) and torch.equal(params[n], fresh[n]), n


def test_a_nonfinite_loss_changes_nothing():
    """`ok` false (the loss was not finite): nothing is updated, whatever the norm."""
    params, before, opt = _one_rank_with_first_grads()
    assert math.isfinite(opt.step(max_norm=1.0, ok=torch.tensor(False)))
    for n, p in params.items():
        assert torch.equal(p, before[n]), n


def test_wsd_decay_starts_after_warmup():
    opt = OptimizerConfig(lr=1.0, min_lr=0.0, warmup_steps=50, schedule="wsd", decay_fraction=0.8)
    lrs = [lr_at(s, opt, 100) for s in range(100)]
    assert lrs[49] == pytest.approx(1.0)                          # warmup reaches the peak
    assert all(b <= a + 1e-12 for a, b in zip(lrs[49:], lrs[50:]))
    assert lrs[50] > 0.95 and lrs[-1] == pytest.approx(0.0)         # no jump, then decay to min_lr


def _skipping_run(make_opt, capturable: bool = False, steps: int = 5,
                  bad: int = 2) -> tuple[nn.Module, object, nn.Module, torch.optim.AdamW]:
    """`steps` steps of a small model under the optimizer `make_opt(model)` builds, step `bad`'s gradients not
    finite, each step at the schedule's learning rate of its position, nothing set between them (as between two
    logging steps); beside it torch's AdamW on a copy of the model that simply does not take step `bad`. With
    `capturable`, both run torch's capturable AdamW (a GPU's: the step count on the device) on the CPU."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    ref = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    ref.load_state_dict(model.state_dict())
    for p in model.parameters():
        p.tp_dim = None
    ref_opt = torch.optim.AdamW([{"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                                 {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                                lr=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=True, capturable=capturable)
    model, opt = make_opt(model)
    if capturable:
        opt.optimizer.defaults["capturable"] = True
        for g in opt.optimizer.param_groups:
            g["capturable"] = True
    schedule = OptimizerConfig(lr=0.1, min_lr=0.01, warmup_steps=2)
    for step in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        if step == bad:
            x[0, 0] = float("inf")
        lr = lr_at(step, schedule, steps)
        opt.set_lr(lr)
        opt.begin_step(1)
        model(x).square().sum().backward()
        norm = opt.step(0.0)
        assert math.isfinite(norm) == (step != bad), (step, norm)
        if step != bad:
            for g in ref_opt.param_groups:
                g["lr"] = lr
            ref(x).square().sum().backward()
            ref_opt.step()
            ref_opt.zero_grad()
    return model, opt, ref, ref_opt


def _check_as_if_never_taken(model, opt, ref, ref_opt) -> None:
    """Weights, moments and AdamW's step count (bias correction) bit for bit those of the reference."""
    local = [q.to_local() if hasattr(q, "to_local") else q for q in model.parameters()]
    for got, want in zip(local, ref.parameters()):
        assert torch.equal(got.detach(), want.detach())
    (_, _, first), *_ = opt.checkpoint_slots()
    want = ref_opt.state[next(ref.parameters())]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(first[key], want[key]), key
    assert {float(st["step"]) for st in opt.optimizer.state.values()} == {float(want["step"])} == {4.0}


@pytest.fixture
def cpu_capturable(monkeypatch):
    """torch's capturable AdamW allowed on the CPU (it checks for a GPU's device type, nothing more)."""
    import importlib

    monkeypatch.setattr(importlib.import_module("torch.optim.adam"), "_get_capturable_supported_devices",
                        lambda supports_xla=True: ["cuda", "cpu"])


@pytest.mark.parametrize("offload, capturable", [(False, False), (True, False), (False, True)])
def test_a_skipped_step_is_as_if_never_taken_zero1(offload, capturable, cpu_capturable):
    """nan_policy=skip, ZeRO-1 (with and without optimizer offload, and with the step count on the device as on a
    GPU): a step whose gradient norm is not finite leaves no trace, the bias correction of the steps after it
    included, before any logging step; the schedule's position advances (training.nan_policy: the step is taken
    and updates nothing)."""
    def zero1(model):
        return model, ShardedAdamW(model.named_parameters(), None, ADAMW, ReduceSettings(offload=offload))

    _check_as_if_never_taken(*_skipping_run(zero1, capturable))


@pytest.mark.parametrize("capturable", [False, True])
def test_a_skipped_step_is_as_if_never_taken_fsdp(capturable, world_of_one, cpu_capturable):
    """The same with FSDP2's AdamW over fully_shard's DTensor parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    from megalysses.parallel.fsdp import FSDPAdamW, fully_shard

    def fsdp(model):
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        for p in model.parameters():
            p.tp_dim = None
        return model, FSDPAdamW(model, ADAMW)

    _check_as_if_never_taken(*_skipping_run(fsdp, capturable))
