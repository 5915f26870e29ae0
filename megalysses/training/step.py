"""One optimizer step and one validation pass over a global batch, at any (tp, sp, dp, pp) layout.

The loss is the sum of token losses over the global batch divided by the GLOBAL number of valid
tokens (labels != -100), counted over the grad (dp x sp) group before the forward; the number that
is returned (and logged) is that same number. With loss weights (data.loss_average: document) it is the
weighted sum divided by the global sum of the weights: the mean over documents of their mean token loss.

A training step reads nothing back to the host: the token count, the loss scale, the loss, the gradient norm,
the clipping and a non-finite step's skip stay on the device, in StepResult's one tensor, which the loop reads
on its logging steps (training/loop.py). An evaluation reads its loss back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from megalysses import comm
from megalysses.grid import ParallelGrid
from megalysses.parallel.interleaved import VirtualStages, run_interleaved
from megalysses.parallel.pipeline import Batch, Pipe, forward_backward_1f1b, forward_backward_local, forward_only
from megalysses.parallel.fsdp import reshard
from megalysses.parallel.optimizer import Optimizer


@dataclass
class StepResult:
    """One step's figures, left on the device: [loss, token count, gradient norm, not finite] (float64; the
    norm is NaN when the loss is not finite, "not finite" 1.0 when the loss or the norm is not, a step that
    updated nothing with training.nan_policy=skip). The properties read one back (a host synchronisation)."""

    figures: Tensor

    @property
    def loss(self) -> float:
        return float(self.figures[0])

    @property
    def grad_norm(self) -> float:
        return float(self.figures[2])

    @property
    def skipped(self) -> bool:
        return bool(self.figures[3])


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf and training.nan_policy is 'abort'."""


def global_token_count(microbatches: list[Batch], grid: ParallelGrid) -> Tensor:
    """What the loss divides by: the global count of valid labels, or, with loss weights (data.loss_average
    document), their global sum (the number of documents)."""
    device = microbatches[0]["labels"].device
    if "loss_weights" in microbatches[0]:
        count = sum((mb["loss_weights"].sum(dtype=torch.float64) for mb in microbatches),
                    torch.zeros((), dtype=torch.float64, device=device))
    else:
        count = sum(((mb["labels"] != -100).sum() for mb in microbatches),
                    torch.zeros((), dtype=torch.long, device=device)).to(torch.float64)
    if grid.grad_group is not None:
        comm.all_reduce_(count, grid.grad_group)
    return count


def _global_loss(total: Tensor, grid: ParallelGrid, device: torch.device) -> Tensor:
    """Sum the scaled per-rank losses over grad, then share the last stage's value along the pipeline (float64,
    on the device)."""
    t = total.to(device=device, dtype=torch.float64)
    if grid.grad_group is not None:
        comm.all_reduce_(t, grid.grad_group)
    if grid.pp_group is not None:
        comm.all_reduce_(t, grid.pp_group)   # only the last stage contributes
    return t


def _pipe(model: torch.nn.Module, mb: Batch, grid: ParallelGrid, dtype: torch.dtype) -> Pipe:
    """This rank's pipeline, its activations shaped (B, S/sp or S/(sp*tp), h) in `dtype` on mb's device."""
    b, s = mb["position_ids"].shape
    shape = (b, s // grid.tp_size if model.groups.sequence_parallel else s, model.cfg.hidden_size)
    return Pipe(grid.pp_rank, grid.pp_size, grid.stage_rank, shape, dtype, mb["labels"].device)


def train_step(model: torch.nn.Module, opt: Optimizer, microbatches: list[Batch], grid: ParallelGrid, *,
               lr: float, grad_clip: float, dtype: torch.dtype, nan_policy: str = "abort") -> StepResult:
    """One optimizer step over `microbatches`, nothing read back to the host. A non-finite loss or gradient norm
    updates nothing (decided on the device) unless `nan_policy` is "abort": then the loop stops at its next
    read-back, before anything is saved."""
    device = microbatches[0]["labels"].device
    count = global_token_count(microbatches, grid)
    scale = count.clamp(min=1.0).reciprocal().float()      # what 1.0 / max(count, 1) rounds to in fp32
    model.train()
    opt.begin_step(len(microbatches))
    if grid.pp_size == 1:
        total = forward_backward_local(model, microbatches, scale)
    elif isinstance(model, VirtualStages):
        total = run_interleaved(model, microbatches, scale, _pipe(model, microbatches[0], grid, dtype))
    else:
        total = forward_backward_1f1b(model, microbatches, scale, _pipe(model, microbatches[0], grid, dtype))
    loss = _global_loss(total, grid, device)
    finite = torch.isfinite(loss)
    opt.set_lr(lr)
    norm = opt.step(grad_clip, finite, guard=nan_policy != "abort")   # not finite: nothing updated
    norm = torch.where(finite, norm.to(torch.float64), math.nan)
    bad = ~(finite & torch.isfinite(norm))
    return StepResult(torch.stack([loss, count, norm, bad.to(torch.float64)]))


@torch.no_grad()
def evaluate(model: torch.nn.Module, microbatches: list[Batch], grid: ParallelGrid, dtype: torch.dtype) -> float:
    """Validation loss with the same sharding as training (sequence parallelism included)."""
    device = microbatches[0]["labels"].device
    count = global_token_count(microbatches, grid)
    scale = 1.0 / max(count.item(), 1.0)
    model.eval()
    if isinstance(model, VirtualStages):
        total = run_interleaved(model, microbatches, scale, _pipe(model, microbatches[0], grid, dtype),
                                forward_only=True)
    else:
        total = forward_only(model, microbatches, scale, _pipe(model, microbatches[0], grid, dtype))
    reshard(model)
    model.train()
    return _global_loss(total, grid, device).item()
