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
     sum of its own chunks). With overlap, buckets (in reverse parameter order, the order the
     backward produces gradients) are launched asynchronously from gradient hooks during the last
     micro-batch's backward, as soon as each is complete, always in bucket order on every rank;
  3. global gradient norm over every rank, each element counted once (tp-replicated parameters on
     tp rank 0 only; the tied head copy not at all), then clipping;
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
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
from torch import Tensor, nn

from megalysses import accelerator, comm
from megalysses.comm import Group
from megalysses.memory.host import staging_elements
from megalysses.pinned_arena import PinnedMemory, PinnedRequests
from megalysses.parallel.fsdp import FSDPAdamW, adam_state
from megalysses.parallel.host_gradients import HostGradients

BUCKET_ELEMENTS = 32 * 1024 * 1024


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) rows of chunk `rank` of `rows` split like torch.chunk into `world` pieces."""
    size = math.ceil(rows / world)
    lo = min(rank * size, rows)
    return lo, min(lo + size, rows)


@dataclass
class _Slot:
    name: str
    param: nn.Parameter
    rows: tuple[int, int]        # owned rows [lo, hi) of dim 0
    padded: int                  # elements of one rank's padded chunk: ceil(rows/G) * row size
    master: Optional[nn.Parameter]
    counts_in_norm: bool
    grad_dtype: torch.dtype              # what its gradient is accumulated and reduced in
    main_grad: Optional[Tensor] = None   # accumulation (grad_dtype) of the gradient of a parameter in another dtype
    host_grad: Optional[Tensor] = None   # offload: where the reduced chunk is copied

    def grad(self) -> Tensor:
        """This step's gradient (the rank's full tp shard), in grad_dtype, zeros when none arrived."""
        if self.main_grad is not None:
            return self.main_grad
        if self.param.grad is not None:
            return self.param.grad.to(self.grad_dtype)
        return torch.zeros(self.param.shape, dtype=self.grad_dtype, device=self.param.device)


class ShardedAdamW:
    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], grad_group: Group, *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float, tp_rank: int = 0,
                 embed_group: Group = None, tied_head_copy: bool = False, bucket_elements: int = BUCKET_ELEMENTS,
                 overlap: bool = False, offload: bool = False, pinned: Optional[PinnedMemory] = None,
                 grad_dtype: torch.dtype = torch.float32) -> None:
        """`tied_head_copy`: this stage holds the LM-head copy of a tied embedding (not the first stage).
        `overlap`: launch each bucket's reduce-scatter from the backward, as soon as the last micro-batch
        has produced all of its gradients (see begin_step); otherwise everything is reduced in step().
        `offload`: masters, moments and reduced gradients in host memory, the gradients streamed there during
        the backward, the update on the CPU; the masters, the reduced gradients and the staging buffers pinned,
        from `pinned` (the run's arena; by default requests of their own). `grad_dtype`: what the gradients are
        accumulated and reduced in (the plan's)."""
        self.grad_group, self.embed_group, self.grad_dtype = grad_group, embed_group, grad_dtype
        self.G, self.r = comm.group_size(grad_group), comm.group_rank(grad_group)
        self.offload = offload
        named_params = list(named_params)
        self.pinned = pinned if pinned is not None or not named_params else PinnedRequests(named_params[0][1].device)
        self.slots: list[_Slot] = []
        self.host: Optional[HostGradients] = None
        decay, no_decay = [], []
        for name, p in named_params:
            rows = p.shape[0]
            row_size = p[0].numel() if p.dim() > 1 else 1
            lo, hi = chunk_rows(rows, self.G, self.r)
            master = nn.Parameter(self._state_tensor(p.detach()[lo:hi])) if hi > lo else None
            replicated_over_tp = getattr(p, "tp_dim", None) is None
            counts = not (replicated_over_tp and tp_rank != 0) and not (tied_head_copy and name == "embed.weight")
            self.slots.append(_Slot(name, p, (lo, hi), math.ceil(rows / self.G) * row_size, master, counts,
                                    grad_dtype))
            if master is not None and offload:
                self.slots[-1].host_grad = self.pinned.empty(tuple(master.shape), master.dtype)
            if master is not None:
                (no_decay if p.dim() < 2 else decay).append(master)
        if offload and self.slots:
            owned = sum(s.master.numel() for s in self.slots if s.master is not None)
            self.host = HostGradients(self.slots[0].param.device, self.pinned,
                                      staging_elements(bucket_elements, self.G, owned))
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)
        self.tied_embed = [s.param for s in self.slots if s.name == "embed.weight"] if embed_group is not None else []
        self.buckets = self._make_buckets(bucket_elements)
        self._expected = 0                           # backward passes per step; 0 = no overlap this step
        self._fired: dict[int, int] = {}             # id(param) -> gradient accumulations seen this step
        self._missing: list[int] = []                # per bucket: params still waiting for their last gradient
        self._launched: list[tuple] = []             # (work, received chunks, bucket, micro-batch) in launch order
        # offload: the buckets streamed in every micro-batch, in bucket order; the next (micro-batch, bucket)
        self._streamed = [i for i, b in enumerate(self.buckets) if not any(self._tied(s) for s in b)]
        self._next = 0
        for index, bucket in enumerate(self.buckets):
            # a tied embedding is summed over the embed group first, in step(): never launched early
            launch = (overlap or offload) and not any(self._tied(s) for s in bucket)
            for s in bucket:
                s.param.register_post_accumulate_grad_hook(
                    lambda p, s=s, i=index, launch=launch: self._on_grad(s, i if launch else None))

    # ------------------------------------------------------------------ helpers
    def _state_tensor(self, chunk: Tensor) -> Tensor:
        """An fp32 copy of a parameter chunk where the optimizer state lives: beside it, or (offload) in
        host memory, pinned when the parameter is on a GPU."""
        # (meta: a dry run's shapes, nothing to copy; in a memory trace the meta device is the GPU)
        if not self.offload or (chunk.is_meta and not accelerator.on_gpu(chunk)):
            return chunk.float().clone()
        return self.pinned.empty(tuple(chunk.shape), torch.float32).copy_(chunk)

    def _tied(self, s: _Slot) -> bool:
        return any(s.param is t for t in self.tied_embed)

    def _make_buckets(self, bucket_elements: int) -> list[list[_Slot]]:
        """Buckets in reverse parameter order (the order the backward produces gradients); a tied
        embedding gets a bucket of its own."""
        buckets, cur, size = [], [], 0
        for s in reversed(self.slots):
            if self._tied(s):
                buckets.append([s])
                continue
            cur.append(s)
            size += s.padded * self.G     # the gradient elements the bucket carries
            if size >= bucket_elements:
                buckets.append(cur)
                cur, size = [], 0
        return buckets + ([cur] if cur else [])

    @staticmethod
    def _raw_grad(s: _Slot) -> Tensor:
        """This step's gradient on the device in whatever dtype it has (fp32 main_grad, else .grad)."""
        if s.main_grad is not None:
            return s.main_grad
        if s.param.grad is not None:
            return s.param.grad
        return torch.zeros_like(s.param)

    def _take(self, s: _Slot, grad: Tensor) -> None:
        """master.grad := this rank's reduced fp32 chunk (offload: copied to its host buffer)."""
        if self.offload:
            s.master.grad = s.host_grad
            s.host_grad.copy_(grad.view_as(s.host_grad), non_blocking=True)
        else:
            s.master.grad = grad.view_as(s.master).to(s.master.dtype)

    def _rank_chunk(self, t: Tensor, s: _Slot, rank: int) -> Tensor:
        """Chunk `rank` of tensor t (param shaped), flattened and zero-padded to s.padded."""
        lo, hi = chunk_rows(t.shape[0], self.G, rank)
        flat = t[lo:hi].reshape(-1)
        return torch.nn.functional.pad(flat, (0, s.padded - flat.numel()))

    def set_lr(self, lr: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def zero_grad(self) -> None:
        """Drop the gradients (and any reduction already in flight, e.g. of a skipped step)."""
        for work, *_ in self._launched:
            if work is not None:
                work.wait()
        if self.host is not None:
            self.host.drop()
        self._launched, self._expected, self._next = [], 0, 0
        for s in self.slots:
            s.param.grad, s.main_grad = None, None

    def set_step(self, step: int) -> None:
        for s in self.slots:
            if s.master is not None and "step" in self.optimizer.state[s.master]:
                self.optimizer.state[s.master]["step"].fill_(float(step))

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

    # ------------------------------------------------------------------ the step
    def begin_step(self, backward_passes: int) -> None:
        """Announce how many backward passes (micro-batches) this step will run, so that each bucket's
        reduce-scatter starts during the last one, as soon as its gradients are final."""
        self._expected = backward_passes
        self._fired = {id(s.param): 0 for s in self.slots}
        self._missing = [len(b) for b in self.buckets]
        self._launched, self._next = [], 0

    def _on_grad(self, s: _Slot, bucket: Optional[int]) -> None:
        """A micro-batch's gradient of s.param has arrived: accumulate it in grad_dtype when the parameter is
        in another dtype and more micro-batches follow; launch the bucket's reduction once it is complete
        (offload: in every micro-batch)."""
        if not self._expected:
            return
        param = s.param
        if self._expected > 1 and param.dtype != self.grad_dtype and not (self.offload and bucket is not None):
            grad = param.grad.to(self.grad_dtype)
            s.main_grad = grad if s.main_grad is None else s.main_grad.add_(grad)
            param.grad = None
        self._fired[id(param)] += 1
        if bucket is None:
            return
        if self.offload:
            self._stream_ready()
            return
        if self._fired[id(param)] == self._expected:
            self._missing[bucket] -= 1
            # launch in bucket order only, so every rank issues the same collectives in the same order
            while len(self._launched) < len(self.buckets) and self._missing[len(self._launched)] == 0:
                self._launch(len(self._launched))

    @torch.no_grad()
    def _launch(self, index: int, micro: int = 0) -> None:
        """Start the fp32 reduce-scatter of bucket `index` (asynchronously when the group has > 1 rank), of
        micro-batch `micro` when the gradients stream (offload), which then leave the device gradients."""
        bucket = self.buckets[index]
        streamed = self.offload and index in self._streamed
        if self.G == 1:                       # nothing to reduce: each master takes its gradient as it is
            # (offload: as it is on the device; the copy to host memory converts it)
            grads = [self._raw_grad(s) if self.offload else s.grad() for s in bucket]
            self._launched.append((None, grads, bucket, micro))
        else:
            send = self._send_buffer(bucket) if streamed else torch.cat(
                [self._rank_chunk(g, s, j) for j in range(self.G) for s, g in zip(bucket, [s.grad() for s in bucket])])
            mine = send.new_empty(send.numel() // self.G)
            work = comm.reduce_scatter_into(mine, send, self.grad_group, async_op=True)
            self._launched.append((work, mine, bucket, micro))
        if streamed:
            for s in bucket:
                s.param.grad, s.main_grad = None, None

    def _send_buffer(self, bucket: list[_Slot]) -> Tensor:
        """The bucket's gradients as one grad_dtype reduce-scatter input in rank-major layout ([chunk 0 of every
        param | chunk 1 of every param | ...], each chunk zero-padded), converted as they are copied in."""
        send = torch.empty(sum(s.padded for s in bucket) * self.G, dtype=self.grad_dtype,
                           device=bucket[0].param.device)
        offset = 0
        for j in range(self.G):
            for s in bucket:
                g = self._raw_grad(s)
                lo, hi = chunk_rows(g.shape[0], self.G, j)
                n = g[lo:hi].numel()
                send[offset:offset + n].copy_(g[lo:hi].reshape(-1))
                send[offset + n:offset + s.padded].zero_()
                offset += s.padded
        return send

    def _stream_ready(self) -> None:
        """Offload: launch, in order, every (micro-batch, bucket) whose gradients are all in, and send the
        reduced chunks to host memory."""
        per = len(self._streamed)
        while self._next < self._expected * per:
            micro, i = divmod(self._next, per)
            bucket = self.buckets[self._streamed[i]]
            if any(self._fired[id(s.param)] <= micro for s in bucket):
                return
            self._launch(self._streamed[i], micro)
            self._next += 1
            # gloo's wait blocks: leave the newest reduction running under the backward (none after a
            # micro-batch's last bucket); on CUDA the side stream waits for it, not this thread
            self._to_host(keep=1 if i < per - 1 and self.host.stream is None else 0)

    def _to_host(self, keep: int = 0) -> None:
        """Offload: hand all launched buckets but the newest `keep` to host memory (accumulating after a
        step's first micro-batch); the device keeps nothing of them once the copies have read it."""
        while len(self._launched) > keep:
            work, mine, bucket, micro = self._launched.pop(0)
            pieces, offset = [], 0
            for k, s in enumerate(bucket):
                if s.master is not None:
                    s.master.grad = s.host_grad
                    piece = mine[k] if isinstance(mine, list) else mine[offset:offset + s.master.numel()]
                    pieces.append((s.host_grad, piece))
                offset += s.padded
            self.host.put(pieces, work, accumulate=micro > 0)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum gradients over the grad group into the owned fp32 chunks (master.grad): launch the buckets
        the backward has not launched yet, then wait for all of them."""
        for s in self.slots:
            if self._tied(s):
                s.main_grad = s.grad().clone()
                comm.all_reduce_(s.main_grad, self.embed_group)
        if self.offload:             # what the backward has not streamed yet, then the tied embedding's bucket
            per = len(self._streamed)
            while self._next < max(self._expected, 1) * per:
                micro, i = divmod(self._next, per)
                self._launch(self._streamed[i], micro)
                self._next += 1
                self._to_host(keep=1)
            self._to_host()
            self.host.finish()
            for index in (i for i in range(len(self.buckets)) if i not in self._streamed):
                self._launch(index)
        else:
            while len(self._launched) < len(self.buckets):
                self._launch(len(self._launched))
        for work, mine, bucket, _ in self._launched:
            if work is not None:
                work.wait()
            if isinstance(mine, list):        # a group of one: the full gradients themselves
                for s, g in zip(bucket, mine):
                    self._take(s, g)
                continue
            offset = 0
            for s in bucket:
                if s.master is not None:
                    self._take(s, mine[offset:offset + s.master.numel()])
                offset += s.padded
        if self.offload and self.slots and accelerator.on_gpu(self.slots[0].param):
            accelerator.current().current_stream(self.slots[0].param.device).synchronize()   # host copies done
        self._launched, self._expected, self._next = [], 0, 0

    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """The true global L2 norm (every element once, all stages, shards and chunks)."""
        grads = [s.master.grad for s in self.slots if s.master is not None and s.counts_in_norm]
        device = self.slots[0].param.device if self.slots else torch.device("cpu")
        local = (torch.stack(torch._foreach_norm(grads)).pow(2).sum().to(device) if grads   # offload: host sum
                 else torch.zeros((), dtype=torch.float32, device=device))
        comm.all_reduce_(local, comm.world())
        return local.sqrt()

    @torch.no_grad()
    def step(self, max_norm: float = 0.0) -> float:
        """Reduce, clip, update, all-gather. Returns the gradient norm before clipping; a non-finite norm
        (the same on every rank) drops the gradients and leaves weights and state untouched."""
        self.reduce_gradients()
        norm = self.grad_norm()
        if not torch.isfinite(norm):
            self.zero_grad()
            for s in self.slots:
                if s.master is not None:
                    s.master.grad = None
            return norm.item()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            if self.offload:
                coef = coef.cpu()
            for s in self.slots:
                if s.master is not None:
                    s.master.grad.mul_(coef)
        for s in self.slots:
            if s.master is not None:
                adam_state(self.optimizer, s.master)
        self.optimizer.step()
        self.gather_params()
        self.zero_grad()
        for s in self.slots:
            if s.master is not None:
                s.master.grad = None
        return norm.item()

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
            mine = mine.to(bucket[0].param.device)   # offload: the updated chunks back to the device
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


Optimizer = ShardedAdamW | FSDPAdamW
"""Either optimizer: the same interface to the train step and the same chunks to checkpoints."""
