"""Measured memory, to check megalysses.memory's predictions against: what a forward leaves for its
backward, and the peak of live tensor bytes over any piece of code, on CPU as on GPU; and the host
synchronisations a piece of code makes (count_host_syncs).

    out, kept = measure_retained(lambda: model(ids, pos, labels=ids), exclude=tuple(model.parameters()))
    peak = measure_peak(lambda: train_step(...), baseline=tensors_that_exist_before)
    opt.optimizer.step = unmeasured(opt.optimizer.step)      # an offloaded update: host memory, not counted

Both watch every tensor the dispatcher produces (a TorchDispatchMode) and follow storages by weak
reference, so views are counted once and nothing is kept alive by the measurement. measure_peak is the
CPU's torch.cuda.max_memory_allocated: live bytes after every op, the maximum over the run (memory an op
allocates and frees inside its own kernel, such as a fused attention backward's workspace, is not seen).
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from megalysses import accelerator


SETTLE_POLLS, SETTLE_SECONDS = 100, 0.005


@dataclass
class Retained:
    """What one forward left alive for its backward: storages autograd saved (deduplicated) plus those
    created during the forward that are still referenced (checkpoint inputs are kept by closures, not
    saved tensors). Parameters and the forward's inputs and outputs are not counted."""

    bytes: int
    saved_bytes: int
    storages: list[tuple[int, tuple, str]]    # (bytes, shape, op) per retained storage, largest first


