"""Ulysses sequence parallelism: the wrapper around core attention.

Each of the P sp ranks holds S/P tokens for all of its (tp-local) heads. One all-to-all (q, k and v
packed into a single buffer) trades that for the full sequence on 1/P of the heads; exact attention
runs locally; the inverse all-to-all trades back. When there are fewer KV heads than P, each KV head
is replicated just enough (P / kv_heads times) so that every rank receives the one its queries use.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from megalysses import comm
from megalysses.comm import Group


def kv_replication(kv_heads: int, sp: int) -> int:
    """How many times each (tp-local) KV head is repeated so that the sp ranks can split them."""
    if kv_heads >= sp:
        if kv_heads % sp:
            raise ValueError(f"Ulysses: kv heads {kv_heads} not divisible by sp={sp}")
        return 1
    if sp % kv_heads:
        raise ValueError(f"Ulysses: sp={sp} not divisible by kv heads {kv_heads}")
    return sp // kv_heads


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, sp_group: Group,
                      attn: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
    """Exact attention over the full sequence from sequence-sharded q, k, v.

    q: (B, S/P, Hq, D), k, v: (B, S/P, Hkv, D) -> (B, S/P, Hq, D). `attn` maps full-sequence
    (B, S, Hq/P, D), (B, S, Hkv', D) x2 to (B, S, Hq/P, D).
    """
    P = comm.group_size(sp_group)
    if P == 1:
        return attn(q, k, v)
    B, s, hq, D = q.shape
    rep = kv_replication(k.shape[2], P)
    if rep > 1:
        k = k.repeat_interleave(rep, dim=2)                           # (B, S/P, P, D)
        v = v.repeat_interleave(rep, dim=2)
    hk = k.shape[2]
    # pack per destination rank: (B, S/P, P, hq/P + 2 hk/P, D), one all-to-all for q, k and v
    packed = torch.cat([q.view(B, s, P, hq // P, D), k.view(B, s, P, hk // P, D), v.view(B, s, P, hk // P, D)], dim=3)
    packed = comm.all_to_all(packed, sp_group, scatter_dim=2, gather_dim=1)      # (B, S, 1, c, D)
    qf, kf, vf = packed.squeeze(2).split([hq // P, hk // P, hk // P], dim=2)     # (B, S, h/P, D)
    out = attn(qf, kf, vf)                                                        # (B, S, hq/P, D)
    return comm.all_to_all(out, sp_group, scatter_dim=1, gather_dim=2)           # (B, S/P, hq, D)
