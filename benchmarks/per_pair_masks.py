"""The removed path of a ring's FlexAttention block masks, reinstated in a trace for a before-and-after comparison
(`bench_trace.py --masks per-pair`); nothing in megalysses runs it.

Before kernels/block_mask.py, a ring block's mask (kernels/block_attention.py AttentionBlock.flex_mask, with
documents or a window) was made by torch's create_block_mask(mask_mod, B, None, Sq, Sk, BLOCK_SIZE=block,
_compile=True) on CUDA: mask_mod evaluated on every (query, key) pair by a compiled kernel that reduces them
to the partial and full block masks (B, 1, Sq/block, Sk/block), then torch's conversion of those into the
BlockMask's index tensors. It was built again at every use and dropped after it: each call of the block's
FlexAttention, forward or backward (the ring's forward, a checkpointed layer's recomputation, a head chunk's
recomputation, the block's backward, which runs the forward again), one build each. Today the mask is built
from the documents' boundaries once per ring block and step and kept (AttentionBlock's cache).

`per_pair_forms(builds)` changes a trace's attention forms (training/trace.py trace_run's `forms`) so:
    build_block_mask   with documents or a window's positions (a block's mask), builds nothing: what it is
                       asked for (the pattern, the shape) is kept in its place by the block's cache, as the old
                       block kept its documents; counted in `builds.kept`. The plain causal one as before.
    compiled_flex      at every call with such a mask, builds it as create_block_mask did (one kernel: the
                       B x Sq x Sk mask_mod evaluations, the block masks written; then torch's conversion,
                       traced op by op), in the roofline's category "masks", counted in `builds.per_pair`;
                       then runs the trace's FlexAttention form with it.
A ring's layout only: the mask of attention without a ring (kernels/attention.py AttentionMask) was built once
per step before too, which a per-use build would not be (`per_pair_forms` is for ring layouts, bench_trace.py
refuses others).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch.nn.attention import flex_attention as flex_module

from megalysses.kernels.attention import GPUKernels
from megalysses.kernels.block_mask import MaskPattern
from megalysses.kernels.gpu_forms import KernelCost
from megalysses.training.roofline import MASKS, Roofline


@dataclass(frozen=True)
class Unbuilt:
    """A block mask asked for and not built: the pattern over sq queries and sk keys in blocks of `block`."""

    pattern: MaskPattern
    sq: int
    sk: int
    block: int
    device: torch.device


@dataclass
class Builds:
    """What a traced step built: masks today's path builds once and keeps (`kept`), and the old path's builds,
    one per use (`per_pair`), with their mask_mod evaluations (`evaluations`)."""

    kept: int = 0
    per_pair: int = 0
    evaluations: float = 0.0


def evaluations(mask: Unbuilt) -> int:
    """mask_mod evaluations of one create_block_mask build: every pair of the padded Sq x Sk, per batch row."""
    nq, nk = -(-mask.sq // mask.block), -(-mask.sk // mask.block)
    return mask.pattern.batch * nq * mask.block * nk * mask.block


def create_block_mask_per_pair(mask: Unbuilt, roof: Roofline, builds: Builds) -> Any:
    """The BlockMask of `mask` as create_block_mask(_compile=True) built it on CUDA: the fused kernel evaluating
    mask_mod on every pair and writing the (B, 1, Sq/block, Sk/block) partial and full block masks, then torch's
    conversion of them into the index tensors (its ops traced as they run)."""
    B, nq, nk = mask.pattern.batch, -(-mask.sq // mask.block), -(-mask.sk // mask.block)
    count = evaluations(mask)
    builds.per_pair += 1
    builds.evaluations += count
    with torch.no_grad(), roof.category(MASKS):
        partial = torch.empty(B, 1, nq, nk, dtype=torch.int8, device=mask.device)
        full = torch.empty(B, 1, nq, nk, dtype=torch.int8, device=mask.device)
        roof.cost(KernelCost("memory", 0.0, 2 * partial.numel(), mask_evaluations=count,
                             name="create_block_mask: mask_mod on every pair"))
        return flex_module._create_sparse_block_from_block_mask(
            (partial, full), mask.pattern.mask_mod(), (mask.sq, mask.sk), mask.block, mask.block)


def per_pair_forms(builds: Builds) -> Callable[[GPUKernels, Roofline], GPUKernels]:
    """A trace's `forms` change (training/trace.py ChangeForms): ring blocks' masks built per pair at every use
    (the module docstring), counted in `builds`."""
    def change(forms: GPUKernels, roof: Roofline) -> GPUKernels:
        def unbuilt(pattern: MaskPattern, sq: int, sk: int, block: int = 128, device: Any = None) -> Any:
            if pattern.q_docs is None and pattern.q_pos is None:      # the plain causal one: not a block's
                return forms.build_block_mask(pattern, sq, sk, block, device)
            builds.kept += 1
            given = pattern.q_docs if pattern.q_docs is not None else pattern.q_pos
            device = torch.device(device if device is not None else given.device if given is not None else "cpu")
            return Unbuilt(pattern.to(device), sq, sk, block, device)

        def compiled_flex() -> Callable:
            flex = forms.compiled_flex()

            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any = None, **kwargs: Any) -> Any:
                if isinstance(block_mask, Unbuilt):
                    block_mask = create_block_mask_per_pair(block_mask, roof, builds)
                return flex(q, k, v, block_mask=block_mask, **kwargs)
            return run
        return replace(forms, build_block_mask=unbuilt, compiled_flex=compiled_flex)
    return change
