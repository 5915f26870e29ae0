"""What activation checkpointing keeps from a block's forward.

By default nothing inside the block: its input is kept and the whole block runs again in the backward.
With training.recompute_attention=false the outputs of SDPA's fused attention kernel (the attention
output and its log-sum-exp) are kept too, through torch's selective activation checkpointing: the
backward recomputes the norms, projections, RoPE and all-to-alls, and reuses the kept outputs instead of
running attention, the part of the forward that grows as S^2, a second time. It costs the attention
output and log-sum-exp per layer, about one more block input per layer (tables in the memory model).

Only SDPA's kernels are matched (training/runtime.py refuses the option with other backends, and with
ring attention, whose blocks are not one kernel call), so nothing else changes: the saved outputs are the
ones the forward computed, and the gradients are bit-identical to full recomputation.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn

# SDPA's fused kernels, CPU and CUDA (flash, cuDNN, memory-efficient, and the override hook of other devices)
_SDPA_KERNELS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_fused_attention_overrideable")


@functools.lru_cache(maxsize=1)
def attention_kernels() -> frozenset:
    """The SDPA kernel overloads this torch has."""
    ops = (getattr(torch.ops.aten, name, None) for name in _SDPA_KERNELS)
    return frozenset(op.default for op in ops if op is not None)


def _keep_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in attention_kernels() else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_context(keep_attention: bool) -> Callable:
    """torch.utils.checkpoint's context_fn for a block: its default (recompute everything) or the
    selective policy that keeps the attention kernels' outputs."""
    if not keep_attention:
        return noop_context_fn
    return functools.partial(create_selective_checkpoint_contexts, _keep_attention)
