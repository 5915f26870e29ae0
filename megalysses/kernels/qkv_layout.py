"""The fused QKV projection's layout, which the RoPE kernels of every implementation read.

The fused QKV weight is grouped by KV head: for each KV head g, the rep query heads that read it, then
k_g, then v_g (model/layers.py Attention), so its output is (B, S, Hkv, rep + 2, D).
"""
from __future__ import annotations

from torch import Tensor


def split_qkv(qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A fused QKV output grouped by KV head, (B, S, Hkv, rep + 2, D) (the rep query heads of group g,
    then k_g, then v_g), as q (B, S, Hkv*rep, D), k, v (B, S, Hkv, D). Query head i reads KV head i // rep."""
    B, S, hk, c, D = qkv.shape
    rep = c - 2
    return qkv[:, :, :, :rep].reshape(B, S, hk * rep, D), qkv[:, :, :, rep], qkv[:, :, :, rep + 1]
