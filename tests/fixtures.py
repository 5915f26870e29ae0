"""What the tests share: tiny configs as override lists, the rows of a run's metrics.jsonl, relative errors, and
full tensors gathered from the ranks' shards.

The override lists compose: `MOCK_32` (mock data, 32 tokens, a vocabulary of 128) with a model (`SMALL_MODEL`,
`PARITY_MODEL`) and a batch. Spawned ranks import this module by name, as they import the test files.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

MOCK_32 = ["data.mock=true", "data.seq_len=32", "model.vocab_size=128"]
SMALL_MODEL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=4"]
# the parity model: 8 query heads on 2 KV heads (KV replication at sp 4, one KV head a chunk in 2 head chunks)
PARITY_MODEL = ["model.hidden_size=64", "model.num_layers=4", "model.num_heads=8", "model.num_kv_heads=2",
                "model.attention_backend=sdpa"]
# a 2-layer model, 2 sequences a step, a log row every step: the command-line and profiler runs
TINY = MOCK_32 + SMALL_MODEL + ["training.global_batch_size=2", "training.micro_batch_size=1",
                                "logging.log_interval=1"]
# the training-parity run's shape: 4 sequences a step of one-sequence micro-batches
PARITY = MOCK_32 + PARITY_MODEL + ["training.micro_batch_size=1", "training.global_batch_size=4"]
# the training-parity run: 3 steps, validation at the last, gradients in several buckets
TRAIN_PARITY = PARITY + [
    "training.train_steps=3", "optimizer.lr=1e-3", "optimizer.warmup_steps=1", "optimizer.grad_clip=0.5",
    "logging.log_interval=1", "parallel.timeout_seconds=60",
    # Adam moves an element by ~lr * g / (|g| + eps): where |g| is near eps, fp32 reassociation noise in g
    # becomes noise in the weights, and a few such elements dominate a tensor's error. eps = 1e-6 keeps
    # the final-weight comparison about the layouts (at 1e-8 one o_proj reads 5e-5 for that reason alone).
    "optimizer.eps=1e-6",
    "parallel.grad_bucket_elements=5000",   # several buckets, reduce-scatters overlapped with the backward
    "training.eval_interval=3", "training.eval_steps=1",   # validation (with the layout's sharding) at step 3
]


def with_model(overrides: list[str], **model) -> list[str]:
    """`overrides` with model fields replaced (`with_model(PARITY, num_layers=2)`), each key named once."""
    prefixes = tuple(f"model.{k}=" for k in model)
    return [o for o in overrides if not o.startswith(prefixes)] + [f"model.{k}={v}" for k, v in model.items()]


# ----------------------------------------------------------------------------- metrics.jsonl

def metrics(run_dir: str | Path) -> list[dict]:
    """Every row of a run's metrics.jsonl, in order."""
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def series(run_dir: str | Path, key: str) -> list:
    """The values of `key` in the rows that have it ("loss", "grad_norm", "val_loss", ...)."""
    return [row[key] for row in metrics(run_dir) if key in row]


def step_rows(run_dir: str | Path) -> list[dict]:
    """The rows of training steps (those with a loss)."""
    return [row for row in metrics(run_dir) if "loss" in row]


def losses(run_dir: str | Path) -> list[float]:
    """The training loss of every logged step."""
    return series(run_dir, "loss")


# ----------------------------------------------------------------------------- relative errors

def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest element-wise difference over the largest element of the reference `b`."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error in the Frobenius norm. (Adam divides each element by its own gradient scale, so
    the fp32 reassociation noise of near-zero gradients shows up element-wise, not in the norm.)"""
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


# ----------------------------------------------------------------------------- full tensors from shards

def full_gradient(grid, p: torch.nn.Parameter) -> torch.Tensor:
    """The gradient of the whole parameter: summed over the grad group (dp x sp), concatenated over tp
    along the parameter's `tp_dim`. A collective: every rank of the grid calls it."""
    g = p.grad.clone()
    if grid.grad_group is not None:
        torch.distributed.all_reduce(g, group=grid.grad_group)
    tp_dim = getattr(p, "tp_dim", None)
    if tp_dim is None or grid.tp_size == 1:
        return g
    parts = [torch.empty_like(g) for _ in range(grid.tp_size)]
    torch.distributed.all_gather(parts, g.contiguous(), group=grid.tp_group)
    return torch.cat(parts, dim=tp_dim)


def full_over_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's tp shard of a parameter; FSDP's dim-0 chunks are gathered over the grad group first."""
    p = p.detach()
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).clone()


def rank_weights(model: torch.nn.Module, grid) -> dict:
    """What a rank reports of its model for `full_weights`: its place in the grid and its tp shards."""
    return {"tp_rank": grid.tp_rank, "tp": grid.tp_size, "dp_sp": (grid.dp_rank, grid.sp_rank),
            "params": {n: (full_over_grad(p), getattr(p, "tp_dim", None)) for n, p in model.named_parameters()}}


def full_weights(results: list) -> dict:
    """Reassemble full tensors from the tp shards (`rank_weights`) of the (dp=0, sp=0) ranks of every stage."""
    pieces: dict = {}
    for r in results:
        if r["dp_sp"] != (0, 0):
            continue
        for name, (t, tp_dim) in r["params"].items():
            pieces.setdefault(name, {})[r["tp_rank"]] = (t, tp_dim)
    full = {}
    for name, by_rank in pieces.items():
        tp_dim = by_rank[0][1]
        parts = [by_rank[k][0] for k in sorted(by_rank)]
        full[name] = parts[0] if tp_dim is None or len(parts) == 1 else torch.cat(parts, dim=tp_dim)
    return full
