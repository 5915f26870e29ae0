"""Key/value cache for generation: a prompt is run once (prefill), then one token at a time (decode),
each step attending to everything cached so far instead of recomputing the prefix.

    cache = KVCache(cfg, batch=B, max_len=P + new, device=..., dtype=..., key_valid=prompt_mask)
    logits = model(ids, positions, cache=cache)           # prefill: (B, P, V); then (B, 1) at a time

One process (tp = sp = pp = 1). Batched prompts of different lengths are left-padded: `key_valid`
(B, max_len) marks the cache slots that hold real tokens, so padding is never attended to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megalysses.config import ModelConfig


@dataclass
class LayerKV:
    """One layer's view of the cache: its K and V buffers (B, max_len, Hkv, D) and the shared state."""
    k: Tensor
    v: Tensor
    cache: "KVCache"

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int = 0) -> Tensor:
        """Write k, v (B, t, Hkv, D) at the cache's current length, then exact attention of q (B, t, Hq, D)
        over every valid cached key at or before each query's position (and, with a sliding `window`, less
        than `window` slots before it: a row's real tokens are consecutive slots) -> (B, t, Hq, D)."""
        start, t = self.cache.length, q.shape[1]
        end = start + t
        self.k[:, start:end], self.v[:, start:end] = k, v
        keys, values = self.k[:, :end], self.v[:, :end]
        rep = q.shape[2] // keys.shape[2]
        keys, values = keys.repeat_interleave(rep, dim=2), values.repeat_interleave(rep, dim=2)
        behind = torch.arange(start, end, device=q.device)[:, None] - torch.arange(end, device=q.device)[None, :]
        causal = (behind >= 0) & (behind < window) if window else behind >= 0
        allowed = causal[None] & self.cache.key_valid[:, None, :end]                  # (B, t, end)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=allowed[:, None])
        return out.transpose(1, 2)                                                     # (B, t, Hq, D)


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device: torch.device, dtype: torch.dtype,
                 key_valid: Optional[Tensor] = None) -> None:
        shape = (batch, max_len, cfg.kv_heads, cfg.head_size)
        self.layers = [LayerKV(torch.zeros(shape, device=device, dtype=dtype),
                               torch.zeros(shape, device=device, dtype=dtype), self) for _ in range(cfg.num_layers)]
        self.max_len, self.length = max_len, 0
        self.key_valid = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        if key_valid is not None:
            self.key_valid[:, :key_valid.shape[1]] = key_valid

    def layer(self, index: int) -> LayerKV:
        return self.layers[index]

    def advance(self, tokens: int) -> None:
        """After every layer has attended: the next call writes after these tokens."""
        if self.length + tokens > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions; {self.length + tokens} needed")
        self.length += tokens
