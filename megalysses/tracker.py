"""Live bytes over a run of fake tensors, per memory: the device (meta tensors standing for the GPU), host
memory (fake CPU tensors) and the pinned part of it, with the moment and the largest tensors at each one's
peak. It is what megalysses.training.trace measures a training step with.

    with FakeTensorMode(allow_non_fake_inputs=True), LiveBytes() as live:
        model, opt = build(...)                  # counted from here on: weights, optimizer state
        live.reset_peaks()
        with live.part("optimizer"): ...       # a name for the moments inside (default: forward, backward)
        live.peaks["device"].bytes, live.peaks["device"].moment, live.peaks["device"].largest
        live.peaks["host"], live.peaks["pinned"]             # all host memory, and its pinned part

Every storage an op makes is counted once (views share it) from the op that makes it until it is freed
(a weak reference's callback), and resized storages (FSDP2 frees and refills its gathered weights with
`untyped_storage().resize_`) change size where they are resized. A tensor the code allocates is counted,
whatever the code believes it keeps. Host tensors made inside `pinned()`, or marked with `mark_pinned`,
are pinned memory (what megalysses.accelerator's pinned buffers are on a GPU); `transient` counts device
bytes that an op allocates and frees inside its kernel (a fused attention backward's fp32 accumulator) at
that op, and `workspaces` says which ops' kernels do, and how much.

Fake tensors hold no data, so an op whose output depends on the data cannot run: `nonzero` is given its
largest output (every element selected: an upper bound of the bytes), and `.item()` a value that lets the
code go on as on good data (a finite number, no NaN, no out-of-order input). Another such op fails with an
error naming it. Why not torch.distributed._tools.mem_tracker.MemTracker: it keeps per-module snapshots but
not the largest tensors at the peak, cannot tell pinned host memory from the rest, cannot count the
workspaces inside a kernel, and stops at the data-dependent ops of a real training step.
"""
from __future__ import annotations

import contextlib
import heapq
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch._guards import active_fake_mode
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

DEVICE, PINNED, HOST = "device", "pinned", "host"
_OTHER = "other"                        # host memory that is not pinned
# the accounts a storage of each kind counts in: host memory is pinned memory and the rest
_ACCOUNTS = {DEVICE: (DEVICE,), PINNED: (PINNED, HOST), _OTHER: (HOST,)}
_MODULE = "megalysses_module"           # a module's name on the gradient nodes of its outputs
MEMORIES = (DEVICE, PINNED, HOST)
PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep      # this package's own directory
_EXACT, _TORCH = "exact", "torch"       # how pinned host memory is being allocated (LiveBytes._pinning)
aten = torch.ops.aten


@dataclass(frozen=True)
class Moment:
    """Where a run was: `part` (forward, backward, or a name given with LiveBytes.part), the innermost
    module running (its name in the model; in a backward, the module whose forward runs again (checkpointing)
    or whose output's gradient node ran last), the op just run and the innermost megalysses function on the
    Python stack (file:function)."""

    part: str = ""
    module: str = ""
    op: str = ""
    where: str = ""

    def __str__(self) -> str:
        return ", ".join(x for x in (self.part, self.module, self.where, self.op) if x)


@dataclass(frozen=True)
class Alive:
    """One storage alive at a peak: its bytes, the shape and dtype of the tensor that made it, the op and
    the moment that made it."""

    bytes: int
    shape: tuple
    dtype: str
    made: str


@dataclass
class Peak:
    bytes: int = 0
    moment: Moment = field(default_factory=Moment)
    largest: list[Alive] = field(default_factory=list)


class _Storage:
    __slots__ = ("nbytes", "memory", "alive", "ref")

    def __init__(self, nbytes: int, memory: str, alive: Alive) -> None:
        self.nbytes, self.memory, self.alive = nbytes, memory, alive