def measure_retained(forward: Callable[[], Any], exclude: tuple = ()) -> tuple[Any, Retained]:
    """Run `forward()` and measure the activation bytes it retains; `exclude`: tensors whose storage is
    not counted (parameters, inputs, host copies). Returns (forward's output, Retained)."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    created: dict[int, tuple] = {}
    saved: dict[int, tuple] = {}

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    st = t.untyped_storage()
                    seen = created.get(st._cdata)
                    if seen is None or seen[0].expired():     # first sight of this storage: who made it
                        created[st._cdata] = (StorageWeakRef(st), st.nbytes(), tuple(t.shape), str(func))
            return out

    def pack(t):
        st = t.untyped_storage()
        saved.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes(), tuple(t.shape), "saved"))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Track():
        out = forward()
    skip |= {t.untyped_storage()._cdata for t in tree_leaves(out) if isinstance(t, torch.Tensor)}

    def still_alive() -> dict:
        return {k: v for k, v in {**saved, **created}.items() if k not in skip and not v[0].expired()}

    gc.collect()           # a reference cycle the forward made must not count as retained
    alive = still_alive()
    if dist.is_initialized():
        # a collective's worker thread (gloo) lets go of its buffers a moment after the caller has its
        # result: wait until nothing more is released for a few polls
        quiet = 0
        for _ in range(SETTLE_POLLS):
            time.sleep(SETTLE_SECONDS)
            now = still_alive()
            quiet = quiet + 1 if len(now) == len(alive) else 0
            alive = now
            if quiet == 3:
                break
    saved_bytes = sum(v[1] for k, v in saved.items() if k not in skip)
    rows = sorted(((v[1], v[2], v[3]) for v in alive.values()), reverse=True)
    return out, Retained(bytes=sum(r[0] for r in rows), saved_bytes=saved_bytes, storages=rows)


@dataclass
class Peak:
    """The most live bytes seen, and what was alive then."""

    bytes: int = 0
    op: str = ""                                      # the op after which the peak was seen
    storages: list[tuple[int, tuple, str]] = None     # (bytes, shape, op that made it), largest first
    timeline: list[tuple[str, int]] = None             # (op, live bytes after it), with timeline=True


def measure_peak(run: Callable[[], Any], baseline: Iterable[torch.Tensor] = (), device: str = "cpu",
                 timeline: bool = False, exclude: Iterable[torch.Tensor] = (),
                 host: Optional[Callable[[], Iterable[torch.Tensor]]] = None) -> tuple[Any, Peak]:
    """Run `run()` and return (its result, the peak of live tensor bytes on `device`): the `baseline`
    tensors (weights, optimizer state: whatever exists before) while they live, plus every tensor made
    during the run while it lives, except the storages of `exclude` (on CPU: host copies standing for
    another memory) and of the tensors `host()` returns whenever the live bytes are counted (on CPU:
    tensors made during the run that live in host memory on a GPU, such as offloaded gradients).
    `timeline`: also record the live bytes after every op. Work that runs on the host (an offloaded
    optimizer's update) is left out by running it under `unmeasured()`."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    live: dict[int, tuple] = {}
    for t in baseline:
        if t.device.type == device:
            st = t.untyped_storage()
            live[st._cdata] = (StorageWeakRef(st), st.nbytes(), tuple(t.shape), "before")
    peak = Peak(storages=[], timeline=[] if timeline else None)
    # `total` counts every storage in `live` at the size it was last seen, freed or not: an upper bound of the
    # live bytes. The frees (and storages resized to nothing in place, as FSDP2 frees a gathered parameter's)
    # are looked for only when that bound passes the peak so far (or for the timeline), which finds the same
    # peak as looking after every op: the bound is never below the live bytes (a storage resized back up is
    # seen again in the outputs of the op that fills it).
    total = sum(v[1] for v in live.values())

    def purge() -> int:
        for key in [k for k, v in live.items() if v[0].expired()]:
            del live[key]
        for key, (ref, nbytes, shape, op) in live.items():
            now = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
            if now != nbytes:
                live[key] = (ref, now, shape, op)
        away = {t.untyped_storage()._cdata for t in host()} if host is not None else set()
        return sum(v[1] for k, v in live.items() if k not in away)

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal total
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == device:
                    st = t.untyped_storage()
                    if st._cdata in skip:
                        continue
                    seen = live.get(st._cdata)
                    if seen is None or seen[0].expired():
                        live[st._cdata] = (StorageWeakRef(st), st.nbytes(), tuple(t.shape), str(func))
                        total += st.nbytes() - (seen[1] if seen is not None else 0)
                    elif st.nbytes() != seen[1]:        # resized in place since it was seen
                        live[st._cdata] = (seen[0], st.nbytes(), seen[2], seen[3])
                        total += st.nbytes() - seen[1]
            if timeline or total > peak.bytes:
                total = purge()
            if timeline:
                peak.timeline.append((str(func), total))
            if total > peak.bytes:
                away = {t.untyped_storage()._cdata for t in host()} if host is not None else set()
                peak.bytes, peak.op = total, str(func)
                peak.storages = sorted(((v[1], v[2], v[3]) for k, v in live.items() if k not in away), reverse=True)
            return out

    with Track():
        out = run()
    return out, peak


def unmeasured(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run outside any measurement in progress: what it allocates is not counted (host-side work)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return fn(*args, **kwargs)
    return call


def host_resident(model: Any, opt: Any, runtime: Any,
                  activations: bool = True) -> Callable[[], list[torch.Tensor]]:
    """On CPU, what lists the tensors of a built run that live in host memory on a GPU, to pass to
    measure_peak's `host`: the activation offload's host copies (`activations`; its arena is made at the
    first step) and, where the plan puts the optimizer in host memory, its state, fp32 masters and reduced
    gradients (their arenas, by storage). Such an optimizer's update runs on the host: it is made
    `unmeasured` here."""
    from megalysses.model.policies import activation_offload

    chunks = model.chunks if hasattr(model, "chunks") else [model]
    held = runtime.optimizer in ("zero1-host", "fsdp-host")
    if held:
        opt.optimizer.step = unmeasured(opt.optimizer.step)

    def tensors() -> list[torch.Tensor]:
        offloads = [o for o in map(activation_offload, chunks) if o is not None] if activations else []
        out = [t for o in offloads for t in o.host_buffers()]
        if held:
            slots = getattr(opt, "slots", [])
            out += [_local(t) for st in opt.optimizer.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor)]
            out += [s.master for s in slots if s.master is not None]
            out += [s.host_grad for s in slots if s.host_grad is not None]
        return out
    return tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t



@dataclass
class HostSyncs:
    """The host synchronisations count_host_syncs saw, by reason: "step" for those a step makes, and the
    reasons the code gave with accelerator.host_wait ("save", "evaluation", "offload") for the others."""

    counts: dict[str, int] = field(default_factory=dict)
    seen: list[tuple[str, str]] = field(default_factory=list)    # (reason, what), in order

    @property
    def step(self) -> int:
        """The synchronisations made for the step itself."""
        return self.counts.get("step", 0)

    def apart(self) -> dict[str, int]:
        """The others, by reason."""
        return {k: v for k, v in self.counts.items() if k != "step"}

    def add(self, reason: str, what: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.seen.append((reason, what))


def _device_read(func: Any, args: tuple, kwargs: dict) -> Optional[tuple[torch.Tensor, str]]:
    """(the tensor read, the op) when `func` makes the host wait for a device value: a scalar read (.item(),
    bool(), float(): aten._local_scalar_dense) or a blocking copy from another device to the CPU."""
    if func is torch.ops.aten._local_scalar_dense.default:
        return args[0], "item"
    if func is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if dst.device.type == "cpu" and src.device.type not in ("cpu", "meta") and blocking:
            return src, "copy to the host"
    if func is torch.ops.aten._to_copy.default:
        where = kwargs.get("device")
        if (where is not None and torch.device(where).type == "cpu" and args[0].device.type not in ("cpu", "meta")
                and not kwargs.get("non_blocking", False)):
            return args[0], "copy to the host"
    return None


@contextlib.contextmanager
def count_host_syncs(host: Optional[Callable[[], Iterable[torch.Tensor]]] = None) -> Iterator[HostSyncs]:
    """Count the host synchronisations of the block: every scalar read of a tensor (`.item()`, `bool()`,
    `float()`: aten._local_scalar_dense), every blocking copy from a GPU to the host, and every
    accelerator.synchronize and read_back, each under the reason accelerator.host_wait gives ("step" outside
    any). On a CPU the device is the CPU, so the ops are counted, not time: a read of a tensor `host()` lists
    (one that lives in host memory on a GPU too, such as AdamW's step counts) is no synchronisation and is
    left out. `.tolist()` of a CPU tensor dispatches no op and is not seen (on a GPU it copies to the host
    first, and that copy is).

        with count_host_syncs(lambda: adam_step_counts(opt)) as syncs:
            train_step(...)
        assert syncs.step == 0, syncs.seen
    """
    syncs = HostSyncs()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            read = None if accelerator.telling() else _device_read(func, args, kwargs)
            if read is not None:
                away = {t.untyped_storage()._cdata for t in host()} if host is not None else set()
                if read[0].untyped_storage()._cdata not in away:
                    syncs.add(accelerator.wait_reason(), f"{read[1]} ({func})")
            return func(*args, **kwargs)

    with accelerator.watch(syncs.add), Count():
        yield syncs


def adam_step_counts(opt: Any) -> list[torch.Tensor]:
    """The AdamW step counts of an optimizer (parallel/optimizer.py): host tensors, read by torch's update."""
    return [st["step"] for st in opt.optimizer.state.values() if "step" in st]
