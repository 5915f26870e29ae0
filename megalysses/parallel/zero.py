"""ZeRO-1 AdamW: fp32 master weights and optimizer state sharded over the grad (dp x sp) group.

The model's parameters hold the compute weights (bf16 on GPU, fp32 on CPU); the optimizer alone keeps
fp32 masters. Every parameter (this rank's tp shard of it) is split along dim 0 into G chunks (torch.chunk
semantics) over the G ranks of the grad group; rank r owns chunk r: its fp32 master copy, exp_avg and
exp_avg_sq. Gradients are accumulated and reduced in `grad_dtype` (a plan's: fp32): those of parameters in
another dtype are accumulated over the micro-batches of a step in it (`main_grad`, filled by a hook as each
micro-batch's gradient arrives); with one micro-batch per step the bf16 gradient is used as it is and
converted in the reduction. One step:
  1. tied embeddings: sum the two copies' gradients over the embed group (first + last stage);
  2. reduce-scatter the gradients in fp32 over the grad group, in buckets (each rank receives the
     sum of its own chunks): parallel/grad_reduce.py's GradientReducer, which with overlap launches them
     from the last micro-batch's backward;
  3. global gradient norm over every rank, each element counted once (tp-replicated parameters on
     tp rank 0 only; the tied head copy not at all), then clipping (parallel/optimizer.py's AdamWBase);
  4. torch.optim.AdamW on the owned chunks;
  5. all-gather the updated chunks back into the parameters.
The layout (chunk r along dim 0 of the tp shard) is what checkpoints describe as DTensor placements.

With `offload` (training.optimizer_offload) the masters, moments and reduced gradients live in host
memory (pinned on CUDA), and the gradients stream there during the backward: in every micro-batch, each
bucket is reduce-scattered from the gradient hooks as soon as its gradients are in (whatever
`overlap` says), its reduced chunk is copied to host memory on a side stream and the device gradients are
dropped (parallel/host_gradients.py). The micro-batches' chunks are summed in fp32 on the host, so no
`main_grad` of the whole model ever exists on the device: at any moment it holds the gradients of the
layers whose bucket is not complete yet and one bucket in flight. The norm, the clipping and the AdamW
update run on the CPU, and the updated chunks are copied back for the all-gather. The arithmetic is the
same (tests/test_optimizer_offload.py): bit for bit where the sums are taken in the same order (one
micro-batch per step, or a grad group of one rank); with more of both, the micro-batches are summed after
the reduction instead of before it (as DeepSpeed's ZeRO offload does), the same sum up to fp32 rounding.
A tied embedding split over pipeline stages keeps its fp32 `main_grad` on the device and is reduced at the
end, as without offload.
"""
from __future__ import annotations

import math
from typing import Iterable, Iterator, Optional

import torch
from torch import Tensor, nn

from megalysses import comm
from megalysses.comm import Group
from megalysses.pinned_arena import PinnedMemory, PinnedRequests
from megalysses.parallel.grad_reduce import BUCKET_ELEMENTS, GradientReducer, ReduceSettings, Slot, chunk_rows
from megalysses.parallel.optimizer import AdamWBase, AdamWSettings, adam_state

__all__ = ["BUCKET_ELEMENTS", "ReduceSettings", "ShardedAdamW", "chunk_rows"]


