"""Gradients streamed to host memory while the backward runs (ZeRO-1 with training.optimizer_offload).

    host = HostGradients(device, pinned, staging_elements)
    host.put([(host_buffer, device_piece), ...], work, accumulate=micro_batch > 0)   # one bucket
    host.finish()            # before the optimizer reads the host buffers: every copy and sum is done

ShardedAdamW hands over each bucket as soon as its reduce-scatter is launched (`work`, or None when the
group is one rank and the pieces are the gradients themselves): the copy to host memory waits for the
reduction on a side stream, so the backward goes on, and the device buffers can go as soon as the copy
has read them. The first micro-batch of a step copies straight into the fp32 host buffers; a later one
lands in a pinned staging buffer, and the CPU adds it to the host buffer once its copy has finished (the
fp32 accumulation that `main_grad` does on the device without offload: host += float(piece)). There are
`STAGING_BUFFERS` buffers of `staging_elements` each (memory.host.staging_elements: a bucket's share of one rank,
or all of the rank's gradients where that is less: the plan sizes them), made once from `pinned` (the run's
arena) and used in turn: a bucket larger than one fills one after the other, and a buffer whose addition is
still pending is waited for.

On CPU the "host buffer" is a separate CPU tensor and every copy and sum happens at once.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from megalysses import accelerator
from megalysses.memory.host import STAGING_BUFFERS
from megalysses.pinned_arena import PinnedMemory, PinnedRequests


class HostGradients:
    def __init__(self, device: torch.device, pinned: Optional[PinnedMemory] = None, staging_elements: int = 0) -> None:
        """`pinned`: where the staging buffers come from (default: their own pinned requests); `staging_elements`:
        the size of each (staging_elements)."""
        self.device = device
        self.host = accelerator.current()
        self.stream = self.host.stream(device)
        self.pinned = pinned if pinned is not None else PinnedRequests(device)
        self.staging_elements = staging_elements
        self._pending: list[tuple[Any, Tensor, list]] = []  # (copy finished event, stage, [(host, at, stage at, n)])
        self._buffers: list[Tensor] = []                     # STAGING_BUFFERS pinned staging buffers, made once, reused

    def put(self, pieces: list[tuple[Tensor, Tensor]], work: Optional[Any], accumulate: bool) -> None:
        """Copy (or, with `accumulate`, add) each device piece into its host buffer once `work` (the bucket's
        reduce-scatter) has finished; the pieces are read on a side stream and may be dropped after."""
        if self.stream is None:
            if work is not None:
                work.wait()
            for host, piece in pieces:
                flat = host.view(-1)
                flat.add_(piece.reshape(-1)) if accumulate else flat.copy_(piece.reshape(-1))
            return
        self._poll()
        main = self.host.current_stream(self.device)
        with self.host.on(self.stream):
            if work is not None:
                work.wait()                     # this stream waits for the reduce-scatter
            else:
                self.stream.wait_stream(main)   # ... or for the backward that wrote the gradients
            for _, piece in pieces:
                self.host.record_stream(piece, self.stream)   # its memory is not reused before the copy has read it
            if accumulate:
                self._stage_pieces([(host, piece.reshape(-1)) for host, piece in pieces])
            else:
                for host, piece in pieces:
                    host.view(-1).copy_(piece.reshape(-1), non_blocking=True)

    def _stage_pieces(self, pieces: list[tuple[Tensor, Tensor]]) -> None:
        """On the side stream: copy the flat pieces into staging buffers, one buffer after the other (a piece
        across two where it does not fit), each buffer's additions queued once its copies are."""
        stage, used, targets = None, 0, []
        for host, flat in pieces:
            done = 0
            while done < flat.numel():
                if stage is None:
                    stage, used, targets = self._free_stage(flat.dtype), 0, []
                n = min(flat.numel() - done, stage.numel() - used)
                stage[used:used + n].copy_(flat[done:done + n], non_blocking=True)
                targets.append((host, done, used, n))
                done, used = done + n, used + n
                if used == stage.numel():
                    self._pending.append((self.host.event(self.stream), stage, targets))
                    stage = None
        if stage is not None:
            self._pending.append((self.host.event(self.stream), stage, targets))

    def finish(self) -> None:
        """Wait for every copy and make every pending addition: the host buffers hold the step's sums."""
        if self.stream is None:
            return
        accelerator.synchronize(self.stream, "offload")
        while self._pending:
            self._add(self._pending.pop(0))

    def drop(self) -> None:
        """Forget what is in flight (a skipped step): wait for the copies, add nothing."""
        if self.stream is None:
            return
        accelerator.synchronize(self.stream, "offload")
        self._pending = []

    # ------------------------------------------------------------------ helpers
    def _add(self, entry: tuple[Any, Tensor, list]) -> None:
        done, stage, targets = entry
        accelerator.synchronize(done, "offload")
        for host, at, stage_at, n in targets:
            host.view(-1)[at:at + n].add_(stage[stage_at:stage_at + n])    # fp32 += the piece, promoted exactly

    def _poll(self) -> None:
        while self._pending and self._pending[0][0].query():
            self._add(self._pending.pop(0))

    def _free_stage(self, dtype: torch.dtype) -> Tensor:
        """A staging buffer that no pending addition reads (the oldest addition made first if need be). The
        STAGING_BUFFERS buffers are made on first use, in the dtype of the gradients they stage."""
        if not self._buffers:
            if self.staging_elements < 1:
                raise ValueError("optimizer offload: staging a later micro-batch's gradients needs staging_elements")
            self._buffers = [self.pinned.empty((self.staging_elements,), dtype) for _ in range(STAGING_BUFFERS)]
        if self._buffers[0].dtype != dtype:
            raise TypeError(f"optimizer offload: gradients of {dtype} to stage in buffers of {self._buffers[0].dtype}")
        while len(self._pending) >= STAGING_BUFFERS:
            self._add(self._pending.pop(0))
        busy = {id(stage) for _, stage, _ in self._pending}
        return next(s for s in self._buffers if id(s) not in busy)
