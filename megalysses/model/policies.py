"""What the backward keeps and where, applied to a plain model: the run plan's ActivationPolicy turned into the
runners a stage and its blocks call, in one function.

    model = GPTStage(model_cfg, groups)                              # plain: every activation on the device
    apply_activation_policy(model, plan.activation, pinned=arena)    # checkpointing, offload, chunks, tiles

A plain GPTStage runs its blocks through RunBlocks, and each Block its two halves through AttentionHalf and
MLPHalf; an option puts its own runner in their place, so no forward branches on a memory option and a new
option is one new runner. The runners are plain objects, not modules: the module tree, and so the parameter
names, the state dict and the checkpoint layout, are the plain model's, and FSDP (parallel/fsdp.py, applied
after the policy) wraps the same blocks. A checkpoint wraps a block's call, FSDP's hooks included, as
torch.utils.checkpoint of the module does.

    checkpointing          Checkpointed: each block (or group of checkpoint_stride blocks) recomputed in the
                           backward, keeping its input alone (training only; evaluation runs the blocks plainly)
    keep_attention         KeptAttentionCheckpoints: checkpointing that keeps SDPA's outputs (model/recompute.py)
    offload                OffloadedCheckpoints: checkpointing whose kept inputs wait in pinned host memory
                           (parallel/offload.py)
    head_chunks            HeadChunkedAttention: attention over groups of heads (model/tiled.py HeadChunks)
    mlp_chunk_tokens       TiledMLP: the MLP norm and the MLP over sequence tiles (model/tiled.py MLPTiles)
    loss_tile              the LM head + loss kernel's tile (kernels/linear_cross_entropy.py)
    mask_block             FlexAttention's block-mask block size (parallel/ulysses.py prepare_sequence_mask)
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from megalysses.model.gpt import GPTStage, RunBlocks
from megalysses.model.kv_cache import KVCache, LayerKV
from megalysses.model.layers import AttentionHalf, Block, MLPHalf
from megalysses.model.recompute import KeptAttention
from megalysses.model.tiled import HeadChunking, HeadChunks, MLPTiles, attention_params, mlp_params
from megalysses.parallel.offload import ActivationOffload
from megalysses.pinned_arena import PinnedMemory
from megalysses.plan.types import ActivationPolicy


def _in_a_row(blocks: list[nn.Module], x: Tensor, cos: Tensor, sin: Tensor, mask: Any) -> Tensor:
    """Blocks in a row, each under its own checkpoint (the inside of a checkpointed group of blocks)."""
    for block in blocks:
        x = checkpoint(block, x, cos, sin, mask, use_reentrant=False)
    return x


class Checkpointed(RunBlocks):
    """Activation checkpointing in training: each group of `stride` blocks keeps its input alone and runs again
    in the backward, where each of its blocks keeps its own input alone (one block: the block itself). Outside
    training the blocks run plainly (evaluation, generation with its KV cache)."""

    def __init__(self, stride: int = 1, context_fn: Callable = noop_context_fn) -> None:
        if stride < 1:
            raise ValueError(f"checkpoint stride {stride}: at least 1")
        self.stride, self.context_fn = stride, context_fn

    def checkpoint(self, fn: Callable[..., Tensor], x: Tensor, cos: Tensor, sin: Tensor, mask: Any) -> Tensor:
        return checkpoint(fn, x, cos, sin, mask, use_reentrant=False, context_fn=self.context_fn)

    def run(self, stage: GPTStage, x: Tensor, cos: Tensor, sin: Tensor, mask: Any,
            cache: Optional[KVCache] = None) -> Tensor:
        if not stage.training:
            return super().run(stage, x, cos, sin, mask, cache)
        blocks = list(stage.layers.values())
        for start in range(0, len(blocks), self.stride):
            group = blocks[start:start + self.stride]
            x = self.checkpoint(group[0] if len(group) == 1 else functools.partial(_in_a_row, group), x, cos, sin,
                                mask)
        return x


class KeptAttentionCheckpoints(Checkpointed):
    """Checkpointing that keeps the attention kernels' outputs (training.recompute_attention=false,
    model/recompute.py KeptAttention); after a training forward with grad, a warning if it kept none."""

    def __init__(self, stride: int = 1) -> None:
        self.kept = KeptAttention()
        super().__init__(stride, self.kept)

    def run(self, stage: GPTStage, x: Tensor, cos: Tensor, sin: Tensor, mask: Any,
            cache: Optional[KVCache] = None) -> Tensor:
        x = super().run(stage, x, cos, sin, mask, cache)
        if stage.training and torch.is_grad_enabled():
            self.kept.check()
        return x


class OffloadedCheckpoints(Checkpointed):
    """Checkpointing whose kept block inputs wait in pinned host memory until the backward
    (parallel/offload.py ActivationOffload, one per stage)."""

    def __init__(self, stride: int = 1, offload: Optional[ActivationOffload] = None) -> None:
        super().__init__(stride)
        self.offload = offload or ActivationOffload()

    def checkpoint(self, fn: Callable[..., Tensor], x: Tensor, cos: Tensor, sin: Tensor, mask: Any) -> Tensor:
        return self.offload.checkpoint(fn, x, cos, sin, mask)


class HeadChunkedAttention(AttentionHalf):
    """The attention half in `chunks` groups of heads, keeping only the block input (model/tiled.py
    HeadChunks), tp-reduced and o_proj's bias added once; with a KV cache (generation) all heads at once."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks

    def run(self, block: Block, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Any],
            cache: Optional[LayerKV] = None) -> Tensor:
        if cache is not None:
            return super().run(block, x, cos, sin, mask, cache)
        attn, norm = block.attn, block.attn_norm
        acc = HeadChunks.apply(HeadChunking(attn, norm, self.chunks), x, cos, sin, mask,
                               *attention_params(attn, norm))
        return attn.reduce(acc)                                                  # (B, s, h)


