"""Ring attention: exact causal attention over a sequence split across the ring group.

Each of the r ring ranks holds the queries, keys and values of its block of S/r positions (after the
Ulysses all-to-all, for its share of the heads). The K/V blocks travel around the ring by p2p while
every rank attends its queries to the block it holds; the partial results are merged with their
log-sum-exp (online softmax), so the result is exact.

Zigzag partition (parallel/sequence_layout.py): the sequence is cut into 2r chunks of c = S/(2r) and
ring rank i holds chunks i and 2r-1-i. Against the block of ring rank j:
    j == i   the whole block, causal (the queries and keys are the same positions, in order)
    j <  i   every query of i sees the first chunk of j (j < i), none of its second (2r-1-j > 2r-1-i)
    j >  i   only the second chunk of i (2r-1-i > j) sees, and it sees all of j
so every step but the first costs half a block, on every rank: the causal work is balanced.

Packed documents: the full-sequence doc_ids, which every rank already has, give the document of every
position, so each rank knows the mask of every block it will receive (`RingMask`, built once per step
and shared by every layer); nothing but K and V travels. A sliding window is masked the same way, from
the blocks' positions in the whole sequence.

Forward (r steps): post the exchange that brings the next K/V block (send to rank i+1, receive from
i-1), attend to the current block, merge, wait. Backward: the K/V blocks travel the same way again;
each rank adds its dQ and its part of the held block's dK/dV, and the dK/dV accumulators travel one
step behind the blocks, so after the last step one more hop brings each home (r-1 K/V hops and r dK/dV
hops). Only q, k, v, the output and the LSE of the local block are kept for the backward.

    mask = RingMask(doc_ids, ring_rank, ring_size, seq_len)           # once per step
    out = ring_attention(q, k, v, ring_group, mask, backend)          # (B, S/r, Hq, D)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
from torch import Tensor

from megalysses import comm
from megalysses.comm import Group
from megalysses.degrees import Degrees
from megalysses.kernels.attention import check_backend
from megalysses.kernels.block_attention import (AttentionBlock, MergedRows, block_attention, block_attention_backward,
                                                merge_block)
from megalysses.parallel.sequence_layout import SequenceLayout


class RingMask:
    """The blocks ring rank `ring_rank` attends to over a (padded) sequence of `seq_len` positions: which
    rows and columns of each block take part and which pairs may attend (causal, same document).

    doc_ids: (B, seq_len) document id of every position of the full sequence, non-decreasing along each row as
    the data loader makes them (FlexAttention's block masks rely on it), or None (plain causal); block:
    FlexAttention's block-mask block size (each ring step's block mask is built on its first use and kept with
    the step's other masks: the layers, head chunks and backward of the step share them)."""

    def __init__(self, doc_ids: Optional[Tensor], ring_rank: int, ring_size: int, seq_len: int,
                 device: Optional[torch.device] = None, block: int = 128) -> None:
        if seq_len % (2 * ring_size):
            raise ValueError(f"ring attention: sequence length {seq_len} is not a multiple of 2 * ring = "
                             f"{2 * ring_size} (zigzag chunks); pad it (SequenceLayout.padded_len)")
        if doc_ids is not None and doc_ids.shape[-1] != seq_len:
            raise ValueError(f"doc_ids cover {doc_ids.shape[-1]} positions but the sequence has {seq_len}")
        self.rank, self.size, self.seq_len = ring_rank, ring_size, seq_len
        self.half = seq_len // (2 * ring_size)
        self.device = doc_ids.device if device is None and doc_ids is not None else device
        self.doc_ids, self.mask_block = doc_ids, block
        self._layout = SequenceLayout(Degrees(sp=ring_size, ring=ring_size))
        self._blocks: dict[tuple[int, int], AttentionBlock] = {}

    def docs_of(self, ring_rank: int) -> Optional[Tensor]:
        """(B, S/r) document ids of ring rank `ring_rank`'s block."""
        if self.doc_ids is None:
            return None
        idx = torch.from_numpy(self._layout.ring_positions(self.seq_len, ring_rank)).to(self.doc_ids.device)
        return self.doc_ids.index_select(1, idx)

    def rows(self, j: int) -> slice:
        """The query rows of this rank that attend to block j."""
        return slice(self.half, None) if j > self.rank else slice(None)

    def cols(self, j: int) -> slice:
        """The key columns of block j that this rank's queries attend to."""
        return slice(None, self.half) if j < self.rank else slice(None)

    def positions_of(self, ring_rank: int) -> Tensor:
        """(S/r,) indices in the whole sequence of ring rank `ring_rank`'s block."""
        return torch.from_numpy(self._layout.ring_positions(self.seq_len, ring_rank)).to(self.device or "cpu")

    def block(self, j: int, window: int = 0) -> AttentionBlock:
        """This rank's queries against block j, with a sliding window of `window` positions (0: none)."""
        if (j, window) not in self._blocks:
            mine, theirs = self.docs_of(self.rank), self.docs_of(j)
            q_docs = None if mine is None else mine[:, self.rows(j)]
            k_docs = None if theirs is None else theirs[:, self.cols(j)]
            q_pos = self.positions_of(self.rank)[self.rows(j)] if window else None
            k_pos = self.positions_of(j)[self.cols(j)] if window else None
            self._blocks[(j, window)] = AttentionBlock(causal=j == self.rank, q_docs=q_docs, k_docs=k_docs,
                                                       window=window, q_pos=q_pos, k_pos=k_pos,
                                                       block=self.mask_block)
        return self._blocks[(j, window)]


@dataclass(frozen=True)
class BlockKernel:
    """How every block of the ring is attended: the concrete LSE backend (the plan's; block_attention.LSE_BACKENDS),
    the softmax scale and the sliding window in positions (0: none)."""

    backend: str
    scale: float
    window: int = 0


def ring_schedule(rank: int, size: int) -> list[int]:
    """The ring rank whose block this rank holds at each step: its own, then i-1, i-2, ..."""
    return [(rank - t) % size for t in range(size)]


def _rotate(kv: Tensor, group: Group) -> Iterator[Tensor]:
    """This rank's K/V block, then each block arriving from the previous rank; the exchange bringing the
    next one is posted before the current one is handed out, so it travels while the caller computes."""
    size = comm.group_size(group)
    for t in range(size):
        pending = comm.ring_exchange([kv], group) if t + 1 < size else None
        yield kv
        if pending is not None:
            (kv,) = pending.wait()


def forward_blocks(q: Tensor, blocks: Iterable[tuple[int, Tensor]], mask: RingMask,
                   kernel: BlockKernel) -> tuple[Tensor, Tensor, object]:
    """Attend q (B, S/r, Hq, D) to every (j, kv (2, B, S/r, Hkv, D)) in turn and merge: fp32 out and
    lse (B, Hq, S/r), plus the first block's aux (kernel state the backward hands back)."""
    B, s, H, D = q.shape
    out = torch.zeros(B, s, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, s), float("-inf"), dtype=torch.float32, device=q.device)
    aux = None
    for j, kv in blocks:
        rows, cols = mask.rows(j), mask.cols(j)
        o, block_lse, block_aux = block_attention(q[:, rows], kv[0][:, cols], kv[1][:, cols],
                                                  mask.block(j, kernel.window), kernel.backend, kernel.scale)
        merge_block(out[:, rows], lse[:, :, rows], o, block_lse)
        aux = block_aux if aux is None else aux
    return out, lse, aux


