"""Tensor-parallel layers (Megatron style) and the vocab-parallel cross-entropy.

Every parameter carries `tp_dim`: the dimension along which it is split over tp (None = replicated).
With `sequence_parallel` (Megatron's TP sequence sharding) the activations between the parallel
linears are split over tp along the sequence (dim 1): column-parallel layers all-gather them and
row-parallel layers reduce-scatter their output back.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalysses import comm
from megalysses.comm import Group


def mark_tp(param: nn.Parameter, tp_dim: Optional[int]) -> nn.Parameter:
    param.tp_dim = tp_dim
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by rows (output features) over tp: each rank computes out/tp features."""

    def __init__(self, in_features: int, out_features: int, tp_group: Group, bias: bool = False,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        tp = comm.group_size(tp_group)
        if out_features % tp:
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} is not divisible by tp={tp}")
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = mark_tp(nn.Parameter(torch.empty(out_features // tp, in_features)), 0)
        self.bias = mark_tp(nn.Parameter(torch.zeros(out_features // tp)), 0) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.tp_group, self.sequence_parallel)


def column_parallel_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], tp_group: Group,
                           sequence_parallel: bool) -> Tensor:
    """The column-parallel matmul on a weight split by rows over tp (also used by a tied LM head)."""
    return F.linear(column_parallel_input(x, tp_group, sequence_parallel), weight, bias)   # (B, S, out/tp)


def column_parallel_input(x: Tensor, tp_group: Group, sequence_parallel: bool) -> Tensor:
    """What a column-parallel matmul reads: the all-gathered sequence under TP sequence sharding, else x
    itself (its gradient all-reduced over tp)."""
    if sequence_parallel:
        return comm.all_gather_from_tp(x, tp_group, dim=1)     # (B, S/tp, h) -> (B, S, h)
    return comm.copy_to_tp(x, tp_group)                        # (B, S, h), grad all-reduced


def column_parallel_input_grad(dy: Tensor, tp_group: Group, sequence_parallel: bool) -> Tensor:
    """column_parallel_input's backward, for a caller that computes the gradient of what it read (dy) itself:
    reduce-scattered over the sequence under TP sequence sharding, else all-reduced over tp."""
    with torch.no_grad():
        if sequence_parallel:
            return comm.reduce_scatter_to_tp(dy, tp_group, dim=1)  # (B, S, h) -> (B, S/tp, h)
        return comm.reduce_from_tp(dy, tp_group)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by columns (input features) over tp; partial sums reduced over tp."""

    def __init__(self, in_features: int, out_features: int, tp_group: Group, bias: bool = False,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        tp = comm.group_size(tp_group)
        if in_features % tp:
            raise ValueError(f"RowParallelLinear: in_features={in_features} is not divisible by tp={tp}")
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = mark_tp(nn.Parameter(torch.empty(out_features, in_features // tp)), 1)
        self.bias = mark_tp(nn.Parameter(torch.zeros(out_features)), None) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return self.reduce(F.linear(x, self.weight))                      # (B, S, out) partial sum, reduced

    def reduce(self, y: Tensor) -> Tensor:
        """This rank's partial sum y (B, S, out), summed over tp (reduce-scattered over the sequence under TP
        sequence sharding), plus the bias."""
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_tp(y, self.tp_group, dim=1)        # (B, S/tp, out)
            bias = comm.copy_to_tp(self.bias, self.tp_group) if self.bias is not None else None
        else:
            y = comm.reduce_from_tp(y, self.tp_group)                     # (B, S, out)
            bias = self.bias
        return y + bias if bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over tp; each rank looks up its rows, the rest are zero, summed over tp."""

    def __init__(self, vocab_size: int, hidden: int, tp_group: Group, sequence_parallel: bool = False) -> None:
        super().__init__()
        tp, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
        if vocab_size % tp:
            raise ValueError(f"VocabParallelEmbedding: vocab_size={vocab_size} is not divisible by tp={tp}")
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.vocab_start = rank * vocab_size // tp
        self.vocab_end = self.vocab_start + vocab_size // tp
        self.weight = mark_tp(nn.Parameter(torch.empty(vocab_size // tp, hidden)), 0)

    def forward(self, ids: Tensor) -> Tensor:
        if comm.group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)                         # (B, S, h)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_to_tp(x, self.tp_group, dim=1)    # (B, S/tp, h)
        return comm.reduce_from_tp(x, self.tp_group)                     # (B, S, h)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token cross-entropy from logits split over the vocabulary (tp), never gathering them:
    the max, the sum of exponentials and the target logit are all-reduced over tp.
    Backward: softmax minus one-hot on the local vocabulary slice, scaled by the incoming gradient."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, vocab_start: int, group: Group, ignore_index: int) -> Tensor:
        ctx.dtype = logits.dtype
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # (B, S, V/tp)
        vmax = logits.max(dim=-1).values                                  # (B, S)
        comm.all_reduce_(vmax, group, op="max")
        shifted = logits - vmax.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)                                         # (B, S)
        vlocal = logits.shape[-1]
        valid = labels != ignore_index
        target = labels - vocab_start
        in_range = valid & (target >= 0) & (target < vlocal)
        target = target.masked_fill(~in_range, 0)
        target_logit = shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        if comm.group_size(group) > 1:
            both = torch.stack([sum_exp, target_logit])
            comm.all_reduce_(both, group)
            sum_exp, target_logit = both[0], both[1]
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)    # (B, S)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, target, in_range, valid)
        return loss

    @staticmethod
    def backward(ctx, g: Tensor):
        softmax, target, in_range, valid = ctx.saved_tensors
        grad = softmax
        rows = grad.view(-1, grad.shape[-1])
        hit = in_range.view(-1).nonzero().squeeze(-1)
        rows[hit, target.view(-1)[hit]] -= 1.0
        grad = grad * (g * valid).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, tp_group: Group, vocab_start: int = 0,
                                 ignore_index: int = -100) -> Tensor:
    """Per-token losses (B, S) in fp32 from logits (B, S, V/tp); labels equal to ignore_index give 0."""
    return _VocabParallelCrossEntropy.apply(logits, labels, vocab_start, tp_group, ignore_index)
