"""A traced roofline of one training step: the seconds of every operation the traced step
(megalysses/training/trace.py) dispatches, on the streams the code queues it on, by category.

    with FakeTensorMode(...), LiveBytes() as live, Roofline(hw) as roof:   # inside the trace's modes
        ... one train_step ...
    roof.result(micro_batches).seconds      # {category: seconds} per optimizer step, CATEGORIES

What each operation costs:
  FLOPs     matmuls and torch's attention kernels by torch's own formulas (torch.utils.flop_counter), its
            attention kernels' scaled to the pairs causality leaves; the attention kernels that torch has no
            formula for (varlen, flash-attn, FlexAttention) by the formulas beside their fake forms
            (megalysses.kernels.gpu_forms: the pairs their masks allow), and FlexAttention's block-mask builds
            by their mask evaluations (one mask_mod call per (query, key) pair, at MASK_EVALUATION_OPS scalar
            operations on the CUDA cores, CUDA_CORE_SHARE of the tensor peak).
  bytes     every device tensor an op reads or writes (its inputs, and its outputs or, for an in-place op
            that returns nothing (torch's foreach ops), the arguments it writes), Triton launches by their
            tensor arguments; host <-> device copies by the bytes copied; collectives by the bytes each
            rank sends on a ring ((n - 1) / n of the buffer; twice for an all-reduce), point-to-point by the
            message.
  seconds   an op on the device: the larger of its FLOPs at Hardware.peak_tflops x the efficiency of its
            class (matmul: matmul_efficiency, attention: attention_efficiency, memory-bound: none)
            and its bytes at hbm_gbs, plus launch_us for the launch; a collective at its group's link
            (intra- or inter-node by the span of its ranks: Hardware.link); a copy at host_gbs; an op on
            host tensors (the optimizer on the host's cores) at host_adam_gparams, HOST_ADAM_PASSES passes
            of its elements per parameter.
Overlap is what the code arranges and no more: each stream (megalysses.accelerator's side streams and
FSDP2's, given by the trace) has a clock that its ops advance; an event holds its stream's clock and a wait
on it moves the waiting stream's clock up to it; a collective runs on its group's own channel from the
moment it is queued, a synchronous one holding its stream until it ends, an asynchronous one holding back
only the next op that reads or writes its buffers. The step's seconds are the main stream's (the default
one's); what it waits for (a collective, a copy on a side stream) counts in that one's category.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from megalysses.plan.step_time import Hardware
from megalysses.tracker import plain_tensors

COMPUTE, ATTENTION, MASKS, COMMUNICATION, HOST_COPIES, OPTIMIZER, LAUNCHES = (
    "compute", "attention", "masks", "communication", "host copies", "optimizer", "launches")
CATEGORIES = (COMPUTE, ATTENTION, MASKS, COMMUNICATION, HOST_COPIES, OPTIMIZER, LAUNCHES)
MASK_EVALUATION_OPS = 16     # scalar operations of one mask_mod call (indices, document ids, compare, and)
CUDA_CORE_SHARE = 1 / 15     # the CUDA cores' fp32/int32 rate against the dense bf16 tensor peak (H100 SXM)
HOST_ADAM_PASSES = 10        # elementwise passes of torch's foreach AdamW over each parameter on the host
aten = torch.ops.aten
# ops that launch no kernel: views, metadata, allocation without initialisation
_NO_KERNEL = {aten.detach.default, aten.alias.default, aten.empty.memory_format, aten.empty_like.default,
              aten.empty_strided.default, aten.new_empty.default, aten.new_empty_strided.default,
              aten.lift_fresh.default, aten._local_scalar_dense.default, aten.set_.source_Storage_storage_offset,
              aten.resize_.default, aten._unsafe_view.default, aten._reshape_alias.default}
_ATTENTION_OPS = {"_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
                  "_flash_attention_backward", "_efficient_attention_backward", "flex_attention",
                  "flex_attention_backward"}
_ATTENTION_OPS |= {name + "_backward" for name in list(_ATTENTION_OPS)}
# in-place matmuls (model/tiled.py's head chunks sum their partial products with addmm_) by the formula of their
# out-of-place form, which torch.utils.flop_counter has alone
_IN_PLACE = {aten.addmm_: flop_registry[aten.addmm], aten.baddbmm_: flop_registry[aten.baddbmm]}
_COLLECTIVE_FACTOR = {"allreduce_": 2.0, "_allgather_base_": 1.0, "allgather_": 1.0, "_reduce_scatter_base_": 1.0,
                      "reduce_scatter_": 1.0, "alltoall_base_": 1.0, "broadcast_": 1.0, "send": 0.0, "recv_": 0.0}


@dataclass
class Tally:
    """What the ops of part of a step add up to: seconds on the main stream by category, and the counts."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    flops: dict[str, float] = field(default_factory=lambda: {"matmul": 0.0, "attention": 0.0})
    device_bytes: float = 0.0          # read and written in device memory
    host_bytes: float = 0.0            # copied between host and device, either way
    collective_bytes: dict[str, float] = field(default_factory=dict)    # per "kind over n ranks (intra/inter)"
    launches: int = 0
    host_syncs: int = 0                # .item() (aten._local_scalar_dense) and blocking device-to-host copies
    mask_evaluations: float = 0.0
    by_op: dict[str, float] = field(default_factory=dict)     # seconds on the main stream by op (or kernel form)

    def add(self, other: "Tally", times: float = 1.0) -> None:
        for k, v in other.seconds.items():
            self.seconds[k] += v * times
        for k, v in other.flops.items():
            self.flops[k] += v * times
        for k, v in other.collective_bytes.items():
            self.collective_bytes[k] = self.collective_bytes.get(k, 0.0) + v * times
        for k, v in other.by_op.items():
            self.by_op[k] = self.by_op.get(k, 0.0) + v * times
        self.device_bytes += other.device_bytes * times
        self.host_bytes += other.host_bytes * times
        self.launches += round(other.launches * times)
        self.host_syncs += round(other.host_syncs * times)
        self.mask_evaluations += other.mask_evaluations * times

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


