"""FlexAttention block masks of documents, causality and sliding windows, built from the documents' boundaries
per block: never an evaluation of the mask on every pair of tokens.

    pattern = MaskPattern(causal=True, q_docs=doc_ids, k_docs=doc_ids, window=4096)
    block_mask = build_block_mask(pattern, S, S, block=128)           # a torch BlockMask

FlexAttention's BlockMask says, for each query block of `block` tokens, which key blocks hold some allowed
pair (partial: the kernel applies the pattern's mask_mod inside them) and which hold only allowed pairs (full),
in four int32 index tensors (S/block)^2 in size. torch's create_block_mask finds them by evaluating mask_mod on
all Sq x Sk pairs (compiled, without materialising them, but still ~10^12 evaluations for a 1M x 1M ring
block). Here the keys' document ids and positions are non-decreasing, so the keys a query may attend form one
interval [a, b] (same document: a searchsorted range; causal: up to the query; a window: from a searchsorted
position), found for every query in O(Sq log Sk); a block pair is full when every query of the block covers
the whole key block (the blocks' largest a and smallest b) and holds some pair when one query's interval meets
the key block (each query marks the key blocks its interval spans: a difference array summed along the keys).
Work and memory are O(S + (Sq/block) x (Sk/block)), vectorised on the inputs' device, with no host sync, and
the result equals create_block_mask's element by element (tests/test_block_mask.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
from torch import Tensor

ROW_CHUNK = 1 << 21     # block-matrix entries handled at once: bounds the build's working memory above the result


@dataclass(frozen=True)
class MaskPattern:
    """Which (query, key) pairs of Sq queries and Sk keys may attend: causal in local index (a key at or before
    the query's index: a diagonal block, whose queries and keys are the same positions in the same order), the
    same document, and inside a sliding window.

    q_docs (B, Sq), k_docs (B, Sk): document ids (None: no documents), the keys' non-decreasing along each row.
    window > 0: a query attends only keys less than `window` positions before it; q_pos (Sq,), k_pos (Sk,) are
    the positions in the whole sequence (the keys' increasing), None for the local index."""
    causal: bool
    q_docs: Optional[Tensor] = None
    k_docs: Optional[Tensor] = None
    window: int = 0
    q_pos: Optional[Tensor] = None
    k_pos: Optional[Tensor] = None

    def __post_init__(self) -> None:
        if (self.q_docs is None) != (self.k_docs is None):
            raise ValueError("give the document ids of both the queries and the keys, or of neither")
        if (self.q_pos is None) != (self.k_pos is None):
            raise ValueError("give the positions of both the queries and the keys, or of neither")

    def to(self, device: torch.device) -> "MaskPattern":
        """The pattern with its documents and positions on `device` (where its mask_mod runs)."""
        moved = {name: getattr(self, name).to(device) for name in ("q_docs", "k_docs", "q_pos", "k_pos")
                 if getattr(self, name) is not None}
        return replace(self, **moved)

    @property
    def batch(self) -> int:
        """The BlockMask's batch: the documents' rows, 1 without documents (every row alike)."""
        return 1 if self.q_docs is None else self.q_docs.shape[0]

    def mask_mod(self) -> Callable:
        """FlexAttention's mask_mod of the pattern, which the kernel applies inside partial blocks only."""
        qd, kd, causal, window, qp, kp = self.q_docs, self.k_docs, self.causal, self.window, self.q_pos, self.k_pos

        def mask_mod(b, h, q_idx, kv_idx):
            allowed = kv_idx <= q_idx if causal else q_idx >= 0
            if qd is not None:
                allowed = allowed & (qd[b, q_idx] == kd[b, kv_idx])
            if window:
                gap = q_idx - kv_idx if qp is None else qp[q_idx] - kp[kv_idx]
                allowed = allowed & (gap < window)
            return allowed
        return mask_mod

    def key_intervals(self, sq: int, sk: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """(first, last) (B or 1, Sq) int64: the keys each query may attend are first..last (none where
        first > last). The pattern's tensors are on `device` (MaskPattern.to)."""
        idx = torch.arange(sq, device=device)
        first = torch.zeros(1, sq, dtype=torch.long, device=device)
        last = torch.full((1, sq), sk - 1, dtype=torch.long, device=device)
        if self.causal:
            last = torch.minimum(last, idx[None])
        if self.window:
            qp = idx if self.q_pos is None else self.q_pos
            kp = torch.arange(sk, device=device) if self.k_pos is None else self.k_pos
            first = torch.maximum(first, torch.searchsorted(kp, qp - self.window, right=True)[None])
        if self.q_docs is not None:
            kd = self.k_docs.contiguous()
            qd = self.q_docs.to(kd.dtype).contiguous()
            first = torch.maximum(first, torch.searchsorted(kd, qd))
            last = torch.minimum(last, torch.searchsorted(kd, qd, right=True) - 1)
        return first, last


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """FlexAttention's (num_blocks (..., R), indices (..., R, C)) int32 of a (..., R, C) bool block matrix: per
    row the count of its True columns, and its columns, the True ones first, each part ascending (the stable
    descending argsort create_block_mask makes), put in place by their ranks instead of a sort."""
    C = blocks.shape[-1]
    true_up_to = blocks.cumsum(-1, dtype=torch.int32)                         # True columns up to each
    count = true_up_to[..., -1:]
    col = torch.arange(C, dtype=torch.int32, device=blocks.device)
    # a True column's slot: the True ones before it; a False one's: every True one, then the False ones before it
    slot = torch.where(blocks, true_up_to - 1, (col + count).sub_(true_up_to))
    indices = torch.empty(blocks.shape, dtype=torch.int32, device=blocks.device)
    indices.scatter_(-1, slot.long(), col.expand(blocks.shape))
    return count.squeeze(-1), indices


def _ordered_rows(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """_ordered over a (B, R, C) block matrix in groups of rows (bounded working memory), as (B, 1, R) counts and
    (B, 1, R, C) indices: the head dimension of a BlockMask, one for every head."""
    B, R, C = blocks.shape
    count = torch.empty(B, 1, R, dtype=torch.int32, device=blocks.device)
    indices = torch.empty(B, 1, R, C, dtype=torch.int32, device=blocks.device)
    step = max(1, ROW_CHUNK // max(B * C, 1))
    for r in range(0, R, step):
        count[:, 0, r:r + step], indices[:, 0, r:r + step] = _ordered(blocks[:, r:r + step])
    return count, indices


def _block_rows(pattern: MaskPattern, sq: int, sk: int, block: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(partial, full) (B, Sq/block, Sk/block) bool: the block pairs holding some allowed (query, key) pair but
    not only those, and those holding only allowed pairs; a block running past the end of the queries or keys
    is never full (create_block_mask pads the mask with disallowed pairs)."""
    first, last = pattern.key_intervals(sq, sk, device)
    B, nq, nk = pattern.batch, -(-sq // block), -(-sk // block)
    first, last = first.expand(B, sq), last.expand(B, sq)
    pad = nq * block - sq
    # full: every query of the block attends every key of the key block
    widest_first = torch.nn.functional.pad(first, (0, pad), value=sk).view(B, nq, block).amax(-1)
    narrowest_last = torch.nn.functional.pad(last, (0, pad), value=-1).view(B, nq, block).amin(-1)
    starts = torch.arange(nk, device=device) * block
    ends = starts + block - 1                                                 # past sk - 1: never full
    # some pair: each query adds 1 to the key blocks its interval spans (a difference array, summed along)
    some = (first <= last).to(torch.int32)
    rows = (torch.arange(sq, device=device) // block).expand(B, sq)
    partial = torch.empty(B, nq, nk, dtype=torch.bool, device=device)
    full = torch.empty(B, nq, nk, dtype=torch.bool, device=device)
    step = max(1, ROW_CHUNK // max(B * (nk + 1), 1))
    for r in range(0, nq, step):
        n = min(step, nq - r)
        lo, hi = r * block, min((r + n) * block, sq)
        marks = torch.zeros(B, n, nk + 1, dtype=torch.int32, device=device)
        local = (rows[:, lo:hi] - r) * (nk + 1)
        flat = marks.view(B, -1)
        flat.scatter_add_(1, local + (first[:, lo:hi] // block).clamp(max=nk), some[:, lo:hi])
        flat.scatter_add_(1, local + (last[:, lo:hi] // block + 1).clamp(0, nk), -some[:, lo:hi])
        touched = marks.cumsum(-1, dtype=torch.int32)[..., :nk] > 0
        whole = (widest_first[:, r:r + n, None] <= starts) & (narrowest_last[:, r:r + n, None] >= ends)
        whole &= ends < sk
        full[:, r:r + n] = whole
        partial[:, r:r + n] = touched & ~whole
    return partial, full


def build_block_mask(pattern: MaskPattern, sq: int, sk: int, block: int = 128,
                     device: Optional[torch.device] = None) -> Any:
    """FlexAttention's BlockMask of `pattern` over sq queries and sk keys in blocks of `block` tokens (a multiple
    of 128, the kernel's tile), on `device` (default: the documents' or positions', else the CPU): the kv and
    q index tensors of its partial and full blocks, equal to create_block_mask's, and the pattern's mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask

    given = pattern.q_docs if pattern.q_docs is not None else pattern.q_pos
    device = torch.device(device if device is not None else given.device if given is not None else "cpu")
    pattern = pattern.to(device)
    with torch.no_grad():
        partial, full = _block_rows(pattern, sq, sk, block, device)
        kv_num, kv_idx = _ordered_rows(partial)
        full_num, full_idx = _ordered_rows(full)
        q_num, q_idx = _ordered_rows(partial.transpose(1, 2).contiguous())
        full_q_num, full_q_idx = _ordered_rows(full.transpose(1, 2).contiguous())
    return BlockMask(seq_lengths=(sq, sk), kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_num,
                     full_kv_indices=full_idx, q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=full_q_num,
                     full_q_indices=full_q_idx, BLOCK_SIZE=(block, block), mask_mod=pattern.mask_mod())
