"""Ulysses sequence parallelism: the wrapper around core attention.

Each of the u Ulysses ranks holds S/sp tokens for all of its (tp-local) heads. One all-to-all (q, k and
v packed into a single buffer) trades that for the u ranks' S*u/sp tokens on 1/u of the heads; attention
runs over them; the inverse all-to-all trades back. With sp = u (no ring) those are the whole sequence
and attention is local; with a ring (sp = u x r) they are the ring rank's block and `attn` is ring
attention over the ring group (parallel/ring.py). When there are fewer KV heads than u, each KV head is
replicated just enough (u / kv_heads times) so that every rank receives the one its queries use.

    mask = prepare_sequence_mask(doc_ids, backend, ulysses_group, ring_group, local_len)   # once per step
    out = ulysses_attention(q, k, v, ulysses_group, attn)
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from megalysses import comm
from megalysses.comm import Group
from megalysses.kernels.attention import Documents, document_ids, prepare_attention_mask
from megalysses.parallel.ring import RingMask


def kv_replication(kv_heads: int, sp: int) -> int:
    """How many times each (tp-local) KV head is repeated so that `sp` Ulysses ranks can split them."""
    if kv_heads >= sp:
        if kv_heads % sp:
            raise ValueError(f"Ulysses: kv heads {kv_heads} not divisible by sp={sp}")
        return 1
    if sp % kv_heads:
        raise ValueError(f"Ulysses: sp={sp} not divisible by kv heads {kv_heads}")
    return sp // kv_heads


def prepare_sequence_mask(doc_ids: Optional[Tensor | Documents], backend: str, ulysses_group: Group, ring_group: Group,
                          local_len: int, window: int = 0, block: int = 128) -> Any:
    """The attention mask of one step, shared by every layer: without a ring the full-sequence mask of
    core attention (None for plain causal attention); with one, the ring rank's RingMask.
    doc_ids: (B, S) over the full (padded) sequence, or the loader's Documents of them; local_len: the tokens
    of one sp rank, S/sp; window: the layers' sliding window (its form of the mask is built now); block:
    FlexAttention's block-mask block size (the run plan's ActivationPolicy.mask_block)."""
    ring = comm.group_size(ring_group)
    if ring == 1:
        # the loader's doc ids (cumulative sums) are non-decreasing: not checked, which would wait for the device
        return (prepare_attention_mask(doc_ids, backend, window=window, block=block, check=False)
                if doc_ids is not None else None)
    seq_len = local_len * comm.group_size(ulysses_group) * ring
    return RingMask(document_ids(doc_ids), comm.group_rank(ring_group), ring, seq_len, block=block)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: Group,
                      attn: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
    """Attention over the Ulysses group's tokens from sequence-sharded q, k, v.

    q: (B, S/sp, Hq, D), k, v: (B, S/sp, Hkv, D) -> (B, S/sp, Hq, D). `attn` maps the gathered
    (B, S*u/sp, Hq/u, D), (B, S*u/sp, Hkv', D) x2 to (B, S*u/sp, Hq/u, D).
    """
    P = comm.group_size(group)
    if P == 1:
        return attn(q, k, v)
    B, s, hq, D = q.shape
    rep = kv_replication(k.shape[2], P)
    if rep > 1:
        k = k.repeat_interleave(rep, dim=2)                           # (B, S/sp, P, D)
        v = v.repeat_interleave(rep, dim=2)
    hk = k.shape[2]
    # pack per destination rank: (B, S/sp, P, hq/P + 2 hk/P, D), one all-to-all for q, k and v
    packed = torch.cat([q.view(B, s, P, hq // P, D), k.view(B, s, P, hk // P, D), v.view(B, s, P, hk // P, D)], dim=3)
    packed = comm.all_to_all(packed, group, scatter_dim=2, gather_dim=1)         # (B, S*P/sp, 1, c, D)
    qf, kf, vf = packed.squeeze(2).split([hq // P, hk // P, hk // P], dim=2)     # (B, S*P/sp, h/P, D)
    out = attn(qf, kf, vf)                                                        # (B, S*P/sp, hq/P, D)
    return comm.all_to_all(out, group, scatter_dim=1, gather_dim=2)              # (B, S/sp, hq, D)
