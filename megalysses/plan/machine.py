"""The machine a run is planned for: the real one a rank runs on, or one described for planning.

    machine = Machine.current(device)                         # this rank's device, packages and node
    machine = Machine.current(local_device(cfg.parallel.backend))   # the machine a run of cfg runs on here
    machine = Machine.described("H100", ranks_per_node=8)     # a plain torch install on H100 nodes
    machine = Machine.described("H100", packages=("flash_attn", "triton"))

Everything `resolve` decides that depends on where the run is comes from here: the device type, the GPU
(its name gives the peak FLOP/s), how many ranks share a node (Ulysses stays inside one), and which
optional packages import (flash-attn, triton, liger-kernel, apex). A described machine is what the
planner plans for; a run resolves against its current machine, and the two agree when they describe
the same hardware and packages.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from megalysses.accelerator import allocator_settings

OPTIONAL_PACKAGES = ("flash_attn", "triton", "liger_kernel", "apex")
"""The optional accelerators a machine may have. `flex` (torch's FlexAttention) comes with torch >= 2.5."""

PLAIN_TORCH = ("triton",)
"""What a CUDA build of torch brings by itself: Triton (and FlexAttention), no flash-attn, liger or apex."""

TORCH_ATTENTION = ("flex", "varlen")
"""The attention kernels of torch itself that a described machine has (torch >= 2.9: FlexAttention and
variable-length attention)."""

DEVICE_MEMORY_GIB = {"H100": 79.6}
"""The memory a GPU exposes to a process (torch.cuda.mem_get_info's total, nvidia-smi's figure): an H100 80GB has
81,559 MiB, 79.6 GiB, not 80."""


def device_memory_gib(gpu: str) -> float:
    """DEVICE_MEMORY_GIB's figure for `gpu` (a name that contains one of its keys); ValueError for another GPU."""
    for key, gib in DEVICE_MEMORY_GIB.items():
        if key.lower() in gpu.lower():
            return gib
    raise ValueError(f"the memory of a {gpu} is not known here ({', '.join(DEVICE_MEMORY_GIB)} are): give it in GiB "
                     f"(--gpu-memory-gib)")


@dataclass(frozen=True)
class Machine:
    device: str = "cuda"                # "cuda" or "cpu"
    gpu: Optional[str] = None           # the device name ("NVIDIA H100 80GB HBM3"); None on CPU or unknown
    memory_gib: Optional[float] = None  # memory of one device; None where unknown (CPU)
    ranks_per_node: int = 0             # ranks launched per node (torchrun's LOCAL_WORLD_SIZE); 0 = unknown
    packages: frozenset = field(default_factory=frozenset)   # OPTIONAL_PACKAGES that import, plus "flex", "varlen"
    triton_interpreter: bool = False    # Triton kernels run on CPU tensors (TRITON_INTERPRET=1)
    allocator: str = ""                 # the allocator settings in force on CUDA, and whose (accelerator.py)
    pinned_exact: bool = True           # torch's own pinned requests (FSDP2's) above 1 MiB allocated as asked, not
                                        # rounded up to a power of two (megalysses' own are always exact)
    host_memory_gib: Optional[float] = None   # physical memory of one node; None where unknown (a described
                                              # machine without it)

    def has(self, package: str) -> bool:
        return package in self.packages

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @classmethod
    def current(cls, device: torch.device | str = "cpu", ranks_per_node: Optional[int] = None) -> "Machine":
        """This process's machine: `device` (its GPU's name and memory on CUDA), the launcher's ranks per node
        (LOCAL_WORLD_SIZE, unless given) and the optional packages that import here."""
        device = torch.device(device)
        gpu = memory = None
        if device.type == "cuda":
            gpu = torch.cuda.get_device_name(device)
            memory = torch.cuda.mem_get_info(device)[1] / 2**30        # what the device exposes
        if ranks_per_node is None:
            value = os.environ.get("LOCAL_WORLD_SIZE", "")
            ranks_per_node = int(value) if value.isdigit() else 0
        interpreting = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
        settings = allocator_settings(device.type == "cuda")
        return cls(device=device.type, gpu=gpu, memory_gib=memory, ranks_per_node=ranks_per_node,
                   packages=installed_packages(), triton_interpreter=interpreting and device.type == "cpu",
                   allocator=settings.describe() if device.type == "cuda" else "", pinned_exact=settings.pinned_exact,
                   host_memory_gib=node_memory_gib())

    @classmethod
    def described(cls, gpu: Optional[str] = "H100", ranks_per_node: int = 8, memory_gib: Optional[float] = None,
                  packages: tuple[str, ...] = PLAIN_TORCH) -> "Machine":
        """A machine of `gpu`s (None: CPU) of `memory_gib` each (default: what the GPU exposes, DEVICE_MEMORY_GIB),
        `ranks_per_node` to a node, with `packages` besides torch (default: what a plain CUDA torch install has;
        FlexAttention comes with torch)."""
        unknown = set(packages) - set(OPTIONAL_PACKAGES) - set(TORCH_ATTENTION)
        if unknown:
            raise ValueError(f"unknown packages {sorted(unknown)}: choose from {', '.join(OPTIONAL_PACKAGES)}")
        if gpu and memory_gib is None:
            memory_gib = device_memory_gib(gpu)
        settings = allocator_settings(bool(gpu), environ={})       # what a run there sets (this torch's settings)
        return cls(device="cuda" if gpu else "cpu", gpu=gpu, memory_gib=memory_gib if gpu else None,
                   ranks_per_node=ranks_per_node, packages=frozenset(packages) | set(TORCH_ATTENTION),
                   allocator=settings.describe() if gpu else "", pinned_exact=settings.pinned_exact)

    def summary(self) -> dict:
        """What runtime.json records of the machine."""
        return {"device": self.device, "gpu": self.gpu, "memory_gib": None if self.memory_gib is None else
                round(self.memory_gib, 1), "ranks_per_node": self.ranks_per_node,
                "packages": sorted(self.packages), "allocator": self.allocator, "pinned_exact": self.pinned_exact,
                "host_memory_gib": None if self.host_memory_gib is None else round(self.host_memory_gib, 1)}


def node_memory_gib() -> Optional[float]:
    """This node's physical memory in GiB (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def local_device(backend: str = "auto") -> torch.device:
    """The device of this process for parallel.backend `backend`: its own GPU (torchrun's LOCAL_RANK) where CUDA
    gives every process of the node one, unless the run asks for gloo (a CPU run); the CPU otherwise. The plan
    resolved on this machine decides the collective backend (run_plan.collective_backend): NCCL on the GPU."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if backend != "gloo" and torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


@functools.lru_cache(maxsize=1)
def installed_packages() -> frozenset:
    """The optional packages that import in this environment, and "flex" and "varlen" where torch has
    FlexAttention and variable-length attention."""
    found = set()
    from megalysses.kernels.attention import flash_attn_func, flex_available, varlen_available
    from megalysses.kernels.triton_support import library_importable, triton_importable

    if flash_attn_func is not None:
        found.add("flash_attn")
    if flex_available():
        found.add("flex")
    if varlen_available():
        found.add("varlen")
    if triton_importable():
        found.add("triton")
    for name, module in (("liger_kernel", "liger"), ("apex", "apex")):
        if library_importable(module):
            found.add(name)
    return frozenset(found)
