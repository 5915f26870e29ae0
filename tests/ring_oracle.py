"""The ring of ring attention on one device: what the r ranks of a ring compute (the same blocks, kernels
and merge as megalysses.parallel.ring), without communication. The oracle the ring tests compare
against, and the block-wise attention the GPU tier times against single-pass attention."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from megalysses.degrees import Degrees
from megalysses.kernels.attention import check_backend
from megalysses.kernels.block_attention import MergedRows
from megalysses.parallel.ring import BlockKernel, RingMask, backward_block, forward_blocks, ring_schedule
from megalysses.parallel.sequence_layout import SequenceLayout


class _Blockwise(torch.autograd.Function):
    """What the r ranks of a ring compute, on one device without communication: for each ring rank, the
    same blocks, kernels and merge as `_RingAttention`. Forward and backward as there."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, masks: list, kernel: BlockKernel) -> Tensor:
        r = len(masks)
        qs, kvs = q.chunk(r, dim=1), torch.stack([k, v]).chunk(r, dim=2)
        outs, lses, auxes = [], [], []
        for i, mask in enumerate(masks):
            schedule = ring_schedule(i, r)
            out, lse, aux = forward_blocks(qs[i], ((j, kvs[j]) for j in schedule), mask, kernel)
            outs.append(out.to(q.dtype))
            lses.append(lse)
            auxes.append(aux)
        out = torch.cat(outs, dim=1)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.masks, ctx.kernel, ctx.auxes = masks, kernel, auxes
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, *lses = ctx.saved_tensors
        r = len(ctx.masks)
        qs, outs, douts = q.chunk(r, dim=1), out.chunk(r, dim=1), dout.chunk(r, dim=1)
        kvs = torch.stack([k, v]).chunk(r, dim=2)
        dqs = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in qs]
        dkvs = [torch.zeros(x.shape, dtype=torch.float32, device=q.device) for x in kvs]
        for i, mask in enumerate(ctx.masks):
            for j in ring_schedule(i, r):
                cols, gk, gv = backward_block(dqs[i], qs[i], kvs[j], MergedRows(outs[i], lses[i], douts[i]), mask, j,
                                              ctx.kernel, ctx.auxes[i])
                dkvs[j][0][:, cols] += gk
                dkvs[j][1][:, cols] += gv
        dkv = torch.cat(dkvs, dim=2)
        return torch.cat(dqs, dim=1).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def blockwise_attention(q: Tensor, k: Tensor, v: Tensor, ring_size: int, doc_ids: Optional[Tensor] = None,
                        backend: str = "sdpa", scale: Optional[float] = None, window: int = 0) -> Tensor:
    """Causal attention over a whole sequence computed as a ring of `ring_size` ranks would, on one device:
    q (B, S, Hq, D), k, v (B, S, Hkv, D) in natural order -> (B, S, Hq, D), with a sliding window of `window`
    positions (0: none). For tests and for timing the block-wise kernels and merge against single-pass
    attention; S must be a multiple of 2 * ring_size."""
    S = q.shape[1]
    layout = SequenceLayout(Degrees(sp=ring_size, ring=ring_size))
    masks = [RingMask(doc_ids, i, ring_size, S, q.device) for i in range(ring_size)]
    order = torch.from_numpy(_zigzag_order(layout, S)).to(q.device)   # ring rank 0's block, then 1's, ...
    zq, zk, zv = (t.index_select(1, order) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    check_backend(backend, q, doc_ids is not None, ring=True, window=window > 0)
    out = _Blockwise.apply(zq, zk, zv, masks, BlockKernel(backend, scale, window))
    return torch.empty_like(out).index_copy(1, order, out)


def _zigzag_order(layout: SequenceLayout, seq_len: int) -> np.ndarray:
    """Global positions of every ring rank's block, ring rank 0 first (a permutation of the sequence)."""
    return np.concatenate([layout.ring_positions(seq_len, i) for i in range(layout.degrees.ring)])