class LiveBytes(TorchDispatchMode):
    """Counts the live bytes of every fake tensor made inside, per memory (see the module docstring).
    `keep`: how many of the largest storages a peak lists; `torch_pinned`: the bytes a pinned request of torch's
    own (a pinned copy, a non-blocking copy from the device) takes in torch's caching host allocator (default:
    as asked)."""

    def __init__(self, keep: int = 12, timeline: bool = False,
                 torch_pinned: Optional[Callable[[int], int]] = None) -> None:
        super().__init__()
        self.keep = keep
        # with `timeline`: (op, part, module, device bytes) after every op that allocates on the device
        self.timeline: Optional[list[tuple[str, str, str, int]]] = [] if timeline else None
        self.current = dict.fromkeys(MEMORIES, 0)
        self.peaks = {m: Peak() for m in MEMORIES}
        self._live: dict[int, _Storage] = {}
        # a peak's storages are listed once the bytes stop rising: what is alive then, and what was freed
        # since the peak (memory -> freed storages, for the memories whose newest peak is not listed yet)
        self._pending: dict[str, list[_Storage]] = {}
        self._part: list[str] = []
        self._names: dict[int, str] = {}            # id(module) -> its name in the model (name_modules)
        self._running: list[str] = []               # the modules whose forward is running, innermost last
        self._last = ""                             # in a backward: the module whose gradient node ran last
        self._hooks: list[Any] = []
        self._resize: Optional[Callable] = None
        self._false = WeakIdKeyDictionary()         # tensors whose .item() is False (see _plausible_scalar)
        # host tensors made now are pinned: False, EXACT (`pinned`: the bytes asked) or TORCH (by torch's caching
        # host allocator: `torch_pinned` of the bytes asked, which rounds them as the machine's torch does)
        self._pinning: Any = False
        self.torch_pinned = torch_pinned or (lambda nbytes: nbytes)
        self.before = 0                             # device bytes alive at reset_peaks (what a step starts with)
        self.largest_allocation = 0                 # the largest single device allocation since reset_peaks
        # op -> the device bytes its kernel allocates and frees inside, from its arguments (the workspaces of
        # the GPU's attention kernels: megalysses.kernels.gpu_forms)
        self.workspaces: dict[Any, Callable[..., int]] = {}

    # ------------------------------------------------------------------ what the caller says
    def reset_peaks(self) -> None:
        """Forget the peaks so far: the next peaks are of what runs from now on (over what is alive now)."""
        self._pending = {m: [] for m in MEMORIES}
        for m in MEMORIES:
            self.peaks[m] = Peak(self.current[m], self._moment("reset_peaks"))
        self.before, self.largest_allocation = self.current[DEVICE], 0

    def name_modules(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Name the moments inside `model`'s modules by their names in it."""
        for name, module in model.named_modules(prefix=prefix):
            self._names[id(module)] = name or type(module).__name__

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Moments inside are in part `name`."""
        self._part.append(name)
        try:
            yield
        finally:
            self._part.pop()

    def mark_pinned(self, t: torch.Tensor) -> None:
        """t's storage (a host tensor) is pinned memory."""
        (t,) = plain_tensors([t])
        st = self._live.get(t.untyped_storage()._cdata)
        if st is None:
            st = self._add(t, "mark_pinned")
        if st.memory == _OTHER:
            self._arrive(PINNED, st.nbytes)
            st.memory = PINNED
            self._note(PINNED, "mark_pinned")

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """Host tensors made inside are pinned memory."""
        self._pinning = _EXACT
        try:
            yield
        finally:
            self._pinning = False

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors made before this tracker started (while they live)."""
        for t in plain_tensors(tensors):
            if t.untyped_storage()._cdata not in self._live:
                self._add(t, "before")

    def transient(self, nbytes: int, what: str) -> None:
        """`nbytes` of the device allocated and freed again right here (a kernel's workspace): a peak if it
        makes one."""
        workspace = _Storage(nbytes, DEVICE, Alive(nbytes, (nbytes,), "uint8", str(self._moment(what))))
        self.largest_allocation = max(self.largest_allocation, nbytes)
        self._arrive(DEVICE, nbytes)
        self._live[id(workspace)] = workspace
        self._note(DEVICE, what)
        del self._live[id(workspace)]
        self._leave(workspace)

    # ------------------------------------------------------------------ bookkeeping
    def _memory(self, t: torch.Tensor) -> Optional[str]:
        kind = t.device.type
        return DEVICE if kind == "meta" else (PINNED if self._pinning else _OTHER) if kind == "cpu" else None

    def _moment(self, op: str) -> Moment:
        if self._part:
            part = self._part[-1]
        else:
            part = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        if self._running:
            module = self._running[-1]
        elif part == "backward":       # the module whose output's gradient node ran last
            node = torch._C._current_autograd_node()
            module = node.metadata.get(_MODULE, self._last) if node is not None else self._last
            self._last = module
        else:
            module = ""
        frame, where = sys._getframe(2), ""
        while frame is not None:
            name = project_file(frame.f_code.co_filename)      # (not a dispatch mode's own frame: a roofline's)
            if name is not None and name != "tracker.py" and frame.f_code.co_name != "__torch_dispatch__":
                where = f"{name}:{frame.f_code.co_name}"
                break
            frame = frame.f_back
        return Moment(part, module, op, where)

    def _arrive(self, account: str, nbytes: int) -> None:
        """Bytes about to be added to `account`: a peak not listed yet whose bytes have since dropped is listed
        first (the state at that peak is what is alive now and what was freed since)."""
        if self._pending.get(account):
            self._list(account)
        self.current[account] += nbytes

    def _leave(self, st: _Storage) -> None:
        for account in _ACCOUNTS[st.memory]:
            self.current[account] -= st.nbytes
            if account in self._pending:
                self._pending[account].append(st)

    def _add(self, t: torch.Tensor, op: str) -> _Storage:
        storage = t.untyped_storage()
        key = storage._cdata
        memory = self._memory(t) or _OTHER
        made = str(self._moment(op)) if op not in ("before", "mark_pinned") else op
        nbytes = int(self.torch_pinned(storage.nbytes())) if self._pinning is _TORCH else storage.nbytes()
        st = _Storage(nbytes, memory, Alive(nbytes, tuple(t.shape), str(t.dtype).replace("torch.", ""), made))
        st.ref = weakref.ref(storage, lambda _, key=key, st=st: self._free(key, st))
        if memory == DEVICE:
            self.largest_allocation = max(self.largest_allocation, st.nbytes)
        for account in _ACCOUNTS[memory]:
            self._arrive(account, st.nbytes)
        self._live[key] = st
        return st

    def _free(self, key: int, st: _Storage) -> None:
        if self._live.get(key) is st:
            del self._live[key]
            self._leave(st)

    def _note(self, account: str, op: str) -> None:
        """After bytes were added to `account`: a new peak (its storages listed once the bytes stop rising)."""
        if self.current[account] > self.peaks[account].bytes:
            self.peaks[account] = Peak(self.current[account], self._moment(op))
            self._pending[account] = []

    def _list(self, account: str) -> None:
        rows = [s for s in self._live.values() if account in _ACCOUNTS[s.memory] and s.nbytes] + \
            [s for s in self._pending.pop(account) if s.nbytes]
        self.peaks[account].largest = [s.alive for s in heapq.nlargest(self.keep, rows, key=lambda s: s.nbytes)]

    def _resized(self, storage: torch.UntypedStorage, size: int) -> None:
        st = self._live.get(storage._cdata)
        if st is None or size == st.nbytes:
            return
        for account in _ACCOUNTS[st.memory]:
            if size < st.nbytes:
                if account in self._pending:        # listed as it was at the peak
                    self._list(account)
                self.current[account] -= st.nbytes - size
            else:
                self._arrive(account, size - st.nbytes)
        grown = size > st.nbytes
        st.nbytes = size
        st.alive = Alive(size, st.alive.shape, st.alive.dtype, st.alive.made)
        if grown:
            for account in _ACCOUNTS[st.memory]:
                self._note(account, "resize_")

    # ------------------------------------------------------------------ the dispatch mode
    def _enter_module(self, module: torch.nn.Module, args: Any) -> None:
        self._running.append(self._names.get(id(module), type(module).__name__))

    def _exit_module(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if self._running:
            name = self._running.pop()
            for t in tree_leaves(out):      # its backward starts at its outputs' gradient nodes
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    t.grad_fn.metadata[_MODULE] = name

    def __enter__(self) -> "LiveBytes":
        self._fake_mode = active_fake_mode()
        self._hooks = [register_module_forward_pre_hook(self._enter_module),
                       register_module_forward_hook(self._exit_module)]
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            tracker._resized(storage, size)
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        torch.UntypedStorage.resize_ = self._resize
        for hook in self._hooks:
            hook.remove()
        for memory in list(self._pending):
            self._list(memory)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if active_fake_mode() is not self._fake_mode:   # DTensor's sharding propagation, in a fake mode of its own
            return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            return self._plausible_scalar(args[0])
        if func is aten.nonzero.default:        # every element selected: the most bytes it can take
            (x,) = args
            out = torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        elif func is aten._pin_memory.default:  # a pinned copy (fake tensors have no pinning of their own)
            out = torch.empty_like(args[0])
        else:
            try:
                out = func(*args, **kwargs)
            except (torch._subclasses.fake_tensor.DataDependentOutputException,
                    torch._subclasses.fake_tensor.DynamicOutputShapeException) as e:
                raise RuntimeError(f"a memory trace cannot run {func} on fake tensors: its output depends on the "
                                   f"data ({self._moment(str(func))}); give it a form that runs without data") from e
        # pinned: a pinned copy, and a non-blocking copy from the GPU to the host (torch pins it on CUDA)
        pinning = self._pinning
        by_torch = func is aten._pin_memory.default or (
            func is aten._to_copy.default and bool(kwargs.get("non_blocking")) and args[0].device.type == "meta")
        self._pinning = pinning or (_TORCH if by_torch else False)
        touched = set()
        try:
            for t in plain_tensors(tree_leaves(out)):
                if self._memory(t) is not None and t.untyped_storage()._cdata not in self._live:
                    touched.update(_ACCOUNTS[self._add(t, str(func)).memory])
        finally:
            self._pinning = pinning
        for account in touched:
            self._note(account, str(func))
        workspace = self.workspaces.get(func)
        if workspace is not None:
            self.transient(workspace(*args, **kwargs), f"{func}'s workspace")
        if self.timeline is not None and DEVICE in touched:
            m = self._moment(str(func))
            self.timeline.append((m.op, m.part, m.module, self.current[DEVICE]))
        if func in _FALSE_ON_GOOD_DATA:
            self._false[out] = True
        return out

    def _plausible_scalar(self, t: torch.Tensor) -> Any:
        """What `.item()` of a fake tensor returns: what good data gives. A boolean is a check on the data:
        True (isfinite, all), except whether any element is bad (any: False); a number is finite and positive
        (a token count, a norm)."""
        if t.dtype == torch.bool:
            return t not in self._false
        return 1.0 if t.dtype.is_floating_point else 1


def project_file(filename: str, package: str = PACKAGE) -> Optional[str]:
    """`filename` relative to the megalysses package's directory `package` (ending in a separator), or None
    for a file outside it (torch's own, a test's: wherever the checkout and its virtual environment are)."""
    if filename.startswith(package):
        return filename[len(package):]
    real = os.path.realpath(filename)
    return real[len(package):] if real.startswith(package) else None


def plain_tensors(leaves: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors that hold memory among `leaves`: a wrapper subclass (DTensor) holds its inner tensors'."""
    for t in leaves:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            yield from plain_tensors(getattr(t, name) for name in names)
        elif isinstance(t, torch.Tensor):
            yield t


# ops whose boolean result good data makes False (any element out of order, NaN, ...); other booleans are True
_FALSE_ON_GOOD_DATA = {aten.any.default, aten.any.dim, aten.any.dims}
