"""Which implementation of a fused op runs: the torch reference, our Triton kernels, or liger-kernel's
or apex's (optional libraries), and whether it can run here.

A Triton kernel runs when triton is importable and the tensor is on CUDA or Triton's CPU interpreter is
on; liger and apex need their package and CUDA. Triton is optional. The kernel modules (rms_norm_triton.py,
rope_triton.py, swiglu_triton.py) import it at the top and
are themselves imported only on first use, so that TRITON_INTERPRET=1 set by a test before that use
still selects the interpreter (triton reads it when a kernel is decorated)."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

IMPLS = ("torch", "triton", "liger", "apex")
# the ops each library provides; apex has a fused RMSNorm only, so the others use our Triton kernels
LIBRARY_OPS = {"liger": ("rms_norm", "add_rms_norm", "swiglu", "rope_qkv"),
               "apex": ("rms_norm", "add_rms_norm")}
_PACKAGES = {"liger": "liger_kernel", "apex": "apex"}


@dataclasses.dataclass(frozen=True)
class LaunchHook:
    """Where our kernels' launches go instead of the GPU (tools/triton_build.py records them): the SMs the
    grids are planned for, and the function each launch is handed to as (kernel, grid, args, kwargs)."""

    sms: int
    take: Callable[[Any, tuple, tuple, dict], None]


_hook: contextvars.ContextVar[Optional[LaunchHook]] = contextvars.ContextVar("megalysses_launch_hook", default=None)


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:   # absent, or broken for this platform
        return False
    return True


def triton_interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run on CPU tensors through Triton's interpreter (slow; for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_usable(t: Tensor) -> bool:
    return triton_importable() and (t.is_cuda or triton_interpreting() or _hook.get() is not None)


@contextlib.contextmanager
def launches_to(hook: LaunchHook) -> Iterator[None]:
    """Inside (this thread or task), every launch of our kernels is handed to `hook` instead of run, planned
    (grid, blocks) as on a CUDA GPU with hook.sms SMs whatever the tensors' device, and the Triton impl is
    usable on host tensors."""
    token = _hook.set(hook)
    try:
        yield
    finally:
        _hook.reset(token)


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> None:
    """kernel[grid](*args, **kwargs), or the launch handed to the hook `launches_to` installed."""
    hook = _hook.get()
    if hook is not None:
        hook.take(kernel, grid, args, kwargs)
    else:
        kernel[grid](*args, **kwargs)


def gpu_sms(device: torch.device) -> Optional[int]:
    """SMs of the GPU a launch on `device` is planned for: the device's on CUDA, the hook's inside
    launches_to, None under the CPU interpreter."""
    hook = _hook.get()
    if hook is not None:
        return hook.sms
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return None


@functools.lru_cache(maxsize=None)
def library_importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(_PACKAGES[name]) is not None


def choose_impl(impl: str, t: Tensor, what: str) -> str:
    """The implementation `what` (an op name) runs for `impl`: "torch", "triton", "liger" or "apex".

    The run plan chose `impl` (megalysses.plan: model.kernels); with "apex", ops apex lacks use our Triton
    kernels. A choice that cannot run raises, naming why."""
    if impl not in IMPLS:
        raise ValueError(f"unknown {what} impl {impl!r}; choose one of {', '.join(IMPLS)}")
    if impl in LIBRARY_OPS:
        if not library_importable(impl) or not t.is_cuda:
            why = (f"{_PACKAGES[impl]} is not installed" if not library_importable(impl)
                   else f"the tensor is on {t.device}")
            raise RuntimeError(f"{what} impl {impl!r} is unavailable: {why} ({impl} runs on CUDA); "
                               f"available: torch, triton")
        if what in LIBRARY_OPS[impl] or what.startswith("model.kernels"):
            return impl
        impl = "triton"
    if impl == "triton" and not triton_usable(t):
        why = ("triton is not importable" if not triton_importable()
               else f"the tensor is on {t.device} (Triton needs CUDA, or TRITON_INTERPRET=1 set before first use)")
        raise RuntimeError(f"{what} impl 'triton' is unavailable: {why}; available: torch")
    return impl


def num_programs(n_rows: int, device: torch.device) -> int:
    """Grid size for the row-looping kernels: a few programs per SM on CUDA, few under the interpreter."""
    sms = gpu_sms(device)
    cap = 4 * sms if sms is not None else 16
    return max(1, min(n_rows, cap))
