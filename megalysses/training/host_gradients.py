"""Gradients streamed to host memory while the backward runs (ZeRO-1 with training.optimizer_offload).

    host = HostGradients(device)
    host.put([(host_buffer, device_piece), ...], work, accumulate=micro_batch > 0)   # one bucket
    host.finish()            # before the optimizer reads the host buffers: every copy and sum is done

ShardedAdamW hands over each bucket as soon as its reduce-scatter is launched (`work`, or None when the
group is one rank and the pieces are the gradients themselves): the copy to host memory waits for the
reduction on a side stream, so the backward goes on, and the device buffers can go as soon as the copy
has read them. The first micro-batch of a step copies straight into the fp32 host buffers; a later one
lands in a pinned staging buffer, and the CPU adds it to the host buffer once its copy has finished (the
fp32 accumulation that `main_grad` does on the device without offload: host += float(piece)). At most
`STAGES` staged buckets wait for their addition; beyond that the oldest is waited for.

On CPU the "host buffer" is a separate CPU tensor and every copy and sum happens at once.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from megalysses import accelerator

STAGES = 2


class HostGradients:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = accelerator.current()
        self.stream = self.host.stream(device)
        self._pending: list[tuple[Any, Tensor, list]] = []  # (copy finished event, stage, [(host, offset, n)])
        self._stages: list[Tensor] = []                     # STAGES pinned staging buffers, made once, reused

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
        stage = self._stage(sum(p.numel() for _, p in pieces), pieces[0][1].dtype) if accumulate and pieces else None
        with self.host.on(self.stream):
            if work is not None:
                work.wait()                     # this stream waits for the reduce-scatter
            else:
                self.stream.wait_stream(main)   # ... or for the backward that wrote the gradients
            targets, offset = [], 0
            for host, piece in pieces:
                n = piece.numel()
                out = stage[offset:offset + n] if accumulate else host.view(-1)
                out.copy_(piece.reshape(-1), non_blocking=True)
                self.host.record_stream(piece, self.stream)   # its memory is not reused before the copy has read it
                targets.append((host, offset, n))
                offset += n
            if stage is not None:
                self._pending.append((self.host.event(self.stream), stage, targets))

    def finish(self) -> None:
        """Wait for every copy and make every pending addition: the host buffers hold the step's sums."""
        if self.stream is None:
            return
        self.stream.synchronize()
        while self._pending:
            self._add(self._pending.pop(0))

    def drop(self) -> None:
        """Forget what is in flight (a skipped step): wait for the copies, add nothing."""
        if self.stream is None:
            return
        self.stream.synchronize()
        self._pending = []

    # ------------------------------------------------------------------ helpers
    def _add(self, entry: tuple[Any, Tensor, list]) -> None:
        done, stage, targets = entry
        done.synchronize()
        for host, offset, n in targets:
            host.view(-1).add_(stage[offset:offset + n])    # fp32 += the piece, promoted exactly

    def _poll(self) -> None:
        while self._pending and self._pending[0][0].query():
            self._add(self._pending.pop(0))

    def _stage(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A pinned staging buffer of `numel` elements: a view of one of STAGES buffers that no pending addition
        reads, made once at the largest bucket's size (a larger bucket replaces them), so no pinned memory is
        allocated or freed per bucket."""
        while len(self._pending) >= STAGES:
            self._add(self._pending.pop(0))
        if not self._stages or self._stages[0].numel() < numel or self._stages[0].dtype != dtype:
            self.drop_stages()
            self._stages = [self.host.pinned_empty((numel,), dtype, self.device) for _ in range(STAGES)]
        busy = {id(stage._base) for _, stage, _ in self._pending}          # each pending stage is a view of one
        free = next(s for s in self._stages if id(s) not in busy)
        return free[:numel]

    def drop_stages(self) -> None:
        """Wait for every pending addition and let go of the staging buffers."""
        while self._pending:
            self._add(self._pending.pop(0))
        self._stages = []
