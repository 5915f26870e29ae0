"""FSDP2 on the meta device, for a memory trace (training/trace.py): everything the trace does to torch's FSDP2, in
one place, checked against the torch releases it was written for.

    with meta_device_module(roof):        # torch.meta: the device module FSDP2 asks for (torch.cuda on a GPU)
        with fsdp_internals():            # FSDP2's private internals patched; ConfigError on another torch
            ... fully_shard(...) on a mesh of the meta device, one traced step ...

In a trace the meta device stands for the GPU. FSDP2 looks up its mesh's device module by name (torch.meta),
for its streams and events: meta_device_module puts one there whose streams and events are the roofline's. Three
of its private internals refuse or undo a build on the meta device, and fsdp_internals replaces them while the
trace runs: FSDPParamGroup._validate_no_meta_params (parameters on the meta device, which here stand for the
GPU's, are refused before a forward), _fsdp_init._move_states_to_device (with parameter offload the run builds
in host memory and FSDP2 moves that build to the device, which fake tensors cannot) and
FSDPParam._init_sharded_param (which then shards it where it is: FSDP2 shards a host build on the device, then
copies the shards back, which the step does not see). These are not torch's public interface: they are patched
only on the releases in CHECKED_TORCH, where the trace was run against them (tests/test_memory_trace.py); on
another, the trace of an FSDP run stops with one error naming the release instead of patching blindly.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

import torch

from megalysses.config import ConfigError
from megalysses.training.roofline import Event, Roofline

CHECKED_TORCH = ((2, 11), (2, 13), (2, 14))
"""The torch releases (major, minor) whose FSDP2 internals fsdp_internals was checked against."""


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.13.0+cpu" -> (2, 13))."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_torch() -> None:
    """ConfigError, in one line, unless the torch in use is one of CHECKED_TORCH."""
    if torch_release(torch.__version__) not in CHECKED_TORCH:
        checked = ", ".join(f"{a}.{b}" for a, b in CHECKED_TORCH)
        raise ConfigError(f"a memory trace of an FSDP run (parallel.fsdp) patches FSDP2's private internals as torch "
                          f"{checked} have them, and torch {torch.__version__} is not one of those: trace it on one "
                          f"of them, or check megalysses/training/fsdp_meta.py against this torch and add it to "
                          f"CHECKED_TORCH")


class MetaDeviceModule:
    """torch.meta while a trace runs: the device module FSDP2 asks for its mesh's device type (torch.cuda on a
    GPU), whose streams and events are those of `roof`."""

    def __init__(self, roof: Roofline) -> None:
        self.roof = roof

    def current_device(self) -> None:
        return None                         # torch.device("meta", None): the meta device

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def set_device(self, device: Any) -> None:
        pass

    def synchronize(self, device: Any = None) -> None:
        pass

    def Stream(self, *args: Any, **kwargs: Any) -> Any:      # noqa: N802 (torch.cuda's name)
        return self.roof.stream()

    def Event(self, *args: Any, **kwargs: Any) -> Any:       # noqa: N802
        return Event(self.roof)

    def current_stream(self, device: Any = None) -> Any:
        return self.roof.current

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return self.roof.on(stream)


@contextlib.contextmanager
def meta_device_module(roof: Roofline) -> Iterator[None]:
    """torch.meta is a MetaDeviceModule of `roof` while the block runs."""
    torch.meta = MetaDeviceModule(roof)
    try:
        yield
    finally:
        del torch.meta


@contextlib.contextmanager
def fsdp_internals() -> Iterator[None]:
    """FSDP2 builds on the meta device as on a GPU while the block runs (see the module docstring): its
    parameters left where the run builds them (on the meta device, or in host memory with parameter offload)
    and sharded there, and no refusal of parameters on the meta device. ConfigError on a torch outside
    CHECKED_TORCH, or one without these internals; nothing is patched then."""
    check_torch()
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_init
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        refuse, move = FSDPParamGroup._validate_no_meta_params, _fsdp_init._move_states_to_device
        shard = FSDPParam._init_sharded_param
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"a memory trace of an FSDP run (parallel.fsdp) runs FSDP2 on the meta device, through "
                          f"torch internals that torch {torch.__version__} does not have ({e})") from None

    def shard_where_built(self: Any, param: torch.Tensor, device: torch.device, *args: Any) -> None:
        # a host build stays there: FSDP2 shards it where it is (the device is only checked there)
        shard(self, param, param.device if self.offload_to_cpu else device, *args)

    FSDPParamGroup._validate_no_meta_params = lambda self: None
    _fsdp_init._move_states_to_device = lambda params, buffers, device: None
    FSDPParam._init_sharded_param = shard_where_built
    try:
        yield
    finally:
        FSDPParamGroup._validate_no_meta_params = refuse
        _fsdp_init._move_states_to_device = move
        FSDPParam._init_sharded_param = shard
