"""What only a GPU has, behind one small interface: whether a tensor is on it, side streams and events,
and pinned host memory. Code that copies between the device and the host asks here, not torch.cuda.

    if accelerator.on_gpu(x):
        side = accelerator.new_stream(x.device)
        side.wait_stream(accelerator.current_stream(x.device))
        with accelerator.use_stream(side):
            host.copy_(x, non_blocking=True)
            done = accelerator.new_event()
            done.record(side)
        accelerator.hold_for(x, side)           # x.record_stream(side)
    buf = accelerator.host_empty(shape, dtype, x.device)   # host memory for copies with x's device: pinned
                                                            # when that is the GPU

The default is torch.cuda. A memory trace (megalysses/training/trace.py) installs another one for its
duration (`installed`): its GPU is the meta device, its streams and events do nothing (the trace runs
one op after another), and its pinned buffers are host tensors it counts as pinned. The code between
stays the code a GPU runs.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor


class Accelerator:
    """torch.cuda: the GPU of a run."""

    def on_gpu(self, x: Tensor | torch.device) -> bool:
        """Whether x (a tensor or a device) is on the GPU."""
        return (x.type if isinstance(x, torch.device) else x.device.type) == "cuda"

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def hold_for(self, x: Tensor, stream: Any) -> None:
        """x's memory is not reused before the work queued on `stream` so far has run."""
        x.record_stream(stream)

    def pinned_empty(self, shape: tuple[int, ...] | torch.Size | int, dtype: torch.dtype) -> Tensor:
        """An uninitialised host tensor in page-locked memory (asynchronous copies to and from the GPU)."""
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)

    def pins_memory(self) -> bool:
        """Whether host buffers meant for the GPU are pinned by the libraries that make their own (FSDP2's
        CPU offload)."""
        return True


_current: list[Accelerator] = [Accelerator()]


def current() -> Accelerator:
    return _current[-1]


@contextlib.contextmanager
def installed(impl: Accelerator) -> Iterator[Accelerator]:
    """Inside, every call of this module goes to `impl`."""
    _current.append(impl)
    try:
        yield impl
    finally:
        _current.remove(impl)


def on_gpu(x: Tensor | torch.device) -> bool:
    return current().on_gpu(x)


def new_stream(device: torch.device) -> Any:
    return current().new_stream(device)


def current_stream(device: torch.device) -> Any:
    return current().current_stream(device)


def use_stream(stream: Any) -> contextlib.AbstractContextManager:
    return current().use_stream(stream)


def new_event() -> Any:
    return current().new_event()


def hold_for(x: Tensor, stream: Any) -> None:
    current().hold_for(x, stream)


def pinned_empty(shape: tuple[int, ...] | torch.Size | int, dtype: torch.dtype) -> Tensor:
    return current().pinned_empty(shape, dtype)


def pins_memory() -> bool:
    return current().pins_memory()


def host_empty(shape: tuple[int, ...] | torch.Size | int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised host tensor for copies to and from `device`: pinned when that is the GPU."""
    if on_gpu(device):
        return pinned_empty(shape, dtype)
    return torch.empty(shape, dtype=dtype, device="cpu")
