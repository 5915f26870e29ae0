"""Process-group set-up: NCCL when CUDA is available (device from LOCAL_RANK), gloo otherwise.

    device = init_distributed(backend="auto", timeout_seconds=600)   # reads torchrun's env vars
    ...
    destroy_distributed()

A short collective timeout turns a dead or stuck rank into an error instead of a 30-minute hang.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


def pick_backend(backend: str = "auto") -> str:
    """auto: NCCL when every local process can have its own GPU, gloo on CPU otherwise."""
    if backend == "auto":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("parallel.backend=nccl needs CUDA, which is not available here: use gloo or auto")
    return backend


def init_distributed(backend: str = "auto", timeout_seconds: float = 600.0, init_method: Optional[str] = None,
                     rank: Optional[int] = None, world_size: Optional[int] = None) -> torch.device:
    """Initialise the default process group (idempotent) and return this rank's device.

    Without an explicit rank/world_size the torchrun variables RANK, WORLD_SIZE, LOCAL_RANK are used;
    a plain `python pretrain.py` runs as a world of one.
    """
    backend = pick_backend(backend)
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
    if init_method is None and "MASTER_ADDR" not in os.environ:
        # a single process launched without torchrun
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_seconds),
                            device_id=device if backend == "nccl" else None)
    return device


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
