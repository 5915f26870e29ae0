"""What megalysses asks of a CUDA device beyond its tensors, in one place: the caching allocators' settings made
at start-up, page-locked (pinned) host memory, and the side streams and events that overlap host copies with
compute. Everything else runs on plain tensors; a memory trace on a CPU swaps this module's Host for its own.

    settings = configure_allocator(cuda=True)          # at start-up, before the first CUDA allocation
    host = current()                                   # the Host in use
    buf = host.pinned_empty((n, h), torch.bfloat16, device)        # host memory for copies with `device`
    side = host.stream(device)                         # a side stream (None on a CPU)
    with host.on(side): ...; done = host.event(side)   # queue work on it; an event after it
    with use(MyHost()): ...                            # another Host (a trace counting pinned bytes), then back
    values = read_back(figures)                        # device values on the host: the host waits for them
    with host_wait("save"): ...; synchronize(done)     # waits made for a save, not the step (counted apart)

The Host interface, what a replacement implements (class Host is the real one):
    pinned_empty(shape, dtype, device) -> Tensor   a host tensor for copies to and from `device`, exactly as
                                                   large as asked: page-locked when `device` is CUDA, a meta
                                                   tensor when it is meta (a dry run), a plain CPU tensor
                                                   otherwise; every pinned byte megalysses allocates itself
                                                   comes from here (megalysses/pinned_arena.py slices it)
    stream(device) -> stream | None                a new side stream of `device`; None where there are none
    current_stream(device) -> stream | None        the stream work on `device` is queued on now
    on(stream) -> context manager                  queue the work inside on `stream` (no-op for None)
    event(stream) -> event | None                  an event recorded on `stream` now (None for None)
    is_gpu(device) -> bool                         whether `device` is the GPU: CUDA (a trace: the device that
                                                   stands for it); `on_gpu(x)` asks the Host in use
    holds_values(device) -> bool                   whether tensors made on `device` hold values to initialise:
                                                   not on the meta device (a dry run's shapes and dtypes), not
                                                   in a trace (fake tensors)
    record_stream(x, stream)                       x's memory is not reused before the work queued on `stream`
                                                   so far has run (x.record_stream)
Callers keep CUDA's semantics: wait_stream, wait_event, query and synchronize on what these return, only where
a device is the GPU (a CPU copy is synchronous and needs none of them).

Pinned requests are not rounded up. torch's caching host allocator (pin_memory=True, Tensor.pin_memory, a
non-blocking copy to the CPU) rounds every request up to a power of two unless pinned_max_round_threshold_mb
says otherwise, a setting torch 2.11 does not have. So the real Host pins none of its memory through it: it
allocates plain (pageable) host memory of exactly the size asked and registers that range with CUDA
(cudaHostRegister, portable to every device; unregistered when the memory is freed), as torch's own
distributed-checkpoint stager does. A registered range is pinned memory to torch as to CUDA: is_pinned()
asks cudaPointerGetAttributes, which reports it as host memory, and a non_blocking copy is one
cudaMemcpyAsync, asynchronous from page-locked memory, whatever allocated it (ATen's Copy.cu; the caching
host allocator's record_event ignores an address it did not allocate).

What torch pins for itself is still its allocator's: FSDP2's CPUOffloadPolicy pins each parameter's padded
shard at fully_shard and the first micro-batch's gradient shard (a non-blocking copy to the CPU) of every
step. Where the torch in use has pinned_max_round_threshold_mb (pinned_rounding_settable), the settings made
at start-up set it, with pinned_max_cached_size_mb, to PINNED_EXACT_ABOVE_MB, so those requests above 1 MiB
are allocated as asked; requests of 1 MiB or less, and all of them on a torch without the setting, are
rounded up, and the memory model counts them rounded (memory.Options.pinned_rounding, from
Machine.pinned_exact; memory.types.torch_pinned).

The device allocator's setting: expandable_segments:True on CUDA unless the user set PYTORCH_ALLOC_CONF or
PYTORCH_CUDA_ALLOC_CONF (then theirs are kept as they are): segments that grow in place instead of one
cudaMalloc per large block, so a free range is rarely too fragmented to reuse.
"""
from __future__ import annotations

import contextlib
import functools
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Generic, Iterator, Mapping, Optional, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")

