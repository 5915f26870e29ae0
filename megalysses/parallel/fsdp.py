"""FSDP2 (`fully_shard`) over the grad (dp x sp) group, for runs that must shard the weights too.

With parallel.fsdp=true every transformer block is one FSDP unit and the stage's remaining
parameters (embedding, final norm, LM head) form the root unit. Each rank keeps dim-0 chunk r of
its tp shard of every parameter (torch.chunk semantics, as ZeRO-1 does for the optimizer state),
all-gathers a block's weights just before the block runs and frees them after, and receives its
chunk of the gradient by reduce-scatter after each micro-batch's backward. Tensor, sequence and
pipeline parallelism work as without FSDP: the gathered weights are this rank's tp shard.

Gradients are SUMMED over the grad group (the loss is already divided by the global token count),
reduced in fp32; on GPU the weights are gathered in the compute dtype (bf16) while the sharded fp32
parameters are the master weights. FSDPAdamW has ShardedAdamW's shape (parallel/optimizer.py: global-norm
clipping with every element counted once, tied-embedding sync across pipeline stages, AdamW on the local
chunks), and checkpoints describe the same chunks with the same names, so runs move freely between FSDP and ZeRO-1.

With training.param_offload every unit takes FSDP2's CPUOffloadPolicy: the sharded fp32 parameters (the
masters), their gradients and AdamW's moments live in host memory (pinned on CUDA) and the update runs on
the CPU. A block's shard is copied to the device on FSDP's all-gather copy-in stream, cast and gathered
just before the block runs, forward and backward (each block prefetches the next one's, one layer ahead),
and freed after; its gradient is reduce-scattered in fp32 and copied back to host memory as the block's
backward finishes, where a step's micro-batches are summed. The device holds two blocks' weights, one
block's gradient and the root unit (embedding, final norm, head) through the step. The losses are those
without offload, bit for bit (tests/test_optimizer_offload.py).
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from megalysses import accelerator, comm
from megalysses.config import ConfigError
from megalysses.parallel.optimizer import AdamWBase, AdamWSettings, adam_state

try:  # public since torch 2.6
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
except ImportError:  # pragma: no cover - depends on the installed torch
    fully_shard = None


def shard_model(model: nn.Module, grad_mesh: DeviceMesh, compute_dtype: torch.dtype, grad_dtype: torch.dtype,
                offload: bool = False) -> nn.Module:
    """Apply fully_shard to each block and to the stage (in place); parameters become DTensors, gathered in
    `compute_dtype`, their gradients reduced in `grad_dtype` (a plan's: fp32). `offload`
    (training.param_offload): the shards in host memory (the model is built there), each block's weights
    prefetched one block ahead, forward and backward."""
    if fully_shard is None or not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        raise ConfigError(f"parallel.fsdp needs FSDP2 with sum-only reductions "
                          f"(FSDPModule.set_force_sum_reduction_for_comms), which torch {torch.__version__} lacks: "
                          f"upgrade torch or set parallel.fsdp=false (ZeRO-1)")
    tp_dims = {name: getattr(p, "tp_dim", None) for name, p in model.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                  reduce_dtype=grad_dtype)
    pinned = accelerator.on_gpu(torch.device(grad_mesh.device_type))    # the shards pinned for copies with the GPU
    where = CPUOffloadPolicy(pin_memory=pinned) if offload else OffloadPolicy()
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=grad_mesh, mp_policy=policy, offload_policy=where)
    fully_shard(model, mesh=grad_mesh, mp_policy=policy, reshard_after_forward=False, offload_policy=where)
    if offload:                 # the next block's copy-in and all-gather start when a block starts
        for before, after in zip(blocks, blocks[1:]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)   # plain SUM (no AVG / PREMUL_SUM)
            module.set_gradient_divide_factor(1.0)           # sum, not mean, over the grad group
    for name, p in model.named_parameters():                 # fully_shard made new Parameter objects
        p.tp_dim = tp_dims[name]
    return model


def reshard(model: nn.Module) -> None:
    """Free the gathered weights a forward-only pass left behind (the root unit keeps them after its
    forward, expecting a backward), so parameters are the sharded DTensors again."""
    if fully_shard is None:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class FSDPAdamW(AdamWBase):
    """AdamW over the FSDP-sharded parameters; same interface and checkpoint layout as ShardedAdamW."""

    def __init__(self, model: nn.Module, settings: AdamWSettings, device: Optional[torch.device] = None) -> None:
        """`device`: where the collectives run (the compute device), when the shards live in host memory."""
        self.named = list(model.named_parameters())
        self.device = device or _local(self.named[0][1]).device
        self.embed_group = settings.embed_group
        self.tied_embed = [p for n, p in self.named if n == "embed.weight"] if self.embed_group is not None else []
        self.counts = {n: settings.counts_in_norm(n, p) for n, p in self.named}
        super().__init__([p for _, p in self.named if p.dim() >= 2], [p for _, p in self.named if p.dim() < 2],
                         settings, _local(self.named[0][1]).device)

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None

    def checkpoint_slots(self) -> Iterator[tuple[str, nn.Parameter, Optional[dict[str, Tensor]]]]:
        """(name, parameter, {master, exp_avg, exp_avg_sq} as this rank's dim-0 chunks)."""
        for name, p in self.named:
            st = adam_state(self.optimizer, p)
            yield name, p, {"master": _local(p.data), "exp_avg": _local(st["exp_avg"]),
                            "exp_avg_sq": _local(st["exp_avg_sq"])}

    # ------------------------------------------------------------------ AdamWBase's hooks
    def _prepare(self) -> None:
        """FSDP reduce-scattered each unit's gradients during the backward; the tied embedding's two copies
        are summed here."""
        for _, p in self.named:         # a parameter that got no gradient steps like one with a zero gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for p in self.tied_embed:       # both copies hold the same chunk layout: sum chunk-wise
            grad = _local(p.grad)
            summed = grad.to(self.device)             # offload: through the device and back
            comm.all_reduce_(summed, self.embed_group)
            if summed is not grad:
                grad.copy_(summed)

    def _local_norm_sq(self) -> Tensor:
        local = torch.zeros((), dtype=torch.float32, device=_local(self.named[0][1]).device)
        for n, p in self.named:
            if p.grad is not None and self.counts[n]:
                local += _local(p.grad).float().pow(2).sum()
        return local.to(self.device)                  # offload: the host's sum, reduced on the device

    def _update_grads(self) -> list[Tensor]:
        return [_local(p.grad) for _, p in self.named]
