"""Rotary position embedding in the Hugging Face Llama convention (rotate_half: the head dim is split
into a first and a second half, not interleaved pairs), so that converted Llama weights give the same
logits. A pure-PyTorch reference and a Triton kernel behind one dispatch point.

    cos, sin = rope_cos_sin(position_ids, head_dim, theta)   # (B, S, D), once per step
    q = apply_rope(q, cos, sin)                               # (B, S, H, D)
"""
from __future__ import annotations

import torch
from torch import Tensor

from megalysses.kernels.triton_support import choose_impl


def rope_cos_sin(position_ids: Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos and sin (B, S, D) for integer positions (B, S): angle[..., i] = pos * theta^(-2i/D) for
    i < D/2, repeated for the second half (HF's cat(freqs, freqs)); computed in fp32, then cast."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=position_ids.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)                                 # (D/2,)
    freqs = position_ids.float()[..., None] * inv_freq                    # (B, S, D/2)
    angles = torch.cat([freqs, freqs], dim=-1)                            # (B, S, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope_torch(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Reference: x * cos + rotate_half(x) * sin in x's dtype, exactly HF's apply_rotary_pos_emb.
    x (B, S, H, D), cos, sin (B, S, D) -> (B, S, H, D)."""
    cos = cos.unsqueeze(2).to(x.dtype)                                    # (B, S, 1, D)
    sin = sin.unsqueeze(2).to(x.dtype)
    return x * cos + rotate_half(x) * sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, impl: str = "auto") -> Tensor:
    """Rotate x (B, S, H, D) by the angles in cos, sin (B, S, D) (from rope_cos_sin) -> (B, S, H, D).

    impl: "torch" (reference, bit-identical to HF), "triton" (fused forward + backward in fp32; CUDA,
    or CPU under TRITON_INTERPRET=1), or "auto" (the torch reference; Triton is opt-in).
    Gradients flow to x only."""
    if cos.shape != sin.shape or cos.shape[-1] != x.shape[-1] or cos.dim() != 3:
        raise ValueError(f"cos, sin must be (B, S, D) for x {tuple(x.shape)}; "
                         f"got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if choose_impl(impl, x, "apply_rope") == "torch":
        return apply_rope_torch(x, cos, sin)
    from megalysses.kernels.rope_triton import RoPETriton
    return RoPETriton.apply(x, cos, sin)
