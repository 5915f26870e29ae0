"""What megalysses asks of a CUDA device beyond its tensors, in one place: the caching allocators' settings made
at start-up, page-locked (pinned) host memory, and the side streams and events that overlap host copies with
compute. Everything else runs on plain tensors; a memory trace on a CPU swaps this module's Host for its own.

    settings = configure_allocator(cuda=True)          # at start-up, before the first CUDA allocation
    host = current()                                   # the Host in use
    buf = host.pinned_empty((n, h), torch.bfloat16, device)        # host memory for copies with `device`
    side = host.stream(device)                         # a side stream (None on a CPU)
    with host.on(side): ...; done = host.event(side)   # queue work on it; an event after it
    with use(MyHost()): ...                            # another Host (a trace counting pinned bytes), then back

The Host interface, what a replacement implements (class Host is the real one):
    pinned_empty(shape, dtype, device) -> Tensor   a host tensor for copies to and from `device`: page-locked
                                                   when `device` is CUDA, a plain CPU tensor otherwise; every
                                                   pinned byte megalysses allocates itself comes from here
    stream(device) -> stream | None                a new side stream of `device`; None where there are none
    current_stream(device) -> stream | None        the stream work on `device` is queued on now
    on(stream) -> context manager                  queue the work inside on `stream` (no-op for None)
    event(stream) -> event | None                  an event recorded on `stream` now (None for None)
    is_gpu(device) -> bool                         whether `device` is the GPU: CUDA (a trace: the device that
                                                   stands for it); `on_gpu(x)` asks the Host in use
    record_stream(x, stream)                       x's memory is not reused before the work queued on `stream`
                                                   so far has run (x.record_stream)
Callers keep CUDA's semantics: wait_stream, wait_event, query and synchronize on what these return, only where
a device is the GPU (a CPU copy is synchronous and needs none of them).

Pinned requests are not rounded up. torch's caching host allocator rounds every pinned request up to a power
of two (a 6 GiB block input takes 8 GiB) unless its pinned_max_round_threshold_mb is set; the settings made at
start-up set it, with pinned_max_cached_size_mb, to PINNED_EXACT_ABOVE_MB, so requests above 1 MiB are
allocated as asked (and not cached: freeing one returns it to CUDA). That covers FSDP2's CPUOffloadPolicy,
which pins its shards and gradients through torch. Where the torch in use has no such setting
(pinned_rounding_settable), the requests stay rounded and the memory model counts them rounded
(memory.Options.pinned_rounding, from Machine.pinned_exact).

The device allocator's setting: expandable_segments:True on CUDA unless the user set PYTORCH_ALLOC_CONF or
PYTORCH_CUDA_ALLOC_CONF (then theirs are kept as they are): segments that grow in place instead of one
cudaMalloc per large block, so a free range is rarely too fragmented to reuse.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import Tensor

USER_SETTINGS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
PINNED_EXACT_ABOVE_MB = 1
_PINNED_KEYS = ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")


@dataclass(frozen=True)
class AllocatorSettings:
    """The allocator settings of a run: what megalysses sets (`ours`, one PYTORCH_ALLOC_CONF string; empty for
    none) on top of the user's (`user`: 'NAME=value' of the variable they set, or empty), and whether pinned
    requests are allocated as asked (`pinned_exact`)."""

    ours: str
    user: str
    pinned_exact: bool

    def describe(self) -> str:
        """For the start-up line and runtime.json: what is in force and whose it is."""
        parts = ([f"{self.user} (the user's)"] if self.user else []) + ([self.ours] if self.ours else [])
        text = ", ".join(parts) or "torch's defaults"
        return text if self.pinned_exact else text + " (pinned requests rounded up: this torch cannot stop it)"


@functools.lru_cache(maxsize=1)
def pinned_rounding_settable() -> bool:
    """Whether this torch's allocator settings know pinned_max_round_threshold_mb (torch parses a known key's
    value and ignores an unknown key: a value that is not a number tells them apart, and changes nothing)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        return False
    try:
        setter(f"{_PINNED_KEYS[0]}:not-a-number")
    except (RuntimeError, ValueError) as e:    # a CUDA build may refuse an unknown key instead
        return "nrecognized" not in str(e)
    return False


def allocator_settings(cuda: bool, environ: Optional[Mapping[str, str]] = None) -> AllocatorSettings:
    """The settings a run on CUDA (`cuda`) makes at start-up, given the environment: expandable segments unless
    the user set PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF, and exact pinned requests unless their settings
    name a pinned_ key (or this torch has none). On a CPU: none."""
    environ = os.environ if environ is None else environ
    if not cuda:
        return AllocatorSettings("", "", True)
    user = next((f"{name}={environ[name]}" for name in USER_SETTINGS if environ.get(name)), "")
    ours = [] if user else ["expandable_segments:True"]
    pinned_user = any(key in user for key in _PINNED_KEYS)
    settable = pinned_rounding_settable()
    if settable and not pinned_user:
        ours += [f"{key}:{PINNED_EXACT_ABOVE_MB}" for key in _PINNED_KEYS]
    exact = settable and (not pinned_user or _PINNED_KEYS[0] in user)
    return AllocatorSettings(",".join(ours), user, exact)


def configure_allocator(cuda: bool) -> AllocatorSettings:
    """Make allocator_settings(cuda) at start-up, before the first CUDA allocation (torch reads them when its
    allocators start; later changes do not move what is allocated). Returns them."""
    settings = allocator_settings(cuda)
    if settings.ours:     # the user's settings first, parsed again with ours (a parse may reset what it omits)
        user = settings.user.split("=", 1)[1] if settings.user else ""
        torch._C._accelerator_setAllocatorSettings(",".join(x for x in (user, settings.ours) if x))
    return settings


class Host:
    """The real pieces: torch's pinned memory, CUDA streams and events (see the module docstring)."""

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=torch.device(device).type == "cuda")

    def stream(self, device: torch.device) -> Optional[Any]:
        return torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None

    def current_stream(self, device: torch.device) -> Optional[Any]:
        return torch.cuda.current_stream(device) if torch.device(device).type == "cuda" else None

    def on(self, stream: Optional[Any]) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def event(self, stream: Optional[Any]) -> Optional[Any]:
        if stream is None:
            return None
        done = torch.cuda.Event()
        done.record(stream)
        return done

    def is_gpu(self, device: torch.device) -> bool:
        return torch.device(device).type == "cuda"

    def record_stream(self, x: Tensor, stream: Any) -> None:
        x.record_stream(stream)


_active: list[Host] = [Host()]


def current() -> Host:
    """The Host in use: the real one unless `use` put another in its place."""
    return _active[-1]


def on_gpu(x: Tensor | torch.device) -> bool:
    """Whether x (a tensor or a device) is on the GPU, as the Host in use sees it."""
    return current().is_gpu(x if isinstance(x, torch.device) else x.device)


@contextlib.contextmanager
def use(host: Host) -> Iterator[Host]:
    """Run the block with `host` in place of the current Host (a trace's), then restore it."""
    _active.append(host)
    try:
        yield host
    finally:
        _active.remove(host)
