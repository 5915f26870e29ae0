"""One optimizer step and one validation pass over a global batch, at any (tp, sp, dp, pp) layout.

The loss is the sum of token losses over the global batch divided by the GLOBAL number of valid
tokens (labels != -100), counted over the grad (dp x sp) group before the forward; the number that
is returned (and logged) is that same number. With loss weights (data.loss_average: document) it is the
weighted sum divided by the global sum of the weights: the mean over documents of their mean token loss.

A training step reads nothing back to the host: the token count, the loss scale, the loss, the gradient norm,
the clipping and a non-finite step's skip stay on the device, in StepResult's one tensor, which the loop reads
on its logging steps (training/loop.py). An evaluation reads its loss back.

Each rank also measures its busy time (BusyClock, as the loop sets it going): the time it works between blocking
collectives that every rank of the gradient group leaves together, the ones where the ranks it keeps waiting wait
for it. A step first blocks at the global token count's all-reduce; then, in a layout with neither tp nor sp, at
the loss's all-reduce after the forward and the backward. With tp or sp the ranks of a tp x sp group block
inside the forward and the backward at every layer, so only the time before the token count is counted there.
Where other collectives block inside the forward and the backward (FSDP's gathers, a pipeline's sends and
receives, ZeRO's bucket reductions on gloo), the ranks that wait in them count that wait as busy: it narrows
the gap a straggler is found by (and with a pipeline, the rank named may be one of the straggler's pipeline).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Iterator, Optional

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


class BusyClock:
    """This rank's busy time: the seconds it works between leaving a blocking collective every rank of the
    gradient group takes part in (`start`: the previous step returned, the logging step's read-back, the token
    count) and entering the next (`stop`: the token count, the loss). Every rank leaves such a collective
    together, so the rank that arrives last at the next one, the straggler, counts the most (the others wait
    for it there, uncounted). The loop starts it after its own evaluation and checkpoints too, leaving them out
    as tokens/s does.

    On the CPU it is host time (time.perf_counter: a gloo collective blocks the host). On a GPU the host runs
    ahead of the device, so it is device time instead: a pair of CUDA timing events recorded on the current
    stream at `start` and `stop`, read at the next logging step (Event.query, elapsed_time: no wait); a pair the
    device has not finished by then is counted at the logging step after. Neither adds a host synchronisation."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.since: Optional[float | torch.cuda.Event] = None
        self.seconds = 0.0
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _mark(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        """This rank has left a collective with every rank: its busy time runs (again)."""
        self.since = self._mark()

    def stop(self) -> None:
        """This rank enters a blocking collective: the busy time since `start` is counted (none without one)."""
        if self.since is None:
            return
        end = self._mark()
        if self.cuda:
            self.pending.append((self.since, end))
        else:
            self.seconds += end - self.since
        self.since = None

    def take(self, steps: int) -> Optional[float]:
        """The busy seconds counted since the last take, a step of `steps` (None: none counted)."""
        waiting = []
        for start, end in self.pending:
            if end.query():
                self.seconds += start.elapsed_time(end) / 1e3
            else:
                waiting.append((start, end))
        self.pending = waiting
        seconds, self.seconds = self.seconds, 0.0
        return seconds / steps if seconds and steps else None

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """train_step inside starts and stops this clock at its blocking collectives."""
        _clocks.append(self)
        try:
            yield
        finally:
            _clocks.remove(self)


_clocks: list[BusyClock] = []


def _busy(working: bool, grid: ParallelGrid) -> None:
    """Start (`working`) or stop the BusyClock measuring this step, if any; a step of a layout with tp or sp
    stops it at the token count for good (its ranks block inside the forward and the backward)."""
    for clock in _clocks:
        if not working:
            clock.stop()
        elif grid.tp_size == 1 and grid.sp_size == 1:
            clock.start()


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


def pipe_of(model: torch.nn.Module, mb: Batch, grid: ParallelGrid, dtype: torch.dtype) -> Pipe:
    """This rank's pipeline for micro-batches shaped as `mb`, its activations (B, S/sp, h), or (B, S/(sp*tp), h)
    with TP sequence sharding, in `dtype` on mb's device (the training step's, validation's, the long-context
    evaluation's)."""
    b, s = mb["position_ids"].shape
    shape = (b, s // grid.tp_size if model.groups.sequence_parallel else s, model.cfg.hidden_size)
    return Pipe(grid.pp_rank, grid.pp_size, grid.stage_rank, shape, dtype, mb["labels"].device)


def train_step(model: torch.nn.Module, opt: Optimizer, microbatches: list[Batch], grid: ParallelGrid, *,
               lr: float, grad_clip: float, dtype: torch.dtype, nan_policy: str = "abort") -> StepResult:
    """One optimizer step over `microbatches`, nothing read back to the host. A non-finite loss or gradient norm
    updates nothing (decided on the device) unless `nan_policy` is "abort": then the loop stops at its next
    read-back, before anything is saved."""
    device = microbatches[0]["labels"].device
    _busy(False, grid)
    count = global_token_count(microbatches, grid)
    _busy(True, grid)
    scale = count.clamp(min=1.0).reciprocal().float()      # what 1.0 / max(count, 1) rounds to in fp32
    model.train()
    opt.begin_step(len(microbatches))
    if grid.pp_size == 1:
        total = forward_backward_local(model, microbatches, scale)
    elif isinstance(model, VirtualStages):
        total = run_interleaved(model, microbatches, scale, pipe_of(model, microbatches[0], grid, dtype))
    else:
        total = forward_backward_1f1b(model, microbatches, scale, pipe_of(model, microbatches[0], grid, dtype))
    _busy(False, grid)
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
        total = run_interleaved(model, microbatches, scale, pipe_of(model, microbatches[0], grid, dtype),
                                forward_only=True)
    else:
        total = forward_only(model, microbatches, scale, pipe_of(model, microbatches[0], grid, dtype))
    reshard(model)
    model.train()
    return _global_loss(total, grid, device).item()
