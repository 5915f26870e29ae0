"""ZeRO-1's gradient reduction: every rank's gradients summed over the grad (dp x sp) group into the fp32 chunk
of each parameter that the rank owns (parallel/zero.py's sharded AdamW updates those chunks).

    reducer = GradientReducer(slots, grad_group, embed_group, ReduceSettings(...), pinned)
    reducer.begin_step(micro_batches)    # before the backward passes: reductions may start from them
    reducer.reduce()                     # after them: each owned chunk's reduced gradient in slot.master.grad
    reducer.drop()                       # a skipped step: whatever is in flight, and the gradients, dropped

Every parameter (this rank's tp shard) is split along dim 0 into G chunks (torch.chunk semantics) over the G
ranks of the grad group; rank r owns chunk r. Gradients are reduce-scattered in `grad_dtype` (fp32), in buckets
(in reverse parameter order, the order the backward produces gradients), each rank receiving the sum of its
own chunks. Three paths:
  - plain: every bucket reduced in reduce();
  - overlap (parallel.overlap_grad_reduce): buckets launched asynchronously from gradient hooks during the
    last micro-batch's backward as soon as each is complete, always in bucket order on every rank;
  - offload (training.optimizer_offload): in every micro-batch, each bucket reduced from the hooks as soon as
    its gradients are in, its reduced chunk copied to host memory on a side stream and the device gradients
    dropped (parallel/host_gradients.py), the micro-batches summed in fp32 on the host.
A parameter in another dtype than `grad_dtype` accumulates its micro-batches' gradients in `main_grad` (with
one micro-batch per step the gradient is converted in the reduction). A tied embedding split over pipeline
stages is summed over the embed group first, in reduce(), and never launched early.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

from megalysses import accelerator, comm
from megalysses.comm import Group
from megalysses.memory.host import staging_elements
from megalysses.pinned_arena import PinnedMemory
from megalysses.parallel.host_gradients import HostGradients

BUCKET_ELEMENTS = 32 * 1024 * 1024


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) rows of chunk `rank` of `rows` split like torch.chunk into `world` pieces."""
    size = math.ceil(rows / world)
    lo = min(rank * size, rows)
    return lo, min(lo + size, rows)


@dataclass
class Slot:
    """One parameter as ZeRO-1 sees it: the rows this rank owns, its fp32 master chunk (None when it owns
    none) and where its gradient is accumulated."""

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

    def raw_grad(self) -> Tensor:
        """This step's gradient on the device in whatever dtype it has (fp32 main_grad, else .grad)."""
        if self.main_grad is not None:
            return self.main_grad
        if self.param.grad is not None:
            return self.param.grad
        return torch.zeros_like(self.param)


@dataclass(frozen=True)
class ReduceSettings:
    """How the gradients are reduced: bucket size (parallel.grad_bucket_elements), launched from the backward
    (parallel.overlap_grad_reduce), streamed to host memory (training.optimizer_offload), in what dtype."""

    bucket_elements: int = BUCKET_ELEMENTS
    overlap: bool = False
    offload: bool = False
    grad_dtype: torch.dtype = torch.float32


@dataclass
class _Pending:
    """A step's reductions so far, reset at begin_step and once reduced or dropped."""

    expected: int = 0                                     # backward passes this step; 0 = nothing from the hooks
    fired: dict[int, int] = field(default_factory=dict)   # id(param) -> gradient accumulations seen this step
    missing: list[int] = field(default_factory=list)      # per bucket: params still waiting for their last gradient
    launched: list[tuple] = field(default_factory=list)   # (work, received chunks, bucket, micro-batch), in order
    next: int = 0                                         # offload: the next (micro-batch, streamed bucket)


