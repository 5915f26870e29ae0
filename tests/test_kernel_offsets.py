"""Our Triton kernels index with 64-bit offsets: no element offset wraps at 2^31, the (tokens x hidden)
activation of 524,288 tokens at hidden 4096 (where kernels with 32-bit offsets fail, whatever the memory).

Each kernel a step launches runs under Triton's CPU interpreter as the last programs of a launch whose
rows start past 2^31 elements: program ids are moved up by a base (the interpreter's program id and
program count), and each tensor is a view into an anonymous mapping that the kernel touches only at
those rows (pages never touched cost nothing). The rows it writes must equal, bit for bit, those the same
kernel writes for the same input rows at offset 0. An offset computed in 32 bits wraps by 2^32 elements
and lands in the mapping's margin (2^31 elements on either side of the tensor's start), so the outputs
are wrong, not a crash: the check fails, naming the kernel and the tensor."""
import dataclasses
import importlib.util
import mmap
import sys
from typing import Callable

import numpy as np
import pytest
import torch

from megalysses.tools.triton_build import KERNEL_MODULES
from megalysses.kernels.triton_support import triton_importable

PROGRAMS = 4                    # programs (rows) run at each offset
MARGIN = 2 ** 31                # elements mapped before a tensor's start and at least after it
# Linux's MAP_NORESERVE (Python >= 3.12 names it): the mappings count against no commit limit
NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


