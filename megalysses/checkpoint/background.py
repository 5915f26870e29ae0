"""Checkpoints written in the background (checkpoint.async_save): training stalls only while the state is copied.

    saver = BackgroundSaver(arena_bytes, device, timeout_seconds)   # at the first save
    saver.save(ckpt_dir, step, model, opt, grid, mesh, meta, keep_last)   # waits for the previous one, stages, returns
    saver.wait()                                                    # a stop, the end of training: it is complete
    saver.close()

A save first waits for the one before it, then copies this rank's state (the tensors dcp_io.training_state names)
into a pinned arena the plan sized (memory/host.py staging_requests), reused by every save, and hands the copy to
torch's dcp.async_save, whose thread writes the DCP files while training goes on. The DCP writer is the stager
(torch's AsyncStager protocol, which every torch since 2.4 takes from the storage writer): its `stage` is the copy
into the arena, so DCP allocates no staging memory of its own. A second thread completes the checkpoint as a
synchronous save does (dcp_io.complete_checkpoint: RNG state, checksums, manifest, rename, `latest`, prune), so
`latest` moves only once every rank has written its files, and a rank killed at any point leaves the step's
`.tmp` directory, never a `latest` that names an incomplete checkpoint.

The background threads talk over a gloo group of their own: DCP's planning and the completion are collectives,
which must not interleave with the training loop's on the same group (and async_save needs a CPU backend beside
NCCL).
"""
from __future__ import annotations

import datetime
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from megalysses.checkpoint.dcp_io import (Written, begin_checkpoint, complete_checkpoint, dtensor_view,
                                          training_state)
from megalysses.checkpoint.manifest import CheckpointError
from megalysses.grid import ParallelGrid
from megalysses.pinned_arena import PinnedArena


class Staging:
    """This rank's copy of its checkpoint state in one pinned arena: a buffer per tensor, taken at the first save
    and refilled by every later one."""

    def __init__(self, arena: PinnedArena) -> None:
        self.arena = arena
        self.buffers: dict[str, torch.Tensor] = {}

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of `state` (DTensors) in the arena, as DTensors of the same meshes, placements and shapes. Copies
        from the device are queued on its current stream, then waited for."""
        staged, device = {}, None
        for name, value in state.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            buffer = self._buffer(name, local)
            buffer.copy_(local, non_blocking=local.device.type == "cuda")
            device = local.device if local.device.type == "cuda" else device
            staged[name] = (dtensor_view(buffer, value.device_mesh, list(value.placements), list(value.shape))
                            if isinstance(value, DTensor) else buffer)
        if device is not None:
            torch.cuda.current_stream(device).synchronize()
        return staged

    def _buffer(self, name: str, local: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(name)
        if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
            buffer = own_storage(self.arena.empty(tuple(local.shape), local.dtype))
            self.buffers[name] = buffer
        return buffer


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, a slice of an arena, as a tensor whose storage is exactly its own bytes (the same memory): DCP's writer
    clones a tensor that is a view of a larger storage before writing it, which would copy the state once more."""
    if not t.numel():
        return t
    start = t.storage_offset() * t.element_size()
    whole = t.untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(whole, 0, (whole.nbytes(),))
    window = memoryview(raw.numpy())[start:start + t.numel() * t.element_size()]
    return torch.frombuffer(window, dtype=torch.uint8).view(t.dtype).view(t.shape)


class _StagingWriter(dcp.FileSystemWriter):
    """DCP's file writer, staging through a Staging (torch's AsyncStager protocol, which dcp.async_save takes from
    the storage writer)."""

    def __init__(self, path: Path, staging: Staging) -> None:
        super().__init__(str(path))
        self.staging = staging

    def stage(self, state_dict: dict) -> dict:
        self.per_thread_copy_ahead = 0          # as FileSystemWriter.stage: what it writes is in host memory
        return self.staging.stage(state_dict)


class BackgroundSaver:
    """Saves checkpoints in the background, one at a time (the module docstring). `arena_bytes`: the plan's
    staging bytes for this rank; `timeout_seconds`: the background group's collective timeout."""

    def __init__(self, arena_bytes: int, device: torch.device, timeout_seconds: float,
                 what: str = "checkpoint staging") -> None:
        self.staging = Staging(PinnedArena(arena_bytes, device, what))
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds))
        self.completer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self.pending: Optional[Future] = None
        self.pending_step: Optional[int] = None

    def save(self, ckpt_dir: str | Path, step: int, model: torch.nn.Module, opt: Any, grid: ParallelGrid,
             mesh: DeviceMesh, meta: dict, keep_last: int) -> None:
        """Wait for the previous save, stage this step's state and start writing it; returns once staged."""
        self.wait()
        tmp, final = begin_checkpoint(ckpt_dir, step, grid.rank)
        written = Written(tmp, final, step, meta, {"torch": torch.get_rng_state()}, keep_last)
        upload = dcp.async_save(training_state(model, opt, grid, mesh),
                                storage_writer=_StagingWriter(tmp, self.staging), process_group=self.group)
        self.pending = self.completer.submit(self._complete, upload, written, grid.rank)
        self.pending_step = step

    def _complete(self, upload: Future, written: Written, rank: int) -> None:
        upload.result()
        complete_checkpoint(written, rank, self.group)

    def wait(self) -> None:
        """Until the save in flight (if any) is complete on every rank; CheckpointError when it failed."""
        pending, step = self.pending, self.pending_step
        self.pending = self.pending_step = None
        if pending is None:
            return
        try:
            pending.result()
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            failures = getattr(e, "failures", None)
            cause = next(iter(failures.values()))[0] if failures else e
            first = (str(cause).strip().splitlines() or [""])[0][:300]
            raise CheckpointError(f"the checkpoint of step {step} could not be written in the background "
                                  f"({type(cause).__name__}: {first}); the previous checkpoint is still `latest`: "
                                  f"check the checkpoint directory's storage, or set checkpoint.async_save=false"
                                  ) from None

    def close(self) -> None:
        """Wait for the save in flight, then let the threads and the group go."""
        try:
            self.wait()
        finally:
            self.completer.shutdown(wait=True)
            dist.destroy_process_group(self.group)
