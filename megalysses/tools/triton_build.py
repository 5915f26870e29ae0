"""Build the Triton kernels a training step launches for a CUDA GPU, on any machine, GPU or not.

record_step: one forward and backward of a one-block model of a config's shapes, on the host, inside
triton_support.launches_to: each Triton launch is recorded (kernel, argument types, block
sizes, warps, and the hints Triton's JIT derives from argument values) instead of run, with the grid
and blocks planned as on the GPU. apply_rope, the public rotary op that the block's fused rope_qkv
replaces, is recorded too, at the block's query shape.

build: one recorded launch compiled by Triton for a compute capability (PTX, then a cubin through the
ptxas that Triton ships), and the cubin's registers per thread, stack bytes (register spills) and
shared memory read back by cuobjdump.

What this shows without a GPU: that the kernels compile for the target at the block sizes and dtypes a
real step asks for (the CPU interpreter runs them without compiling), that they fit a block's shared
memory, and whether they spill. What it cannot show: speed, or results on the device (the interpreter
tests and the GPU tier check those). benchmarks/kernel_build.py prints the table.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import re
import subprocess
import tempfile
from typing import Any, Iterator

import torch

from megalysses.config import ModelConfig
from megalysses.kernels.triton_support import LaunchHook, launches_to, triton_importable, triton_interpreting

KERNEL_MODULES = ("megalysses.kernels.rms_norm_triton", "megalysses.kernels.rope_triton",
                  "megalysses.kernels.swiglu_triton")
# shared memory one block may use, by compute capability (CUDA programming guide, "compute capabilities")
MAX_SHARED_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
H100_SMS = 132


@dataclasses.dataclass(frozen=True)
class Launch:
    kernel: Any                        # triton JITFunction
    signature: dict[str, str]          # parameter -> Triton type ("*bf16", "i32", "fp32", "constexpr")
    constexprs: dict[str, Any]         # the constexpr parameters, and integer arguments equal to 1
    attrs: dict[tuple, list]           # (argument index,) -> hints, e.g. [["tt.divisibility", 16]]
    options: dict[str, Any]            # num_warps, num_stages, ... as launched

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def key(self) -> tuple:
        """Launches with equal keys compile to the same binary."""
        return (self.name, tuple(self.signature.items()), tuple(self.constexprs.items()),
                tuple(sorted((k, str(v)) for k, v in self.attrs.items())), tuple(sorted(self.options.items())))


@dataclasses.dataclass(frozen=True)
class Build:
    kernel: str
    arch: int
    pointers: str                      # the pointer arguments' element types, in order
    num_warps: int
    registers: int                     # per thread
    spill_bytes: int                   # stack frame per thread: registers spilled to local memory
    shared_bytes: int

    @property
    def shared_fits(self) -> bool:
        return self.shared_bytes <= MAX_SHARED_BYTES.get(self.arch, min(MAX_SHARED_BYTES.values()))


@functools.lru_cache(maxsize=1)
def _cuda_backend() -> Any:
    import triton.compiler
    from triton.backends.compiler import GPUTarget

    return triton.compiler.make_backend(GPUTarget("cuda", 90, 32))


def _launch(kernel: Any, args: tuple, kwargs: dict) -> Launch:
    """The launch as Triton's JIT specialises it on a GPU: argument types, and the hints it derives from
    the values (pointers and integers divisible by 16; an integer equal to 1 becomes a constant). Tensors
    here are on the meta device, whose address 0 passes for the alignment a fresh CUDA allocation has."""
    from triton._C.libtriton import native_specialize_impl

    backend = _cuda_backend()
    names = [p.name for p in kernel.params]
    options = {k: v for k, v in kwargs.items() if k not in names}
    bound = inspect.signature(kernel.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in names})
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = bound.arguments[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
            continue
        kind, hint = native_specialize_impl(backend, value, False, not p.do_not_specialize,
                                            not p.do_not_specialize_on_alignment)
        signature[p.name] = kind
        if kind == "constexpr":
            constexprs[p.name] = hint
        elif isinstance(hint, str):
            attrs[(i,)] = backend.parse_attr(hint)
    return Launch(kernel, signature, constexprs, attrs, options)


@contextlib.contextmanager
def recording(sms: int = H100_SMS) -> Iterator[list[Launch]]:
    """Inside, our Triton kernels are recorded rather than launched (triton_support.launches_to), planned as
    for a GPU with `sms` SMs; the list fills as they are called. Outputs of recorded kernels are left
    uninitialised."""
    if not triton_importable():
        raise RuntimeError("triton is not importable: pip install triton (Linux x86-64)")
    if triton_interpreting():
        raise RuntimeError("TRITON_INTERPRET is set: the kernels would be built for the CPU interpreter, not a "
                           "GPU; unset it (it is read when a kernel module is first imported)")
    launches: list[Launch] = []

    def take(kernel: Any, grid: tuple, args: tuple, kwargs: dict) -> None:
        launches.append(_launch(kernel, args, kwargs))

    with launches_to(LaunchHook(sms, take)):
        yield launches


def one_block(model: ModelConfig) -> ModelConfig:
    """`model` with one block, our Triton kernels, SDPA attention and a small vocabulary (the vocabulary
    reaches no Triton kernel: the fused loss is torch). Its shapes are those of tp = 1, where the fused
    rope_qkv's tile (all of a token's heads) is largest; a tp rank's is a slice of it."""
    return dataclasses.replace(model, num_layers=1, vocab_size=256, kernels="triton", attention_backend="sdpa")


def record_step(model: ModelConfig, dtype: torch.dtype, tokens: int = 128, sms: int = H100_SMS) -> list[Launch]:
    """The Triton launches of one forward and backward of `model`'s block in `dtype` (see the module
    docstring), in call order."""
    from megalysses.kernels.rope import apply_rope, rope_cos_sin
    from megalysses.model.gpt import GPTStage

    cfg = one_block(model)
    with torch.device("meta"), recording(sms) as launches:       # shapes and dtypes only: nothing is computed
        stage = GPTStage(cfg).to(dtype)
        ids = torch.zeros(1, tokens, dtype=torch.long)
        positions = torch.arange(tokens)[None]
        stage(ids, positions).float().sum().backward()            # logits; the loss reaches no Triton kernel
        cos, sin = rope_cos_sin(positions, cfg.head_size, cfg.rope_theta, scaling=cfg.rope_scaling)
        q = torch.zeros(1, tokens, cfg.num_heads, cfg.head_size, dtype=dtype, requires_grad=True)
        apply_rope(q, cos, sin, impl="triton").sum().backward()
    return launches


def _resources(cubin: bytes, arch: int) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) of a one-kernel cubin, from cuobjdump."""
    import triton

    tool = triton.knobs.nvidia.cuobjdump.path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage for an sm_{arch} cubin:\n{out}")
    return int(found.group(1)), int(found.group(2))


def build(launch: Launch, arch: int) -> Build:
    """`launch`'s kernel compiled for compute capability `arch` (80 = A100, 90 = H100/H200)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=launch.kernel, signature=launch.signature, constexprs=launch.constexprs, attrs=launch.attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
    registers, stack = _resources(compiled.asm["cubin"], arch)
    pointers = ",".join(t[1:] for t in launch.signature.values() if t.startswith("*"))
    return Build(launch.name, arch, pointers, compiled.metadata.num_warps, registers,
                 stack, compiled.metadata.shared)


def unique(launches: list[Launch]) -> list[Launch]:
    """One launch per binary, in first-call order."""
    seen: dict[tuple, Launch] = {}
    for launch in launches:
        seen.setdefault(launch.key(), launch)
    return list(seen.values())