class TiledMLP(MLPHalf):
    """The MLP half over sequence tiles of `tile` local tokens, keeping only its input x + a (model/tiled.py
    MLPTiles): one tile's (B, tile, f/tp) intermediates at a time. A sequence of at most one tile runs whole.
    (The MLP is token-wise; with TP sequence sharding every tp rank tiles its shard the same way, so the
    all-gather / reduce-scatter inside pair up tile by tile.)"""

    def __init__(self, tile: int) -> None:
        self.tile = tile

    def run(self, block: Block, x: Tensor, a: Tensor) -> Tensor:
        if self.tile >= x.shape[1]:
            return super().run(block, x, a)
        x = x + a
        del a                                          # the attention output is not held while the MLP runs
        return MLPTiles.apply(block, x, self.tile, *mlp_params(block))         # keeps x + a alone


def apply_activation_policy(stage: GPTStage, policy: ActivationPolicy,
                            pinned: Optional[PinnedMemory] = None) -> GPTStage:
    """Put the runners of `policy` in place of a plain stage's (in place; returns the stage). `pinned`: where
    activation offload takes its host buffers (the run's arena for this stage, training/loop.py pinned_arenas;
    None: pinned requests of its own). Apply it before FSDP wraps the blocks (parallel/fsdp.py shard_model)."""
    if (policy.offload or policy.keep_attention or policy.checkpoint_stride > 1) and not policy.checkpointing:
        raise ValueError(f"{policy}: activation offload, kept attention and a checkpoint stride say what "
                         f"checkpointing keeps and where; they need checkpointing (config.checks refuses them without "
                         f"training.activation_checkpointing)")
    if policy.checkpointing and policy.offload:
        stage.run_blocks = OffloadedCheckpoints(policy.checkpoint_stride, ActivationOffload(pinned=pinned))
    elif policy.checkpointing and policy.keep_attention:
        stage.run_blocks = KeptAttentionCheckpoints(policy.checkpoint_stride)
    elif policy.checkpointing:
        stage.run_blocks = Checkpointed(policy.checkpoint_stride)
    for block in stage.layers.values():
        if policy.head_chunks > 1:
            block.attn.check_head_chunks(policy.head_chunks)
            block.attention_half = HeadChunkedAttention(policy.head_chunks)
        if policy.mlp_chunk_tokens:
            block.mlp_half = TiledMLP(policy.mlp_chunk_tokens)
    stage.loss_tile, stage.mask_block = policy.loss_tile, policy.mask_block
    return stage


def activation_offload(stage: GPTStage) -> Optional[ActivationOffload]:
    """The stage's activation offloader (None without activation offload)."""
    return getattr(stage.run_blocks, "offload", None)


def applied_policy(stage: GPTStage) -> ActivationPolicy:
    """The policy a stage's runners carry out, read back from them (training/runtime.py check_built compares
    it with the plan's): the loss tile asked for is the one the stage runs. ValueError when its blocks run under
    different ones."""
    runner = stage.run_blocks
    halves = {(getattr(b.attention_half, "chunks", 1), getattr(b.mlp_half, "tile", 0)) for b in stage.layers.values()}
    if len(halves) > 1:
        raise ValueError(f"the blocks of a stage run under different policies: (head chunks, MLP tile) {halves}")
    head_chunks, tile = halves.pop() if halves else (1, 0)
    checkpointing = isinstance(runner, Checkpointed)
    return ActivationPolicy(checkpointing=checkpointing, keep_attention=isinstance(runner, KeptAttentionCheckpoints),
                            offload=isinstance(runner, OffloadedCheckpoints),
                            checkpoint_stride=runner.stride if checkpointing else 1, mlp_chunk_tokens=tile,
                            loss_chunk_tokens=stage.loss_tile, loss_tile=stage.loss_tile,
                            tp_sequence_parallel=stage.groups.sequence_parallel, head_chunks=head_chunks,
                            mask_block=stage.mask_block)