USER_SETTINGS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
PINNED_EXACT_ABOVE_MB = 1
_PINNED_KEYS = ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")
_HOST_REGISTER_PORTABLE = 1            # cudaHostRegisterPortable: pinned for every CUDA context of the process


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
        return text if self.pinned_exact else text + " (torch's own pinned requests rounded up: it cannot stop it)"


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


def register_pinned(t: Tensor) -> None:
    """Page-lock the memory of the CPU tensor `t` (its whole storage, exactly) for CUDA's copies, until the
    storage is freed."""
    storage = t.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE))
    unregister = weakref.finalize(storage, _unregister_pinned, ptr)
    unregister.atexit = False          # not after CUDA has gone at exit: the process's memory goes with it


def _unregister_pinned(ptr: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))


class Host:
    """The real pieces: torch's pinned memory, CUDA streams and events (see the module docstring)."""

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        kind = torch.device(device).type
        if kind == "meta":
            return torch.empty(shape, dtype=dtype, device="meta")
        t = torch.empty(shape, dtype=dtype, device="cpu")
        if kind == "cuda" and t.numel():
            register_pinned(t)
        return t

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

    def holds_values(self, device: torch.device) -> bool:
        return torch.device(device).type != "meta"

    def record_stream(self, x: Tensor, stream: Any) -> None:
        x.record_stream(stream)


class Replaceable(Generic[T]):
    """One implementation in use: `default`, unless a `use` block put another in its place (a trace's forms of
    the Host here, of the GPU's attention kernels in kernels/attention.py)."""

    def __init__(self, default: T) -> None:
        self._stack = [default]

    def current(self) -> T:
        return self._stack[-1]

    @contextlib.contextmanager
    def use(self, replacement: T) -> Iterator[T]:
        """Run the block with `replacement` in place of the one in use, then restore it."""
        self._stack.append(replacement)
        try:
            yield replacement
        finally:
            self._stack.remove(replacement)


_HOST = Replaceable(Host())


def current() -> Host:
    """The Host in use: the real one unless `use` put another in its place."""
    return _HOST.current()


def on_gpu(x: Tensor | torch.device) -> bool:
    """Whether x (a tensor or a device) is on the GPU, as the Host in use sees it."""
    return current().is_gpu(x if isinstance(x, torch.device) else x.device)


def use(host: Host) -> ContextManager[Host]:
    """Run the block with `host` in place of the current Host (a trace's), then restore it."""
    return _HOST.use(host)


# ---------------------------------------------------------------------- host waits
# Where the host waits for the device, said in one place so that it can be counted (measure.count_host_syncs):
# a step reads its figures back once, on a logging step (read_back); a save, an evaluation and an offloaded
# optimizer's host update wait for their own reasons (host_wait), counted apart from the step's.
_waits: list[str] = []
_watchers: list[Callable[[str, str], None]] = []
_telling: list[str] = []


@contextlib.contextmanager
def host_wait(reason: str) -> Iterator[None]:
    """The host synchronisations inside are made for `reason` ("save", "evaluation", "offload"), not the step."""
    _waits.append(reason)
    try:
        yield
    finally:
        _waits.pop()


def wait_reason() -> str:
    """What a host synchronisation made now is for: the innermost host_wait's reason, else "step"."""
    return _waits[-1] if _waits else "step"


@contextlib.contextmanager
def watch(watcher: Callable[[str, str], None]) -> Iterator[None]:
    """Tell `watcher(reason, what)` of every synchronize and read_back while the block runs."""
    _watchers.append(watcher)
    try:
        yield
    finally:
        _watchers.remove(watcher)


def telling() -> bool:
    """Whether a synchronize or read_back the watchers have been told of is in progress (its own copy is
    that one synchronisation, not another)."""
    return bool(_telling)


@contextlib.contextmanager
def _told(what: str) -> Iterator[None]:
    for watcher in list(_watchers):
        watcher(wait_reason(), what)
    _telling.append(what)
    try:
        yield
    finally:
        _telling.pop()


def synchronize(waitable: Any, reason: Optional[str] = None) -> None:
    """The host waits until the work queued on a stream, or before an event, has run (its .synchronize()), for
    `reason` (a host_wait's; by default the one in force)."""
    with host_wait(reason or wait_reason()), _told(f"{type(waitable).__name__}.synchronize"):
        waitable.synchronize()


def read_back(t: Tensor) -> list:
    """t's values as Python numbers: one copy to the host, the host waiting for it when t is on a GPU."""
    with _told("read_back"):
        return t.detach().cpu().tolist()
