"""What activation checkpointing keeps from a block's forward.

By default nothing inside the block: its input is kept and the whole block runs again in the backward.
With training.recompute_attention=false the outputs of SDPA's fused attention kernel (the attention
output and its log-sum-exp) are kept too, through torch's selective activation checkpointing: the
backward recomputes the norms, projections, RoPE and all-to-alls, and reuses the kept outputs instead of
running attention, the part of the forward that grows as S^2, a second time. It costs the attention
output and log-sum-exp per layer, about one more block input per layer (tables in the memory model).

Only SDPA's fused kernels are matched (config.checks.check_kept_attention refuses the option with other
backends, and with ring attention, whose blocks are not one kernel call), so nothing else changes: the
kept outputs are the ones the recomputation would have produced, and the gradients are those of full
recomputation (bit for bit where the backward kernels are deterministic, as on CPU). Where SDPA runs its
unfused math path instead (a shape or mask no fused kernel takes), nothing is kept, and KeptAttention
warns once.
"""
from __future__ import annotations

import functools
import warnings
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


class KeptAttention:
    """torch.utils.checkpoint's context_fn that keeps the attention kernels' outputs (one per stage); it
    counts the kernels its forwards kept, for `check`."""

    def __init__(self) -> None:
        self.kept = 0
        self.warned = False

    def _policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in attention_kernels():
            self.kept += not ctx.is_recompute
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def __call__(self) -> tuple:
        return create_selective_checkpoint_contexts(self._policy)

    def check(self) -> None:
        """After the checkpointed blocks of a forward: warn once if they kept no attention kernel's output."""
        if not self.kept and not self.warned:
            self.warned = True
            warnings.warn("training.recompute_attention=false kept nothing in this forward: attention did not run "
                          "on one of SDPA's fused kernels (its math path takes no such shortcut), so the backward "
                          "recomputes it as with full checkpointing", RuntimeWarning, stacklevel=2)
        self.kept = 0


def checkpoint_context(keep_attention: bool) -> Callable:
    """torch.utils.checkpoint's context_fn for a stage's blocks: its default (recompute everything) or a
    KeptAttention."""
    return KeptAttention() if keep_attention else noop_context_fn
