"""SwiGLU on the fused gate-up projection output: the pure-PyTorch reference and a fused Triton kernel
behind one dispatch point.

The gate and up features are interleaved along the last dim (feature i: gate at 2i, up at 2i + 1;
see model.layers.MLP), so y (..., f) = silu(x[..., 0::2]) * x[..., 1::2] for x (..., 2f).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from megalysses.kernels.triton_support import choose_impl


def swiglu_torch(gate_up: Tensor) -> Tensor:
    """Reference: silu(gate) * up in the input dtype, as Hugging Face Llama's MLP computes it."""
    gate, up = gate_up.unflatten(-1, (-1, 2)).unbind(-1)          # (..., f) each, strided views
    return F.silu(gate) * up


def swiglu(gate_up: Tensor, impl: str = "torch") -> Tensor:
    """silu(gate) * up from the interleaved (..., 2f) gate-up output -> (..., f).

    impl: "torch" (reference), "triton" (one kernel forward, one backward, fp32 arithmetic, saving only
    the input), "liger" (liger-kernel's, on contiguous gate and up halves); the run plan chooses (model.kernels)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dim ({gate_up.shape[-1]}) holds gate/up pairs and must be even")
    impl = choose_impl(impl, gate_up, "swiglu")
    if impl == "torch":
        return swiglu_torch(gate_up)
    if impl == "liger":
        from megalysses.kernels import external
        return external.swiglu(gate_up)
    from megalysses.kernels.swiglu_triton import SwiGLUTriton
    return SwiGLUTriton.apply(gate_up)
