"""Kernels, each beside its pure-PyTorch reference behind one dispatch point.

    attention.py   core_attention: exact causal / packed-document attention (reference, sdpa, flex, flash)
    norms.py       rms_norm: torch reference or fused Triton forward + backward
    rope.py        rope_cos_sin, apply_rope: Hugging Face Llama rotary embedding, torch or Triton

Optional accelerators (flash-attn, triton) are imported only when present; the CPU path always works.
"""
from megalysses.kernels.attention import (AttentionMask, available_backends, core_attention, doc_ids_to_cu_seqlens,
                                          prepare_attention_mask)
from megalysses.kernels.norms import rms_norm
from megalysses.kernels.rope import apply_rope, rope_cos_sin

__all__ = ["AttentionMask", "available_backends", "core_attention", "doc_ids_to_cu_seqlens", "prepare_attention_mask",
           "rms_norm", "apply_rope", "rope_cos_sin"]