class _Clocked:
    """What a trace's stream and event answer as CUDA's do where a clock has no use for it: complete at once,
    nothing to wait for on the host, any other method doing nothing."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class Stream(_Clocked):
    """A stream of the trace: its clock (the seconds of the work queued on it so far). Methods as CUDA's;
    the ones a clock has no use for do nothing."""

    def __init__(self, roof: "Roofline") -> None:
        self.roof, self.clock, self.last = roof, 0.0, COMPUTE

    def wait_stream(self, other: "Stream") -> None:
        self.roof.wait(self, other.clock, other.last)

    def wait_event(self, event: "Event") -> None:
        self.roof.wait(self, event.time, event.last)

    def record_event(self, event: Optional["Event"] = None) -> "Event":
        event = event or Event(self.roof)
        event.record(self)
        return event


class Event(_Clocked):
    """An event of the trace: the clock of the stream it was recorded on, then."""

    def __init__(self, roof: "Roofline", *args: Any, **kwargs: Any) -> None:
        self.roof, self.time, self.last = roof, 0.0, COMPUTE

    def record(self, stream: Optional[Stream] = None) -> None:
        stream = stream or self.roof.current
        self.time, self.last = stream.clock, stream.last

    def wait(self, stream: Optional[Stream] = None) -> None:
        (stream or self.roof.current).wait_event(self)



class Roofline(TorchDispatchMode):
    """Times every op dispatched inside (see the module docstring) on the streams of the trace (`stream`,
    `on`, `Event`: what the trace's accelerator and FSDP2's device module hand out). `mark` starts a new part
    of the step (a micro-batch); `optimizer` names the ops inside the optimizer step's; `category` puts the
    device kernels inside in a category of their own (a block mask's build: masks); `costs` maps an op to its
    KernelCost (megalysses.kernels.gpu_forms.COSTS, for ops torch has no formula for)."""

    def __init__(self, hw: Hardware) -> None:
        super().__init__()
        self.hw = hw
        self.main = self.current = Stream(self)
        self.costs: dict[Any, Any] = {}
        self.parts: list[tuple[str, Tally]] = []
        self.tally, self._part = Tally(), "start"
        self._channels: dict[Any, float] = {}        # a group's channel (and direction) -> its clock
        self._pending: dict[int, float] = {}         # storage -> when the collective writing it ends
        self._category: Optional[str] = None
        self._optimizer = False

    # ------------------------------------------------------------------ what the trace says
    def stream(self) -> Stream:
        return Stream(self)

    @contextlib.contextmanager
    def on(self, stream: Optional[Stream]) -> Iterator[None]:
        """Queue the ops inside on `stream` (None: where they were)."""
        before, self.current = self.current, stream or self.current
        try:
            yield
        finally:
            self.current = before

    def mark(self, name: str) -> None:
        """A new part of the step starts here (what ran since the last mark is one part)."""
        self.parts.append((self._part, self.tally))
        self.tally, self._part = Tally(), name

    @contextlib.contextmanager
    def optimizer(self) -> Iterator[None]:
        self._optimizer = True
        try:
            yield
        finally:
            self._optimizer = False

    @contextlib.contextmanager
    def category(self, name: str) -> Iterator[None]:
        before, self._category = self._category, name
        try:
            yield
        finally:
            self._category = before

    def wait(self, stream: Stream, until: float, what: str) -> None:
        """`stream` waits until `until` for work of category `what`: the main stream's wait counts there, and a
        stream that waits on one that last waited (for a collective on FSDP2's streams) counts it as that."""
        if until > stream.clock:
            what = what if what in CATEGORIES else COMMUNICATION
            if stream is self.main:
                self.tally.seconds[what] += until - stream.clock
            stream.clock, stream.last = until, what

    def finish(self) -> None:
        """The end of the step: the main stream waits for every channel (the step's last host sync)."""
        self.wait(self.main, max(self._channels.values(), default=0.0), COMMUNICATION)
        self.mark("")

    # ------------------------------------------------------------------ costs
    def run(self, seconds: float, category: str, launches: int = 1, name: str = "") -> None:
        """`seconds` of work of `category` (by op `name`) on the current stream, and its launches."""
        stream = self.current
        launch = launches * self.hw.launch_us * 1e-6
        stream.clock += seconds + launch
        stream.last = category
        self.tally.launches += launches
        if stream is self.main:
            self.tally.seconds[category] += seconds
            self.tally.seconds[LAUNCHES] += launch
            self.tally.by_op[name] = self.tally.by_op.get(name, 0.0) + seconds

    def kernel(self, flops: float, kind: str, nbytes: float, launches: int = 1, mask_evaluations: float = 0.0,
               name: str = "") -> None:
        """A device kernel: `flops` of class `kind` (matmul, attention, memory), `nbytes` of device memory read and
        written, `mask_evaluations` of a block mask's mask_mod."""
        hw = self.hw
        efficiency = {"matmul": hw.matmul_efficiency, "attention": hw.attention_efficiency}.get(kind)
        seconds = max(flops / (hw.peak_tflops * 1e12 * efficiency) if efficiency else 0.0, nbytes / (hw.hbm_gbs * 1e9))
        seconds += mask_evaluations * MASK_EVALUATION_OPS / (hw.peak_tflops * 1e12 * CUDA_CORE_SHARE)
        if kind in self.tally.flops:
            self.tally.flops[kind] += flops
        self.tally.device_bytes += nbytes
        self.tally.mask_evaluations += mask_evaluations
        category = self._category or (ATTENTION if kind == "attention" else MASKS if mask_evaluations else COMPUTE)
        self.run(seconds, OPTIMIZER if self._optimizer else category, launches, name)

    def cost(self, cost: Any) -> None:
        """A kernel of one of gpu_forms' forms, by its KernelCost."""
        self.kernel(cost.flops, cost.kind, cost.bytes, cost.launches, cost.mask_evaluations, cost.name)

    def triton(self, kernel: Any, grid: tuple, args: tuple, kwargs: dict) -> None:
        """A launch of one of our Triton kernels (memory-bound: norms, RoPE, SwiGLU): its tensors' bytes."""
        self.kernel(0.0, "memory", sum(_nbytes(t) for t in plain_tensors(tree_leaves((args, kwargs)))),
                    name=f"triton {getattr(kernel, '__name__', kernel)}")

    # ------------------------------------------------------------------ the dispatch mode
    def __enter__(self) -> "Roofline":
        self._fake_mode = active_fake_mode()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if active_fake_mode() is not self._fake_mode:   # DTensor's sharding propagation, in a fake mode of its own
            return func(*args, **kwargs)
        inputs = list(plain_tensors(tree_leaves((args, kwargs))))
        for t in inputs:
            self._await(t)
        out = func(*args, **kwargs)
        if func.namespace == "c10d":
            self._collective(func, args, kwargs)
        elif func is aten._local_scalar_dense.default:
            self.tally.host_syncs += args[0].device.type == "meta"     # a read of the device's (a host tensor's waits
                                                                        # for nothing: measure.count_host_syncs)
        elif func.namespace not in ("prim", "profiler") and func not in _NO_KERNEL and not func.is_view:
            self._op(func, args, kwargs, inputs, out)
        return out

    def _await(self, t: torch.Tensor) -> None:
        until = self._pending.pop(t.untyped_storage()._cdata, None)
        if until is not None:
            self.wait(self.current, until, COMMUNICATION)

    def _op(self, func: Any, args: tuple, kwargs: dict, inputs: list, out: Any) -> None:
        outputs = list(plain_tensors(tree_leaves(out)))
        kinds = {t.device.type for t in inputs + outputs}
        if "meta" in kinds and "cpu" in kinds and func in (aten._to_copy.default, aten.copy_.default):
            self._copy(func, args, kwargs)
        elif "meta" not in kinds:
            if self._optimizer:      # the optimizer on the host's cores; other host ops are index bookkeeping
                elements = sum(t.numel() for t in plain_tensors(tree_leaves(args[:1])))
                self.run(elements / (self.hw.host_adam_gparams * 1e9 * HOST_ADAM_PASSES), OPTIMIZER, 0,
                         f"host {func}")
        elif func in self.costs:
            self.cost(self.costs[func](*args, **kwargs))
        else:
            written = outputs or _written(func, args, kwargs)     # an in-place foreach op returns nothing
            nbytes = sum(_nbytes(t) for t in inputs + written if t.device.type == "meta")
            flops, kind = _flops(func, args, kwargs, out)
            self.kernel(flops, kind, nbytes, name=str(func))

    def _copy(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A copy between the host and the device, at host_gbs; a blocking one to the host is a host sync."""
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            to_host = dst.device.type == "cpu"
        else:
            src, non_blocking = args[0], bool(kwargs.get("non_blocking", False))
            to_host = src.device.type == "meta"
        nbytes = _nbytes(src)
        self.tally.host_bytes += nbytes
        self.tally.host_syncs += to_host and not non_blocking
        self.run(nbytes / (self.hw.host_gbs * 1e9), OPTIMIZER if self._optimizer else HOST_COPIES,
                 name=f"copy to the {'host' if to_host else 'device'}")

    def _collective(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A collective on its group's channel: the bytes a rank sends, at the group's link."""
        name = func.overloadpacket.__name__
        boxed = next((a for a in args if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())),
                     None)
        if boxed is None or name not in _COLLECTIVE_FACTOR:
            return
        group = dist.ProcessGroup.unbox(boxed)
        ranks = dist.get_process_group_ranks(group)
        n, span = len(ranks), max(ranks) - min(ranks) + 1
        buffers = list(plain_tensors(tree_leaves(args)))
        size = max((_nbytes(t) for t in buffers), default=0)
        moved = size * (_COLLECTIVE_FACTOR[name] * (n - 1) / n if _COLLECTIVE_FACTOR[name] else 1.0)
        where = "intra-node" if span <= self.hw.gpus_per_node else "inter-node"
        key = f"{name.strip('_')} over {n} ranks ({where})"
        self.tally.collective_bytes[key] = self.tally.collective_bytes.get(key, 0.0) + moved
        channel = (group.group_name, name if name in ("send", "recv_") else "collective")
        start = max(self._channels.get(channel, 0.0), self.current.clock)
        end = self._channels[channel] = start + moved / self.hw.link(span)
        if not _argument(func, args, kwargs, "async_op", True):
            self.wait(self.current, end, COMMUNICATION)
        elif name != "send":         # the buffers it writes are ready when it ends
            written = buffers if name in ("allreduce_", "broadcast_", "recv_") else buffers[:1]
            for t in written:
                self._pending[t.untyped_storage()._cdata] = end

    def result(self, micro_batches: int, traced: int) -> Tally:
        """The tally of an optimizer step of `micro_batches` of which `traced` ran: parts named "micro-batch" (one
        each) as the first, the last and `micro_batches` - 2 times the middle one when three of more ran; a part
        named "micro-batches" (a pipeline's schedule, all of them) times micro_batches / traced; the other
        parts (before the first, the optimizer's) once."""
        each = [t for name, t in self.parts if name == "micro-batch"]
        total = Tally()
        for name, t in self.parts:
            if name == "micro-batches":
                total.add(t, micro_batches / traced)
            elif name != "micro-batch":
                total.add(t)
        if len(each) == 3 and micro_batches > 3:
            total.add(each[0])
            total.add(each[2])
            total.add(each[1], micro_batches - 2)
        else:
            for t in each:
                total.add(t, micro_batches / len(each) if len(each) < micro_batches else 1.0)
        return total


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a call of `func` writes in place (its schema's mutable arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            out += plain_tensors(tree_leaves(value))
    return out


def _argument(func: Any, args: tuple, kwargs: dict, name: str, default: Any) -> Any:
    """The value of argument `name` of a call of `func` (by its schema)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name, default)
    return default


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[float, str]:
    """(FLOPs, class) of an aten op by torch's formula: matmul, attention (scaled to the pairs causality
    leaves), or memory (no formula: memory-bound)."""
    formula = flop_registry.get(func.overloadpacket) or _IN_PLACE.get(func.overloadpacket)
    if formula is None:
        return 0.0, "memory"
    flops = float(formula(*args, **kwargs, out_val=out))
    if func.overloadpacket.__name__ not in _ATTENTION_OPS:
        return flops, "matmul"
    if _argument(func, args, kwargs, "is_causal", False):
        key = _argument(func, args, kwargs, "key", None)
        keys = key.shape[-2] if func.overloadpacket.__name__.startswith("_scaled") else key.shape[1]
        flops *= (keys + 1) / (2 * keys)
    return flops, "attention"
