"""The LM head and the cross-entropy in one step, vocab-parallel and tiled: full logits never exist.

    loss_sum = linear_cross_entropy(x, weight, labels, tp_group, vocab_start, vocab_size, chunk_tokens)
    loss_sum = linear_cross_entropy(..., weights=w)     # sum over tokens of w * loss (w = 0 where ignored)

x (N, h) are the final hidden states (this tp rank's copy, inside the tensor-parallel region), weight
(V/tp, h) this rank's rows of the (padded) vocabulary, labels (N,) global token ids (-100 = ignored).
The tokens are processed in tiles of `chunk_tokens`: a tile's logits (chunk, V/tp) are computed in
fp32, the softmax statistics are all-reduced over tp (max, sum of exponentials, target logit), and,
when a gradient will be needed, the tile's gradients are computed at once: d logits = softmax -
one-hot, dx = d logits @ W, dW += d logits^T @ x (fp32). The backward only scales what the forward
stored by the incoming gradient. So one tile of logits is alive at a time and the LM head costs three
matmuls per token, not the four of a recomputed (checkpointed) tile.

Vocabulary rows at or past `vocab_size` (padding) are left out of the softmax: their logits are -inf.
The reference is logits = x @ W^T followed by tensor_parallel.vocab_parallel_cross_entropy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megalysses import comm
from megalysses.comm import Group

IGNORE_INDEX = -100


def default_chunk_tokens(vocab_local: int, budget_bytes: int = 1 << 29) -> int:
    """Tokens per tile so that one tile's fp32 logits and their gradient stay within `budget_bytes`."""
    return max(128, budget_bytes // (8 * max(vocab_local, 1)))


@dataclass(frozen=True)
class VocabShard:
    """The settings of the head's tiles that are not tensors: the tp group the vocabulary is split over, this
    rank's first row and the true vocabulary size (rows from it on are padding), and the tokens per tile."""

    group: Group
    vocab_start: int
    vocab_size: int
    chunk: int


def _tile(x: Tensor, weight: Tensor, labels: Tensor, shard: VocabShard, with_grad: bool,
          weights: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Losses (n,) fp32, whether each label is the argmax of its row (n,) bool, and, with_grad, d loss / d logits
    (n, V/tp) in x's dtype for one tile; each token's loss (and its gradient) times its weight, when weights (n,)
    are given. The label's shifted logit is 0 exactly when it is the row's maximum."""
    group, vocab_start, vocab_size = shard.group, shard.vocab_start, shard.vocab_size
    logits = (x @ weight.t()).float()                                        # (n, V/tp)
    vlocal = logits.shape[-1]
    if vocab_start + vlocal > vocab_size:                                    # padded rows on this rank
        logits[:, max(vocab_size - vocab_start, 0):] = float("-inf")
    vmax = logits.max(dim=-1).values                                         # (n,)
    comm.all_reduce_(vmax, group, op="max")
    logits.sub_(vmax.unsqueeze(-1))                                          # shifted, in place
    valid = labels != IGNORE_INDEX
    target = labels - vocab_start
    mine = valid & (target >= 0) & (target < vlocal)                        # labels in this rank's rows
    rows = mine.nonzero().squeeze(-1)
    cols = target[rows]
    target_logit = torch.zeros_like(vmax)
    target_logit[rows] = logits[rows, cols]
    sum_exp = logits.exp_().sum(dim=-1)                                      # (n,), exp in place
    both = torch.stack([sum_exp, target_logit])
    comm.all_reduce_(both, group)
    sum_exp, target_logit = both[0], both[1]
    loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)           # -log softmax[target]
    top = valid & (target_logit == 0)                                        # the label is the greedy choice
    scale = valid if weights is None else weights.float() * valid
    if weights is not None:
        loss = loss * scale
    if not with_grad:
        return loss, top, None
    probs = logits.div_(sum_exp.unsqueeze(-1))                               # softmax, in place
    probs[rows, cols] -= 1.0
    probs.mul_(scale.unsqueeze(-1))
    return loss, top, probs.to(x.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: the summed cross-entropy of x @ W^T over tiles (and, if needed, the gradients of x and W).
    Backward: the stored gradients times the incoming scalar gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, labels: Tensor, shard: VocabShard,
                weights: Tensor | None = None) -> Tensor:
        with_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        chunk = shard.chunk
        n = x.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if with_grad else None
        grad_w = None
        for lo in range(0, n, chunk):
            xs = x[lo:lo + chunk]
            loss, _, dlogits = _tile(xs, weight, labels[lo:lo + chunk], shard, with_grad,
                                     None if weights is None else weights[lo:lo + chunk])
            total += loss.sum()
            if with_grad:
                torch.matmul(dlogits, weight, out=grad_x[lo:lo + chunk])            # (n, h)
                dw = dlogits.t() @ xs                                               # (V/tp, h)
                if chunk >= n:
                    grad_w = dw
                else:
                    grad_w = dw.float() if grad_w is None else grad_w.add_(dw.float())
        if with_grad:
            ctx.save_for_backward(grad_x, grad_w.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, g: Tensor):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * g.to(grad_x.dtype), grad_w * g.to(grad_w.dtype), None, None, None


def linear_cross_entropy(x: Tensor, weight: Tensor, labels: Tensor, group: Group = None, vocab_start: int = 0,
                         vocab_size: int | None = None, chunk_tokens: int = 0, weights: Tensor | None = None) -> Tensor:
    """The sum over tokens of -log softmax(x @ W^T)[label] (fp32 scalar), labels == -100 excluded; with
    weights (shaped as labels), the sum of each token's loss times its weight.

    x (..., h) inside the tensor-parallel region, weight (V/tp, h), labels (...) global ids; vocab_size
    is the true vocabulary (rows from it on are padding; default: all of weight's rows, over tp);
    chunk_tokens 0 picks tiles whose fp32 logits stay under 512 MiB."""
    h = x.shape[-1]
    if labels.shape != x.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match the tokens of x {tuple(x.shape)}")
    if weights is not None and weights.shape != labels.shape:
        raise ValueError(f"loss weights {tuple(weights.shape)} do not match the labels {tuple(labels.shape)}")
    vocab_size = weight.shape[0] * comm.group_size(group) if vocab_size is None else vocab_size
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    return _LinearCrossEntropy.apply(x.reshape(-1, h), weight, labels.reshape(-1),
                                     VocabShard(group, vocab_start, vocab_size, chunk),
                                     None if weights is None else weights.reshape(-1))


@torch.no_grad()
def token_scores(x: Tensor, weight: Tensor, labels: Tensor, group: Group = None, vocab_start: int = 0,
                 vocab_size: int | None = None, chunk_tokens: int = 0) -> tuple[Tensor, Tensor]:
    """Per token of `labels`' shape: the loss -log softmax(x @ W^T)[label] (fp32) and whether the label is the
    argmax of its logits (the greedy choice; a tie counts), both 0 where the label is -100. Only the rows with a
    label reach the head, in tiles as linear_cross_entropy: scoring a few answer positions of a long sequence
    computes their logits alone. Arguments as linear_cross_entropy's; the same labels on every tp rank."""
    h = x.shape[-1]
    x2, labels1 = x.reshape(-1, h), labels.reshape(-1)
    losses = torch.zeros(labels1.shape, dtype=torch.float32, device=x.device)
    top = torch.zeros(labels1.shape, dtype=torch.bool, device=x.device)
    rows = (labels1 != IGNORE_INDEX).nonzero().squeeze(-1)
    vocab_size = weight.shape[0] * comm.group_size(group) if vocab_size is None else vocab_size
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    for lo in range(0, len(rows), chunk):
        sel = rows[lo:lo + chunk]
        loss, hit, _ = _tile(x2[sel], weight, labels1[sel], VocabShard(group, vocab_start, vocab_size, chunk), False)
        losses[sel], top[sel] = loss, hit
    return losses.view(labels.shape), top.view(labels.shape)