class ShardedAdamW(AdamWBase):
    """AdamW on this rank's fp32 chunks of every parameter, their gradients reduced by a GradientReducer."""

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], grad_group: Group,
                 settings: AdamWSettings, reduce: Optional[ReduceSettings] = None,
                 pinned: Optional[PinnedMemory] = None) -> None:
        """`reduce`: how the gradients are reduced (with `offload`, masters, moments and reduced gradients in
        host memory, the gradients streamed there during the backward, the update on the CPU; the masters,
        the reduced gradients and the staging buffers pinned, from `pinned`, the run's arena, by default
        requests of their own)."""
        reduce = reduce or ReduceSettings()
        self.grad_group, self.offload = grad_group, reduce.offload
        self.G, self.r = comm.group_size(grad_group), comm.group_rank(grad_group)
        named_params = list(named_params)
        self.pinned = pinned if pinned is not None or not named_params else PinnedRequests(named_params[0][1].device)
        self.slots: list[Slot] = [self._slot(name, p, settings, reduce.grad_dtype) for name, p in named_params]
        masters = [(s.master, s.param.dim()) for s in self.slots if s.master is not None]
        device = self.slots[0].param.device if self.slots else torch.device("cpu")
        super().__init__([m for m, dim in masters if dim >= 2], [m for m, dim in masters if dim < 2], settings,
                         torch.device("cpu") if self.offload else device)
        self.reducer = GradientReducer(self.slots, grad_group, settings.embed_group, reduce, self.pinned)
        self.host, self.buckets = self.reducer.host, self.reducer.buckets

    def _slot(self, name: str, p: nn.Parameter, settings: AdamWSettings, grad_dtype: torch.dtype) -> Slot:
        """`p` as this rank holds it: its owned rows, their fp32 master (none when it owns no rows)."""
        rows = p.shape[0]
        row_size = p[0].numel() if p.dim() > 1 else 1
        lo, hi = chunk_rows(rows, self.G, self.r)
        master = nn.Parameter(self._state_tensor(p.detach()[lo:hi])) if hi > lo else None
        slot = Slot(name, p, (lo, hi), math.ceil(rows / self.G) * row_size, master,
                    settings.counts_in_norm(name, p), grad_dtype)
        if master is not None and self.offload:
            slot.host_grad = self.pinned.empty(tuple(master.shape), master.dtype)
        return slot

    def _state_tensor(self, chunk: Tensor) -> Tensor:
        """An fp32 copy of a parameter chunk where the optimizer state lives: beside it, or (offload) in
        host memory, pinned when the parameter is on a GPU (megalysses.accelerator's Host says what that
        memory is: a meta tensor for a meta parameter, a dry run's)."""
        if not self.offload:
            return chunk.float().clone()
        return self.pinned.empty(tuple(chunk.shape), torch.float32).copy_(chunk)

    def begin_step(self, backward_passes: int) -> None:
        """Announce how many backward passes (micro-batches) this step will run, so that each bucket's
        reduce-scatter starts during the last one, as soon as its gradients are final."""
        self.reducer.begin_step(backward_passes)

    def zero_grad(self) -> None:
        """Drop the gradients (and any reduction already in flight, e.g. of a skipped step)."""
        self.reducer.drop()
        for s in self.slots:
            if s.master is not None:
                s.master.grad = None

    def reduce_gradients(self) -> None:
        """Sum gradients over the grad group into the owned fp32 chunks (master.grad)."""
        self.reducer.reduce()

    def checkpoint_slots(self) -> Iterator[tuple[str, nn.Parameter, dict[str, Tensor]]]:
        """(name, parameter, {master, exp_avg, exp_avg_sq} as this rank's dim-0 chunks, possibly empty)."""
        for s in self.slots:
            if s.master is None:
                where = "cpu" if self.offload else s.param.device
                empty = torch.empty((0,) + tuple(s.param.shape[1:]), dtype=torch.float32, device=where)
                yield s.name, s.param, {"master": empty, "exp_avg": empty.clone(), "exp_avg_sq": empty.clone()}
                continue
            st = adam_state(self.optimizer, s.master)
            yield s.name, s.param, {"master": s.master.data, "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}

    # ------------------------------------------------------------------ AdamWBase's hooks
    def _prepare(self) -> None:
        self.reducer.reduce()

    def _local_norm_sq(self) -> Tensor:
        grads = [s.master.grad for s in self.slots if s.master is not None and s.counts_in_norm]
        device = self.slots[0].param.device if self.slots else torch.device("cpu")
        return (torch.stack(torch._foreach_norm(grads)).pow(2).sum().to(device) if grads   # offload: host sum
                else torch.zeros((), dtype=torch.float32, device=device))

    def _update_grads(self) -> list[Tensor]:
        return [s.master.grad for s in self.slots if s.master is not None]

    def _finish(self) -> None:
        self.gather_params()

    @torch.no_grad()
    def gather_params(self) -> None:
        """Copy the updated master chunks back into every rank's full parameters."""
        if self.G == 1:
            for s in self.slots:
                if s.master is not None:
                    s.param.data.copy_(s.master.data, non_blocking=True)
            return
        for bucket in self.buckets:
            where = torch.device("cpu") if self.offload else bucket[0].param.device
            mine = torch.cat([torch.nn.functional.pad(s.master.reshape(-1), (0, s.padded - s.master.numel()))
                              if s.master is not None else torch.zeros(s.padded, dtype=torch.float32, device=where)
                              for s in bucket])
            # gathered in the parameters' dtype when the bucket has one (each copy below would round to it
            # anyway), half the bytes of fp32 chunks for bf16 weights; offload: the chunks back to the device
            dtypes = {s.param.dtype for s in bucket}
            mine = mine.to(bucket[0].param.device, dtypes.pop() if len(dtypes) == 1 else mine.dtype)
            full = mine.new_empty(mine.numel() * self.G)
            comm.all_gather_into(full, mine, self.grad_group)
            per_rank = full.view(self.G, -1)
            for j in range(self.G):
                offset = 0
                for s in bucket:
                    lo, hi = chunk_rows(s.param.shape[0], self.G, j)
                    if hi > lo:
                        n = (hi - lo) * (s.param[0].numel() if s.param.dim() > 1 else 1)
                        s.param.data[lo:hi].copy_(per_rank[j, offset:offset + n].view_as(s.param.data[lo:hi]))
                    offset += s.padded
