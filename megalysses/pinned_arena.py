"""Pinned host memory as the plan sizes it: page-locked arenas, sliced per tensor.

    arena = PinnedArena(nbytes, device, what)          # at start-up: the plan's pinned bytes for one owner
    t = arena.empty((n, h), torch.bfloat16)            # a slice of it (ALIGN-byte aligned), for copies with device
    arena.release(t)                                   # its bytes back, for a later slice
    own = PinnedRequests(device)                       # without a plan: each request pinned by itself, as asked

What megalysses keeps in pinned host memory (activation offload's block inputs, optimizer offload's masters,
reduced gradients and staging buffers) comes from one of these, never from torch's caching host allocator,
which rounds every request up to a power of two on a torch without pinned_max_round_threshold_mb (torch 2.11:
a 6 GiB block input would take 8 GiB). A run sizes its arenas, one for each owner (the activation offloader of
each model chunk, the optimizer), from the memory model's pinned requests for its pipeline stage
(memory/host.py), so the bytes the planner counts are the bytes allocated, each arena one range registered
once; a request an arena cannot hold is an error that names the plan's count, never a silent allocation
beside it. Both take their memory from megalysses.accelerator's Host (pinned_empty: exactly
the bytes asked, page-locked on CUDA), so a trace that swaps the Host counts the arena as one request.

Slices are views of the arena's one buffer: they work alike on CUDA hosts, plain CPU tensors (a CPU run, the
tests) and meta or fake tensors (a dry run, a trace), and a copy to or from a slice is a copy to or from
pinned memory (torch asks CUDA whether an address is page-locked, and a registered range is).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from megalysses import accelerator

ALIGN = 64
"""Every slice starts at a multiple of this many bytes (torch's CPU allocator's alignment, so vectorised CPU
kernels see what they would see on a tensor of their own)."""


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN: what one slice of that size takes in an arena."""
    return -(-nbytes // ALIGN) * ALIGN


class PinnedMemory(Protocol):
    """Where a consumer of pinned host memory takes it from (an arena, or a request at a time)."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor: ...

    def release(self, t: Tensor) -> None: ...


class PinnedRequests:
    """Pinned host memory a request at a time, each exactly as large as asked (library use without a plan:
    a model or optimizer built on its own). `release` leaves a tensor to be freed when it is dropped."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return accelerator.current().pinned_empty(tuple(shape), dtype, self.device)

    def release(self, t: Tensor) -> None:
        pass


class PinnedArena:
    """`capacity` bytes of pinned host memory for copies with `device`, taken from the Host once, handed out
    in ALIGN-aligned slices (first fit) and taken back by `release`. `what` says what the plan counted in it
    (the error when a request does not fit names it)."""

    def __init__(self, capacity: int, device: torch.device, what: str = "") -> None:
        self.capacity, self.device, self.what = int(capacity), torch.device(device), what
        self.buffer = accelerator.current().pinned_empty((self.capacity,), torch.uint8, self.device)
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []   # (offset, bytes)
        self._taken: dict[int, int] = {}                     # offset -> bytes of each slice handed out
        self.in_use = self.high_water = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A slice of the arena shaped `shape` of `dtype` (uninitialised)."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if not nbytes:                                       # nothing to copy: no slice
            return self.buffer.new_empty(tuple(shape), dtype=dtype)
        size = aligned(nbytes)
        at = next((i for i, (_, free) in enumerate(self._free) if free >= size), None)
        if at is None:
            raise RuntimeError(
                f"pinned host memory: a request of {nbytes} bytes ({tuple(shape)} {dtype}) does not fit in this "
                f"rank's arena of {self.capacity} bytes ({self.in_use} in use, the largest free range "
                f"{max((f for _, f in self._free), default=0)}), which the plan sized for {self.what or 'nothing'}: "
                f"the run pins a tensor the memory model does not count (megalysses/memory/host.py)")
        offset, free = self._free[at]
        self._free[at:at + 1] = [(offset + size, free - size)] if free > size else []
        self._taken[offset] = size
        self.in_use += size
        self.high_water = max(self.high_water, self.in_use)
        return self.buffer[offset:offset + nbytes].view(dtype).view(tuple(shape))

    def release(self, t: Tensor) -> None:
        """Take back the slice `t` (a tensor `empty` returned; nothing may use it after)."""
        if not t.numel():
            return
        offset = t.storage_offset() * t.element_size()
        if t.untyped_storage()._cdata != self.buffer.untyped_storage()._cdata or offset not in self._taken:
            raise ValueError(f"pinned host memory: {tuple(t.shape)} {t.dtype} is not a slice of this arena")
        size = self._taken.pop(offset)
        self.in_use -= size
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, n in self._free:                          # coalesce neighbouring free ranges
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((start, n))
        self._free = merged