class GradientReducer:
    """The reduce-scatter of ZeRO-1's gradients over the grad group into the owned chunks' `master.grad`."""

    def __init__(self, slots: list[Slot], grad_group: Group, embed_group: Group, settings: ReduceSettings,
                 pinned: Optional[PinnedMemory] = None) -> None:
        """`embed_group`: where a tied embedding's two copies sum (None: not tied across stages); `pinned`: the
        offload's staging buffers' memory."""
        self.slots, self.grad_group, self.embed_group, self.settings = slots, grad_group, embed_group, settings
        self.G = comm.group_size(grad_group)
        self.offload, self.grad_dtype = settings.offload, settings.grad_dtype
        self.host: Optional[HostGradients] = None
        if self.offload and slots:
            owned = sum(s.master.numel() for s in slots if s.master is not None)
            self.host = HostGradients(slots[0].param.device, pinned,
                                      staging_elements(settings.bucket_elements, self.G, owned))
        self.tied_embed = [s.param for s in slots if s.name == "embed.weight"] if embed_group is not None else []
        self.buckets = self._make_buckets(settings.bucket_elements)
        self.pending = _Pending()
        # offload: the buckets streamed in every micro-batch, in bucket order
        self._streamed = [i for i, b in enumerate(self.buckets) if not any(self._tied(s) for s in b)]
        for index, bucket in enumerate(self.buckets):
            launch = (settings.overlap or self.offload) and not any(self._tied(s) for s in bucket)
            for s in bucket:
                s.param.register_post_accumulate_grad_hook(
                    lambda p, s=s, i=index, launch=launch: self._on_grad(s, i if launch else None))

    def _tied(self, s: Slot) -> bool:
        return any(s.param is t for t in self.tied_embed)

    def _make_buckets(self, bucket_elements: int) -> list[list[Slot]]:
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

    def begin_step(self, backward_passes: int) -> None:
        """Announce how many backward passes (micro-batches) this step will run, so that each bucket's
        reduce-scatter starts during the last one, as soon as its gradients are final."""
        self.pending = _Pending(backward_passes, {id(s.param): 0 for s in self.slots},
                                [len(b) for b in self.buckets])

    def drop(self) -> None:
        """Drop the gradients (and any reduction already in flight, e.g. of a skipped step)."""
        for work, *_ in self.pending.launched:
            if work is not None:
                work.wait()
        if self.host is not None:
            self.host.drop()
        self.pending = _Pending()
        for s in self.slots:
            s.param.grad, s.main_grad = None, None

    # ------------------------------------------------------------------ from the backward
    def _on_grad(self, s: Slot, bucket: Optional[int]) -> None:
        """A micro-batch's gradient of s.param has arrived: accumulate it in grad_dtype when the parameter is
        in another dtype and more micro-batches follow; launch the bucket's reduction once it is complete
        (offload: in every micro-batch)."""
        pending = self.pending
        if not pending.expected:
            return
        param = s.param
        if pending.expected > 1 and param.dtype != self.grad_dtype and not (self.offload and bucket is not None):
            grad = param.grad.to(self.grad_dtype)
            s.main_grad = grad if s.main_grad is None else s.main_grad.add_(grad)
            param.grad = None
        pending.fired[id(param)] += 1
        if bucket is None:
            return
        if self.offload:
            self._stream_ready()
            return
        if pending.fired[id(param)] == pending.expected:
            pending.missing[bucket] -= 1
            # launch in bucket order only, so every rank issues the same collectives in the same order
            while len(pending.launched) < len(self.buckets) and pending.missing[len(pending.launched)] == 0:
                self._launch(len(pending.launched))

    @torch.no_grad()
    def _launch(self, index: int, micro: int = 0) -> None:
        """Start the fp32 reduce-scatter of bucket `index` (asynchronously when the group has > 1 rank), of
        micro-batch `micro` when the gradients stream (offload), which then leave the device gradients."""
        bucket = self.buckets[index]
        streamed = self.offload and index in self._streamed
        if self.G == 1:                       # nothing to reduce: each master takes its gradient as it is
            # (offload: as it is on the device; the copy to host memory converts it)
            grads = [s.raw_grad() if self.offload else s.grad() for s in bucket]
            self.pending.launched.append((None, grads, bucket, micro))
        else:
            grads = [] if streamed else [s.grad() for s in bucket]     # each cast once, not once per rank
            send = self._send_buffer(bucket) if streamed else torch.cat(
                [self._rank_chunk(g, s, j) for j in range(self.G) for s, g in zip(bucket, grads)])
            mine = send.new_empty(send.numel() // self.G)
            work = comm.reduce_scatter_into(mine, send, self.grad_group, async_op=True)
            self.pending.launched.append((work, mine, bucket, micro))
        if streamed:
            for s in bucket:
                s.param.grad, s.main_grad = None, None

    def _rank_chunk(self, t: Tensor, s: Slot, rank: int) -> Tensor:
        """Chunk `rank` of tensor t (param shaped), flattened and zero-padded to s.padded."""
        lo, hi = chunk_rows(t.shape[0], self.G, rank)
        flat = t[lo:hi].reshape(-1)
        return torch.nn.functional.pad(flat, (0, s.padded - flat.numel()))

    def _send_buffer(self, bucket: list[Slot]) -> Tensor:
        """The bucket's gradients as one grad_dtype reduce-scatter input in rank-major layout ([chunk 0 of every
        param | chunk 1 of every param | ...], each chunk zero-padded), converted as they are copied in."""
        send = torch.empty(sum(s.padded for s in bucket) * self.G, dtype=self.grad_dtype,
                           device=bucket[0].param.device)
        offset = 0
        for j in range(self.G):
            for s in bucket:
                g = s.raw_grad()
                lo, hi = chunk_rows(g.shape[0], self.G, j)
                n = g[lo:hi].numel()
                send[offset:offset + n].copy_(g[lo:hi].reshape(-1))
                send[offset + n:offset + s.padded].zero_()
                offset += s.padded
        return send

    def _stream_ready(self) -> None:
        """Offload: launch, in order, every (micro-batch, bucket) whose gradients are all in, and send the
        reduced chunks to host memory."""
        pending, per = self.pending, len(self._streamed)
        while pending.next < pending.expected * per:
            micro, i = divmod(pending.next, per)
            bucket = self.buckets[self._streamed[i]]
            if any(pending.fired[id(s.param)] <= micro for s in bucket):
                return
            self._launch(self._streamed[i], micro)
            pending.next += 1
            # gloo's wait blocks: leave the newest reduction running under the backward (none after a
            # micro-batch's last bucket); on CUDA the side stream waits for it, not this thread
            self._to_host(keep=1 if i < per - 1 and self.host.stream is None else 0)

    def _to_host(self, keep: int = 0) -> None:
        """Offload: hand all launched buckets but the newest `keep` to host memory (accumulating after a
        step's first micro-batch); the device keeps nothing of them once the copies have read it."""
        launched = self.pending.launched
        while len(launched) > keep:
            work, mine, bucket, micro = launched.pop(0)
            pieces, offset = [], 0
            for k, s in enumerate(bucket):
                if s.master is not None:
                    s.master.grad = s.host_grad
                    piece = mine[k] if isinstance(mine, list) else mine[offset:offset + s.master.numel()]
                    pieces.append((s.host_grad, piece))
                offset += s.padded
            self.host.put(pieces, work, accumulate=micro > 0)

    # ------------------------------------------------------------------ after the backward
    @torch.no_grad()
    def reduce(self) -> None:
        """Sum gradients over the grad group into the owned fp32 chunks (master.grad): launch the buckets
        the backward has not launched yet, then wait for all of them."""
        for s in self.slots:
            if self._tied(s):
                s.main_grad = s.grad().clone()
                comm.all_reduce_(s.main_grad, self.embed_group)
        if self.offload:
            self._stream_rest()
        else:
            while len(self.pending.launched) < len(self.buckets):
                self._launch(len(self.pending.launched))
        for work, mine, bucket, _ in self.pending.launched:
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
            accelerator.synchronize(accelerator.current().current_stream(self.slots[0].param.device),
                                    "offload")   # the host copies done
        self.pending = _Pending()

    def _stream_rest(self) -> None:
        """Offload: what the backward has not streamed yet, then the tied embedding's bucket launched."""
        pending, per = self.pending, len(self._streamed)
        while pending.next < max(pending.expected, 1) * per:
            micro, i = divmod(pending.next, per)
            self._launch(self._streamed[i], micro)
            pending.next += 1
            self._to_host(keep=1)
        self._to_host()
        self.host.finish()
        for index in (i for i in range(len(self.buckets)) if i not in self._streamed):
            self._launch(index)

    def _take(self, s: Slot, grad: Tensor) -> None:
        """master.grad := this rank's reduced fp32 chunk (offload: copied to its host buffer)."""
        if self.offload:
            s.master.grad = s.host_grad
            s.host_grad.copy_(grad.view_as(s.host_grad), non_blocking=True)
        else:
            s.master.grad = grad.view_as(s.master).to(s.master.dtype)