def backward_block(dq: Tensor, q: Tensor, kv: Tensor, merged: MergedRows, mask: RingMask, j: int,
                   kernel: BlockKernel, aux: object) -> tuple[slice, Tensor, Tensor]:
    """Add this rank's dQ against block j into dq (fp32) and return its part of block j's dK and dV: the
    key columns it covers, and their gradients. `merged`: this rank's output and LSE over every block, and
    the output's gradient."""
    rows, cols = mask.rows(j), mask.cols(j)
    gq, gk, gv = block_attention_backward(q[:, rows], kv[0][:, cols], kv[1][:, cols], merged.rows(rows),
                                          mask.block(j, kernel.window), kernel.backend, kernel.scale, aux)
    dq[:, rows] += gq.float()
    return cols, gk, gv


class _RingAttention(torch.autograd.Function):
    """Forward: r steps over the ring; at each, post the exchange bringing the next K/V block, attend to
    the block held, merge with the log-sum-exp. Backward: the K/V blocks travel again, dQ accumulates
    here, and each block's dK/dV accumulator travels with it, one more hop bringing it home."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: Group, mask: RingMask, kernel: BlockKernel) -> Tensor:
        kv = torch.stack([k, v])                                          # (2, B, S/r, Hkv, D): one message
        schedule = ring_schedule(mask.rank, mask.size)
        out, lse, aux = forward_blocks(q, zip(schedule, _rotate(kv, group)), mask, kernel)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.group, ctx.mask, ctx.kernel, ctx.aux = group, mask, kernel, aux
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, kv, out, lse = ctx.saved_tensors
        group, mask = ctx.group, ctx.mask
        merged = MergedRows(out, lse, dout)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = None          # the accumulator of the block held at the previous step
        schedule = ring_schedule(mask.rank, mask.size)
        for t, j in enumerate(schedule):
            sends = ([kv] if t + 1 < mask.size else []) + ([dkv] if dkv is not None else [])
            pending = comm.ring_exchange(sends, group) if sends else None
            cols, gk, gv = backward_block(dq, q, kv, merged, mask, j, ctx.kernel, ctx.aux)
            received = pending.wait() if pending is not None else []
            if t + 1 < mask.size:
                kv = received.pop(0)
            # block j's fp32 accumulator, every rank's part up to here: the one that came in, or a new one
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device) if t == 0 else received.pop(0)
            dkv[0][:, cols] += gk
            dkv[1][:, cols] += gv
        (home,) = comm.ring_exchange([dkv], group).wait()                 # this rank's block, complete
        return dq.to(q.dtype), home[0].to(kv.dtype), home[1].to(kv.dtype), None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: Group, mask: RingMask, backend: str,
                   scale: Optional[float] = None, window: int = 0) -> Tensor:
    """Exact causal (document-masked, sliding-window) attention of this ring rank's block against the whole
    sequence.

    q: (B, S/r, Hq, D), k, v: (B, S/r, Hkv, D), the zigzag block of ring rank `mask.rank` (its chunks i
    and 2r-1-i) -> (B, S/r, Hq, D); differentiable in q, k and v. window > 0: each position attends to itself
    and the window - 1 positions before it only."""
    if comm.group_size(group) != mask.size or comm.group_rank(group) != mask.rank:
        raise ValueError(f"the ring mask is for rank {mask.rank} of {mask.size}, the group has rank "
                         f"{comm.group_rank(group)} of {comm.group_size(group)}")
    if q.shape[1] * mask.size != mask.seq_len:
        raise ValueError(f"q holds {q.shape[1]} positions; ring rank blocks of a {mask.seq_len}-long sequence "
                         f"over {mask.size} ranks hold {mask.seq_len // mask.size}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    check_backend(backend, q, mask.doc_ids is not None, ring=True, window=window > 0)
    return _RingAttention.apply(q, k, v, group, mask, BlockKernel(backend, scale, window))
