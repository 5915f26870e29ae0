"""Forward/backward over micro-batches: plain accumulation (pp=1), the 1F1B pipeline schedule
(interleaved virtual stages: interleaved.py), and the forward-only schedule of validation.

1F1B on stage p of P with M micro-batches: min(P-p-1, M) warm-up forwards, then alternate one
forward and one backward, then the remaining backwards. Activations travel between neighbouring
stages point-to-point, still sequence-sharded over sp; as soon as a stage has sent an output, its
storage is released (the autograd graph behind it stays until the backward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.autograd import Variable

from megalysses.comm import send_recv
from megalysses.kernels.attention import documents_of

Batch = dict[str, Tensor]


@dataclass(frozen=True)
class Pipe:
    """This rank's place in the pipeline and what travels between its stages: stage pp_rank of pp_size (the grid's),
    the global rank holding each stage, and the shape, dtype and device of the activation buffers."""

    pp_rank: int
    pp_size: int
    rank_of_stage: Callable[[int], int]
    hidden_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def buffer(self) -> Tensor:
        """An empty activation (or activation gradient) buffer to receive into."""
        return torch.empty(self.hidden_shape, dtype=self.dtype, device=self.device)


def stage_forward(stage: torch.nn.Module, mb: Batch, x: Optional[Tensor], scale: float | Tensor,
                  scores: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """The scaled loss (fp32) on the last stage (with `scores`, each token's loss and greedy hit instead:
    GPTStage.forward); elsewhere the hidden states, in the compute dtype (the dtype of the pipeline buffers)."""
    out = stage(mb["input_ids"] if stage.first else x, mb["position_ids"], doc_ids=documents_of(mb),
                labels=mb["labels"] if stage.last else None,
                loss_weights=mb.get("loss_weights") if stage.last else None, scores=scores and stage.last)
    return out * scale if stage.last and not scores else out


def forward_backward_local(stage: torch.nn.Module, microbatches: list[Batch], scale: float | Tensor) -> Tensor:
    """pp=1: forward + backward of each micro-batch, gradients accumulate. Returns the summed scaled loss
    (on the batch's device: no host synchronisation between micro-batches)."""
    total = torch.zeros((), dtype=torch.float32, device=microbatches[0]["labels"].device)
    for mb in microbatches:
        loss = stage_forward(stage, mb, None, scale)
        loss.backward()
        total += loss.detach()
    return total


def release_output(t: Tensor) -> None:
    """Free an output's storage after it was sent; its grad_fn is kept for the backward."""
    t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


def stage_backward(out: Tensor, grad: Optional[Tensor]) -> None:
    """The backward of one stage's output: the loss on the last stage, else from the next stage's gradient."""
    if grad is None:                 # last stage: out is the loss
        out.backward()
    else:                            # bypass the shape check against the released storage
        Variable._execution_engine.run_backward((out,), (grad,), False, False, (), True, True)


def forward_backward_1f1b(stage: torch.nn.Module, microbatches: list[Batch], scale: float | Tensor,
                          pipe: Pipe) -> Tensor:
    """One step of 1F1B on this stage. Returns the summed scaled loss (non-zero on the last stage only)."""
    pp_rank, pp_size, rank_of_stage = pipe.pp_rank, pipe.pp_size, pipe.rank_of_stage
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    prev = None if first else rank_of_stage(pp_rank - 1)
    nxt = None if last else rank_of_stage(pp_rank + 1)
    M = len(microbatches)
    warmup = min(pp_size - pp_rank - 1, M)
    total = torch.zeros((), dtype=torch.float32, device=pipe.device)
    pending: list[tuple[Optional[Tensor], Tensor]] = []
    buf = pipe.buffer

    def recv_forward() -> Optional[Tensor]:
        if first:
            return None
        x = buf()
        send_recv(recvs=[(x, prev)])
        return x.requires_grad_()

    def run_forward(i: int, x: Optional[Tensor]) -> Tensor:
        nonlocal total
        out = stage_forward(stage, microbatches[i], x, scale)
        if last:
            total += out.detach()
        return out

    def run_backward(x: Optional[Tensor], out: Tensor, grad: Optional[Tensor]) -> Optional[Tensor]:
        stage_backward(out, grad)
        return None if x is None else x.grad

    for i in range(warmup):
        x = recv_forward()
        out = run_forward(i, x)
        send_recv(sends=[(out, nxt)])
        release_output(out)
        pending.append((x, out))

    x = recv_forward() if M - warmup > 0 else None
    for i in range(M - warmup):
        out = run_forward(warmup + i, x)
        grad = None
        if not last:
            grad = buf()
            send_recv(sends=[(out, nxt)], recvs=[(grad, nxt)])
            release_output(out)
        pending.append((x, out))
        x0, out0 = pending.pop(0)
        gx = run_backward(x0, out0, grad)
        if i == M - warmup - 1:
            x = None
            if not first:
                send_recv(sends=[(gx, prev)])
        elif not first:
            x = buf()
            send_recv(sends=[(gx, prev)], recvs=[(x, prev)])
            x.requires_grad_()

    for _ in range(warmup):
        x0, out0 = pending.pop(0)
        grad = buf()
        send_recv(recvs=[(grad, nxt)])
        gx = run_backward(x0, out0, grad)
        if not first:
            send_recv(sends=[(gx, prev)])
    return total


def forward_only(stage: torch.nn.Module, microbatches: list[Batch], scale: float, pipe: Pipe,
                 scores: Optional[list] = None) -> Tensor:
    """Forward only (validation), micro-batch by micro-batch through the pipeline; the summed scaled loss on
    the last stage (zero elsewhere). With `scores` (a list), the last stage appends each micro-batch's per-token
    (losses, greedy hits) to it instead."""
    total = torch.zeros((), dtype=torch.float32, device=pipe.device)
    pp_rank, pp_size, rank_of_stage = pipe.pp_rank, pipe.pp_size, pipe.rank_of_stage
    prev = rank_of_stage(pp_rank - 1) if pp_rank > 0 else None
    nxt = rank_of_stage(pp_rank + 1) if pp_rank < pp_size - 1 else None
    for mb in microbatches:
        x = None
        if prev is not None:
            x = pipe.buffer()
            send_recv(recvs=[(x, prev)])
        out = stage_forward(stage, mb, x, scale, scores is not None)
        if nxt is not None:
            send_recv(sends=[(out, nxt)])
        elif scores is not None:
            scores.append(out)
        else:
            total += out.float()
    return total