@dataclasses.dataclass
class Case:
    """One kernel launch: per-row tensors (name -> (elements per row, dtype, written by the kernel)), tensors
    of a fixed size (name -> (elements, dtype)), the scalar arguments for a launch over `rows` rows, and the
    constexprs."""

    module: str
    kernel: str
    rows: dict[str, tuple[int, torch.dtype, bool]]
    fixed: dict[str, tuple[int, torch.dtype]]
    scalars: Callable[[int], dict]
    constexprs: dict

    @property
    def first_far_row(self) -> int:
        """The first row at which every per-row tensor's offsets pass 2^31 (one element a row, such as 1/rms,
        is indexed by the row itself, which is below 2^31)."""
        return -(-2 ** 31 // min(per_row for per_row, _, _ in self.rows.values() if per_row > 1))


BF16, F32 = torch.bfloat16, torch.float32
N = 64                                  # RMSNorm columns
H, D = 2, 16                            # RoPE heads and head dim
HK, REP = 1, 2                          # rope_qkv: KV heads, query heads per KV head
SWIGLU_BLOCK = 1024
RMS = "megalysses.kernels.rms_norm_triton"
ROPE = "megalysses.kernels.rope_triton"
SWIGLU = "megalysses.kernels.swiglu_triton"
CASES = {
    "rms_norm forward": Case(RMS, "_rms_norm_fwd", {"X": (N, BF16, False), "D": (N, BF16, False),
                                                    "R": (N, BF16, False), "Y": (N, BF16, True),
                                                    "RSTD": (1, F32, True)},
                             {"W": (N, F32)}, lambda rows: {"n_rows": rows, "n_cols": N, "eps": 1e-6},
                             {"BLOCK": N, "HAS_DELTA": False}),
    "add_rms_norm forward": Case(RMS, "_rms_norm_fwd", {"X": (N, BF16, False), "D": (N, BF16, False),
                                                        "R": (N, BF16, True), "Y": (N, BF16, True),
                                                        "RSTD": (1, F32, True)},
                                 {"W": (N, F32)}, lambda rows: {"n_rows": rows, "n_cols": N, "eps": 1e-6},
                                 {"BLOCK": N, "HAS_DELTA": True}),
    "rms_norm backward": Case(RMS, "_rms_norm_bwd", {"DY": (N, BF16, False), "X": (N, BF16, False),
                                                     "RSTD": (1, F32, False), "DX": (N, BF16, True),
                                                     "DW_PARTIAL": (N, F32, True), "DRES": (N, BF16, False)},
                              {"W": (N, F32)}, lambda rows: {"n_rows": rows, "n_cols": N},
                              {"BLOCK": N, "HAS_DRES": True}),
    "swiglu forward": Case(SWIGLU, "_swiglu_fwd", {"X": (2 * SWIGLU_BLOCK, BF16, False),
                                                   "Y": (SWIGLU_BLOCK, BF16, True)},
                           {}, lambda rows: {"n": rows * SWIGLU_BLOCK}, {"BLOCK": SWIGLU_BLOCK}),
    "swiglu backward": Case(SWIGLU, "_swiglu_bwd", {"X": (2 * SWIGLU_BLOCK, BF16, False),
                                                    "DY": (SWIGLU_BLOCK, BF16, False),
                                                    "DX": (2 * SWIGLU_BLOCK, BF16, True)},
                            {}, lambda rows: {"n": rows * SWIGLU_BLOCK}, {"BLOCK": SWIGLU_BLOCK}),
    "rope": Case(ROPE, "_rope_kernel", {"X": (H * D, BF16, False), "COS": (D, F32, False), "SIN": (D, F32, False),
                                        "Y": (H * D, BF16, True)},
                 {}, lambda rows: {"n_tokens": rows, "n_heads": H, "head_dim": D},
                 {"BACKWARD": False, "BLOCK_H": H, "BLOCK_HALF": D // 2}),
    "rope_qkv forward": Case(ROPE, "_rope_qkv_kernel", {"QKV": (HK * (REP + 2) * D, BF16, False),
                                                        "COS": (D, F32, False), "SIN": (D, F32, False),
                                                        "Q": (HK * REP * D, BF16, True), "K": (HK * D, BF16, True),
                                                        "V": (HK * D, BF16, True)},
                             {}, lambda rows: {"n_tokens": rows, "n_groups": HK, "rep": REP, "head_dim": D},
                             {"BACKWARD": False, "BLOCK_SLOTS": HK * (REP + 2), "BLOCK_HALF": D // 2}),
    "rope_qkv backward": Case(ROPE, "_rope_qkv_kernel", {"QKV": (HK * (REP + 2) * D, BF16, True),
                                                         "COS": (D, F32, False), "SIN": (D, F32, False),
                                                         "Q": (HK * REP * D, BF16, False), "K": (HK * D, BF16, False),
                                                         "V": (HK * D, BF16, False)},
                              {}, lambda rows: {"n_tokens": rows, "n_groups": HK, "rep": REP, "head_dim": D},
                              {"BACKWARD": True, "BLOCK_SLOTS": HK * (REP + 2), "BLOCK_HALF": D // 2}),
}


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Fresh copies of the kernel modules with their kernels decorated for Triton's CPU interpreter (whatever
    this process imported before, compiled kernels on a GPU included)."""
    if not triton_importable():
        pytest.skip("triton is not installed (pip install triton; its CPU interpreter runs the kernels)")
    from megalysses.testing import triton_interpreter_runs_our_kernels

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        if not triton_interpreter_runs_our_kernels():
            pytest.skip("this Triton's CPU interpreter cannot run loops bounded by the program id with this numpy "
                        "(Triton 3.6 and older with numpy 2.4: pip install 'numpy<2.4')")
        modules = {}
        for name in KERNEL_MODULES:
            spec = importlib.util.find_spec(name)
            copy = importlib.util.spec_from_file_location(name + "_interpreted", spec.origin)
            modules[name] = importlib.util.module_from_spec(copy)
            copy.loader.exec_module(modules[name])
        yield modules


class FarMemory:
    """Tensors whose element 0 sits MARGIN elements into an anonymous mapping at least MARGIN elements longer:
    any 32-bit offset from their start stays inside it."""

    def __init__(self) -> None:
        self.maps: list[mmap.mmap] = []

    def tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = torch.empty(0, dtype=dtype).element_size()
        mm = mmap.mmap(-1, (MARGIN + max(numel, MARGIN)) * size,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | NORESERVE)
        self.maps.append(mm)
        return torch.frombuffer(mm, dtype=torch.uint8, offset=MARGIN * size, count=numel * size).view(dtype)


class ProgramIdsFrom:
    """Inside, the interpreter's programs have ids base, base + 1, ... and count base + grid programs."""

    def __init__(self, base: int) -> None:
        from triton.runtime import interpreter

        self.base, self.builder, self.handle = base, interpreter.interpreter_builder, interpreter.TensorHandle

    def _shifted(self, value: int):
        import triton.language as tl

        assert value < 2 ** 31, "program ids are 32-bit"
        return self.handle(np.array([value], dtype=np.int32), tl.int32)

    def __enter__(self):
        b = self.builder
        b.create_get_program_id = lambda axis: self._shifted(b.grid_idx[axis] + (self.base if axis == 0 else 0))
        b.create_get_num_programs = lambda axis: self._shifted(b.grid_dim[axis] + (self.base if axis == 0 else 0))
        return self

    def __exit__(self, *exc):
        del self.builder.create_get_program_id, self.builder.create_get_num_programs


def _inputs(case: Case) -> dict[str, torch.Tensor]:
    """PROGRAMS rows of every tensor the kernel reads, and the fixed tensors."""
    g = torch.Generator().manual_seed(0)
    out = {name: (torch.rand(PROGRAMS, per_row, generator=g) + 0.5 if name == "RSTD" else
                  torch.randn(PROGRAMS, per_row, generator=g)).to(dtype)
           for name, (per_row, dtype, written) in case.rows.items() if not written}
    out.update({name: (1 + torch.randn(n, generator=g)).to(dtype) for name, (n, dtype) in case.fixed.items()})
    return out


def launch(kernel, case: Case, first_row: int, memory: FarMemory) -> dict[str, torch.Tensor]:
    """Run `kernel` over rows first_row ... first_row + PROGRAMS - 1 (one program each) of tensors that hold
    _inputs there; returns the written rows of each tensor the kernel writes."""
    rows = first_row + PROGRAMS
    inputs = _inputs(case)
    args = {}
    for name, (per_row, dtype, written) in case.rows.items():
        t = memory.tensor(rows * per_row, dtype) if first_row else torch.empty(rows * per_row, dtype=dtype)
        part = t[first_row * per_row:].view(PROGRAMS, per_row)
        part.zero_() if written else part.copy_(inputs[name])
        args[name] = t
    args.update({name: inputs[name] for name in case.fixed})
    with ProgramIdsFrom(first_row):
        kernel[(PROGRAMS,)](**args, **case.scalars(rows), **case.constexprs)
    return {name: args[name][first_row * per_row:].view(PROGRAMS, per_row).clone()
            for name, (per_row, _, written) in case.rows.items() if written}


def test_every_launched_kernel_is_covered(interpreted):
    launched = {k for m in interpreted.values() for k in m.LAUNCHED}
    assert launched == {c.kernel for c in CASES.values()}, launched


@pytest.mark.parametrize("name", list(CASES))
def test_offsets_past_two_to_the_31(interpreted, name):
    case = CASES[name]
    kernel = getattr(interpreted[case.module], case.kernel)
    far_row = case.first_far_row
    assert far_row * min(per_row for per_row, _, _ in case.rows.values() if per_row > 1) >= 2 ** 31
    memory = FarMemory()
    near = launch(kernel, case, 0, memory)
    far = launch(kernel, case, far_row, memory)
    for tensor, rows in near.items():
        assert rows.abs().sum() > 0, f"{name}: {tensor} was not written at offset 0"
        same = torch.equal(far[tensor], rows)
        assert same, f"{name}: {tensor} differs at element offsets past 2^31 (row {far_row}): a 32-bit offset wrapped"
