"""Activation offload: checkpointed block inputs in pinned host memory between the forward and the backward.

    offload = ActivationOffload()                              # one per model stage (chunk)
    x = offload.checkpoint(block, x, cos, sin, mask)           # instead of checkpoint(block, x, ...)

With activation checkpointing a block keeps only its input for the backward. Here the input goes to
host memory as soon as the block has read it: a copy on a side CUDA stream (device -> pinned host),
after which nothing on the device holds it. In the backward, when block k is recomputed, its input
comes back (waiting for the copy that was started earlier) and the copy of block k-1's input starts on
another side stream, so it runs under block k's recomputation and backward: prefetch one block ahead.
The first block of a backward (the last of its forward) is copied back on demand.

How it composes with torch.utils.checkpoint (non-reentrant, unchanged): the checkpointed function does
not take x itself, which checkpoint would keep, but a zero-element token from `_Stash` (outside the
checkpoint), and gets x inside from `_Fetch`: the device tensor in the forward, the fetched copy when
the backward recomputes. `_Fetch`'s backward hands x's gradient to `_Stash`'s, which returns it as the
gradient of x, so autograd sees the same graph as without offload: the losses and gradients are the
same, bit for bit (tests/test_offload.py). Each block's output carries a reference to its slot, so the
next block knows which input to prefetch after its own: any number of micro-batches can be in flight,
in any order (1F1B, interleaved), since each forward's blocks form their own chain.

A block input that is a leaf (a pipeline stage's received activations) stays on the device: the
schedule holds it anyway for its gradient. On CPU the "host copy" is a separate CPU tensor and the
copies are synchronous; everything else is the same code. The side streams and events come from
megalysses.accelerator; the host buffers (pinned, exactly the block input's size, one per input in flight,
reused) from `pinned`: the arena the run gives this offloader (megalysses/pinned_arena.py), sized by the
memory model's count of them (memory/host.py offload_buffers), or without one, pinned requests of their own.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from megalysses import accelerator
from megalysses.pinned_arena import PinnedMemory, PinnedRequests

SLOT_ATTR = "_megalysses_offload_slot"


@dataclass
class OffloadStats:
    """What the copies did: bytes each way, and how many block inputs came back from a prefetch (ready
    or in flight when their block was recomputed) rather than on demand."""

    offloaded: int = 0                  # block inputs sent to host memory
    offloaded_bytes: int = 0
    fetched_bytes: int = 0
    prefetched: int = 0
    on_demand: int = 0
    kept: int = 0                       # leaf inputs left on the device


@dataclass
class _HostBuffer:
    tensor: Tensor
    free_after: Any = None              # the event after which the last copy out of it has finished


@dataclass
class _Slot:
    """One block input on its way to the host and back."""

    owner: "ActivationOffload"
    prev: Optional["_Slot"]             # the input of the block before this one in the same forward
    device: Optional[Tensor] = None     # the input during the forward; the fetched copy in the backward
    kept: Optional[Tensor] = None       # a leaf input, left on the device
    host: Optional[_HostBuffer] = None
    offload_event: Any = None           # CUDA: the copy to host memory has finished
    fetch_event: Any = None             # CUDA: the copy back has finished
    grad: Optional[Tensor] = None
    where: Optional[torch.device] = None
    state: str = "forward"              # forward -> offloaded (or kept) -> fetching -> done


class _Stash(torch.autograd.Function):
    """Forward: queue x's copy to host memory; return an empty token (what the checkpoint keeps).
    Backward: x's gradient, which _Fetch's backward left in the slot."""

    @staticmethod
    def forward(ctx, x: Tensor, slot: _Slot) -> Tensor:
        ctx.slot = slot
        slot.owner._offload(slot, x)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad: Tensor):
        slot = ctx.slot
        grad, slot.grad = slot.grad, None
        return grad, None


class _Fetch(torch.autograd.Function):
    """Forward: the block input, from the slot (the tensor itself in the forward, the copy fetched back
    when the backward recomputes the block). Backward: leave the gradient in the slot for _Stash."""

    @staticmethod
    def forward(ctx, token: Tensor, slot: _Slot) -> Tensor:
        ctx.slot = slot
        return slot.owner._take(slot)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.slot.grad = grad
        return grad.new_zeros(0), None


class ActivationOffload:
    """Checkpointed blocks whose inputs wait in host memory (see the module docstring). `prefetch`: how
    many blocks ahead of the one being recomputed their inputs are copied back."""

    def __init__(self, prefetch: int = 1, pinned: Optional[PinnedMemory] = None) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.prefetch = prefetch
        self.pinned = pinned                                 # where the host buffers come from (None: their own)
        self.stats = OffloadStats()
        self._free: dict[tuple, list[_HostBuffer]] = {}      # (shape, dtype) -> reusable pinned buffers
        self._made: list[weakref.ref] = []                   # every host buffer made (weakly)
        self._streams: dict[torch.device, tuple] = {}        # device -> (to host, to device) streams

    # ------------------------------------------------------------------ the call site
    def checkpoint(self, fn: Callable[..., Tensor], x: Tensor, *args: Any) -> Tensor:
        """fn(x, *args) under activation checkpointing, its input x kept in host memory until the
        backward recomputes fn. Returns fn's output."""
        slot = _Slot(self, prev=getattr(x, SLOT_ATTR, None))
        token = _Stash.apply(x, slot)

        def run(token_: Tensor, *rest: Any) -> Tensor:
            return fn(_Fetch.apply(token_, slot), *rest)

        out = checkpoint(run, token, *args, use_reentrant=False)
        setattr(out, SLOT_ATTR, slot)
        return out

    def host_buffers(self) -> list[Tensor]:
        """Every host buffer of this offloader that is alive: holding a block input, or free for reuse."""
        self._made = [ref for ref in self._made if ref() is not None]
        return [ref() for ref in self._made if ref() is not None]

    # ------------------------------------------------------------------ copies
    def _side_streams(self, device: torch.device) -> tuple:
        if device not in self._streams:
            host = accelerator.current()
            self._streams[device] = (host.stream(device), host.stream(device))
        return self._streams[device]

    def _host_buffer(self, x: Tensor) -> _HostBuffer:
        key = (tuple(x.shape), x.dtype)
        free = self._free.get(key)
        if free:
            return free.pop()
        if self.pinned is None:
            self.pinned = PinnedRequests(x.device)
        # a new shape: a longer sequence (a curriculum's next phase), whose predecessors do not come back
        for old in (buf for bufs in self._free.values() for buf in bufs):
            if old.free_after is not None:
                accelerator.synchronize(old.free_after, "offload")   # its last copy back to the device has read it
            self.pinned.release(old.tensor)
        self._free = {key: []}
        buf = self.pinned.empty(tuple(x.shape), x.dtype)
        self._made.append(weakref.ref(buf))
        return _HostBuffer(buf)

    def _offload(self, slot: _Slot, x: Tensor) -> None:
        """Start x's copy to host memory (the forward). A leaf stays on the device."""
        slot.device, slot.where = x, x.device
        if x.grad_fn is None:
            slot.kept = x
            self.stats.kept += 1
            return
        buf = self._host_buffer(x)
        if accelerator.on_gpu(x):
            host = accelerator.current()
            to_host, _ = self._side_streams(x.device)
            to_host.wait_stream(host.current_stream(x.device))          # x has been written
            if buf.free_after is not None:
                to_host.wait_event(buf.free_after)                       # the buffer's last copy out is done
            with host.on(to_host):
                buf.tensor.copy_(x, non_blocking=True)
                slot.offload_event = host.event(to_host)
            host.record_stream(x, to_host)      # its memory is not reused before the copy has read it
        else:
            buf.tensor.copy_(x)
        slot.host = buf
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += x.numel() * x.element_size()

    def _start_fetch(self, slot: _Slot) -> None:
        """Queue the copy of slot's input back to the device (the backward, ahead of its block)."""
        host, device = slot.host.tensor, slot.where
        if accelerator.on_gpu(device):
            accel = accelerator.current()
            _, to_device = self._side_streams(device)
            main = accel.current_stream(device)
            slot.device = torch.empty(host.shape, dtype=host.dtype, device=device)   # allocated on the main stream
            to_device.wait_stream(main)         # ... so the copy waits for what the main stream queued before
            to_device.wait_event(slot.offload_event)      # and for the copy out to have filled the host buffer
            with accel.on(to_device):
                slot.device.copy_(host, non_blocking=True)
                slot.fetch_event = accel.event(to_device)
            slot.host.free_after = slot.fetch_event
        else:
            slot.device = torch.empty(host.shape, dtype=host.dtype, device=device)
            slot.device.copy_(host)
        self._free.setdefault((tuple(host.shape), host.dtype), []).append(slot.host)
        slot.host = None
        slot.state = "fetching"
        self.stats.fetched_bytes += host.numel() * host.element_size()

    def _take(self, slot: _Slot) -> Tensor:
        """The block input for _Fetch: in the forward the tensor itself; in the recomputation the copy
        fetched back (waiting for it), after starting the prefetch of the blocks before."""
        if slot.state == "forward":         # the forward pass itself: the tensor, then nothing on the device
            x, slot.device = slot.device, None
            slot.state = "kept" if slot.kept is not None else "offloaded"
            return x.detach()
        if slot.state == "kept":
            return slot.kept.detach()
        if slot.state == "offloaded":
            self.stats.on_demand += 1
            self._start_fetch(slot)
        elif slot.state == "fetching":
            self.stats.prefetched += 1
        if slot.state != "fetching":
            raise RuntimeError(f"activation offload: a block input was fetched twice ({slot.state}); the "
                               f"backward of an offloaded block can run once")
        if slot.fetch_event is not None:
            accelerator.current().current_stream(slot.device.device).wait_event(slot.fetch_event)
        x, slot.device, slot.state = slot.device, None, "done"
        ahead, n = slot.prev, self.prefetch
        while ahead is not None and n > 0:
            if ahead.state == "offloaded":
                self._start_fetch(ahead)
            ahead, n = ahead.prev, n - 1
        slot.prev = None                     # the chain behind is not needed any more
        return x
