"""Process-group set-up with the collective backend a run's plan records: NCCL (this rank's GPU from LOCAL_RANK)
or gloo (the CPU).

    device = init_distributed(run.collective, timeout_seconds=600)   # reads torchrun's env vars
    ...
    destroy_distributed()

A short collective timeout turns a dead or stuck rank into an error instead of a 30-minute hang.
A worker started by a launcher (torchrun) asks the kernel for SIGTERM when the launcher dies, so no
worker outlives it: the training loop treats that SIGTERM as a stop (checkpoint, exit).
"""
from __future__ import annotations

import ctypes
import json
import os
import pickle
import signal
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

def init_distributed(backend: str, timeout_seconds: float = 600.0, init_method: Optional[str] = None,
                     rank: Optional[int] = None, world_size: Optional[int] = None) -> torch.device:
    """Initialise the default process group (idempotent) with `backend` ("nccl" or "gloo": a plan's
    `collective`) and return this rank's device: its GPU under NCCL, the CPU under gloo.

    Without an explicit rank/world_size the torchrun variables RANK, WORLD_SIZE, LOCAL_RANK are used;
    a plain `python pretrain.py` runs as a world of one.
    """
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"init_distributed takes a concrete collective backend (nccl or gloo), not {backend!r}: "
                         f"pass the plan's run.collective")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.is_initialized():
        return device
    if rank is None:
        rank = int(os.environ.get("RANK", 0))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
    store = None
    if init_method is None and "MASTER_ADDR" not in os.environ and world_size == 1:
        store = dist.HashStore()     # a single process launched without torchrun: no port to claim
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_seconds), store=store,
                            device_id=device if backend == "nccl" else None)
    return device


_launcher_pid: Optional[int] = None


def die_with_launcher() -> None:
    """Under a launcher (torchrun sets LOCAL_RANK), have the kernel send this process SIGTERM when the
    launcher exits, however it exits (kill -9 included); end at once if it is already gone."""
    global _launcher_pid
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return
    _launcher_pid = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() == 1:      # re-parented to init before prctl took effect: the launcher is gone
        os.kill(os.getpid(), signal.SIGTERM)


_BACKEND_TEXT = ("/gloo/", "pair closure", "nccl")
"""What a communication backend's own errors say: gloo names its source files and closed pairs, NCCL itself."""


def collective_failure(e: BaseException) -> bool:
    """Whether `e` is a timeout or a lost peer of a collective (not a programming error, nor a damaged
    file): a DistError, an error text of gloo or NCCL (what `Work.wait()` of an async op raises, with
    only our own frames above it), or a timeout or connection error raised inside a c10d collective."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    if any(s in text for s in _BACKEND_TEXT):
        return True
    if not any(s in text for s in ("timed out", "timeout", "connection", "closed", "peer")):
        return False
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("torch/distributed/distributed_c10d.py"):
            return True
        tb = tb.tb_next
    return False


def launcher_status() -> str:
    """The launcher this worker started under (die_with_launcher): "none" (no launcher), "running",
    "exiting" (its main thread is gone: the kernel's SIGTERM has been sent, its other threads, the store's
    among them, are on their way out) or "gone"."""
    if _launcher_pid is None:
        return "none"
    if os.getppid() != _launcher_pid:
        return "gone"
    try:
        with open(f"/proc/{_launcher_pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return "exiting" if state in ("Z", "X") else "running"


def write_error_file(message: str) -> None:
    """Leave this worker's one-line reason for failing where its launcher looks for it: torchrun names a file
    per worker in TORCHELASTIC_ERROR_FILE (the convention of torch.distributed.elastic's `record`) and shows
    its message as the "Root Cause" closing its report, instead of "To enable traceback see: ...". The first
    reason a worker gives is kept."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
        os.replace(tmp, path)
    except OSError:
        pass        # the launcher's folder is gone: nobody is left to read it


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def on_rank0(fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 only (file-system work) and give every rank its result, or raise its exception
    on every rank, so that no rank goes on to a collective that the others never reach."""
    result, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
            try:
                pickle.dumps(e)
            except Exception:  # noqa: BLE001
                error = RuntimeError(f"{type(e).__name__}: {e}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [(result, error)]
        dist.broadcast_object_list(box, src=0)
        result, error = box[0]
    if error is not None:
        raise error
    return result


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args: Any) -> None:
    """The one place rank 0 prints from."""
    if is_rank0():
        print(*args, flush=True)
